// Softmax over depth, and its split into partial statistics merged by the online-softmax
// rule (the two-phase inference of AttnRes, proofs/attnres_merge.md).
//
// For sources j with scores s_j and values x_j (vectors of width d, batched over T tokens):
//
//   statistics   (o, m, l) = (sum_j e(s_j - m) x_j,  max_j s_j,  sum_j e(s_j - m))
//   merge        m = max(m1, m2), c_i = e(m_i - m):  (o1 c1 + o2 c2, m, l1 c1 + l2 c2)
//   result       h = o / l = sum_j alpha_j x_j,  alpha_j = e(s_j - m) / sum_i e(s_i - m)
//
// e is a policy. With the exponential (StandardMath) this is ordinary softmax; with
// ExactWeights the "scores" are the exponentials themselves, given as exact positive
// rationals (s stands for e^s, so e(s, m) = s / m), and the merge identity
// merge(stats(A), stats(B)) == stats(A ∪ B) holds with == in num::rational. All that the
// identity needs of e is e(a - b) e(b - c) = e(a - c), which both policies satisfy exactly
// in exact arithmetic.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "k3ref/error.h"
#include "k3ref/tensor/tensor.h"

namespace k3ref::attnres {

// The two transcendental points of AttnRes (softmax exponential, RMSNorm square root).
struct StandardMath {
  // e^(score - max)
  template <class S>
  static S exp_diff(const S& score, const S& max) {
    using std::exp;
    return exp(score - max);
  }
  template <class S>
  static S sqrt(const S& x) {
    using std::sqrt;
    return sqrt(x);
  }
};

// Scores given as their exponentials (positive): e(w, w_max) = w / w_max. Order of the
// weights is the order of the scores they stand for, so max is unchanged in meaning.
struct ExactWeights {
  template <class S>
  static S exp_diff(const S& weight, const S& max_weight) {
    return weight / max_weight;
  }
};

// Phase-1 statistics of a set of sources, batched over tokens.
template <class S>
struct SoftmaxStats {
  Tensor<S> output;   // [T, d] unnormalised output sum_j e(s_j - m) x_j
  std::vector<S> max;  // [T] running maximum score m
  std::vector<S> sum;  // [T] sum of exponentials l = sum_j e(s_j - m)

  friend bool operator==(const SoftmaxStats&, const SoftmaxStats&) = default;
};

// scores[j][t] is source j's score for token t; sources[j] points to a [T, d] tensor.
template <class S>
struct Sources {
  std::vector<std::vector<S>> scores;
  std::vector<const Tensor<S>*> values;
};

namespace detail {
template <class S>
void check_sources(const Sources<S>& src, const char* what) {
  if (src.values.empty()) throw InvalidArgument(std::string(what) + ": needs at least one source");
  if (src.scores.size() != src.values.size())
    throw InvalidArgument(std::string(what) + ": " + std::to_string(src.scores.size()) + " score rows for " +
                          std::to_string(src.values.size()) + " sources");
  const Shape& shape = src.values[0]->shape();
  if (shape.size() != 2) throw InvalidArgument(std::string(what) + ": sources must be [T, d]");
  for (std::size_t j = 0; j < src.values.size(); ++j) {
    if (src.values[j]->shape() != shape || static_cast<std::int64_t>(src.scores[j].size()) != shape[0])
      throw InvalidArgument(std::string(what) + ": source " + std::to_string(j) + " has shape " +
                            shape_to_string(src.values[j]->shape()) + " / " + std::to_string(src.scores[j].size()) +
                            " scores, expected " + shape_to_string(shape));
  }
}

template <class S>
S max_score(const Sources<S>& src, std::size_t t) {
  S m = src.scores[0][t];
  for (std::size_t j = 1; j < src.scores.size(); ++j)
    if (m < src.scores[j][t]) m = src.scores[j][t];
  return m;
}
}  // namespace detail

// Phase 1: (o, m, l) over the given sources.
template <class Math, class S>
SoftmaxStats<S> stats_of(const Sources<S>& src) {
  detail::check_sources(src, "attnres::stats_of");
  const std::int64_t T = src.values[0]->dim(0), d = src.values[0]->dim(1);
  SoftmaxStats<S> st{Tensor<S>({T, d}), std::vector<S>(T), std::vector<S>(T)};
  for (std::int64_t t = 0; t < T; ++t) {
    const S m = detail::max_score(src, t);
    S l(0);
    for (std::size_t j = 0; j < src.values.size(); ++j) {
      const S e = Math::exp_diff(src.scores[j][t], m);
      l += e;
      for (std::int64_t k = 0; k < d; ++k) st.output(t, k) += e * (*src.values[j])(t, k);
    }
    st.max[t] = m;
    st.sum[t] = l;
  }
  return st;
}

// The online-softmax merge of two statistics over disjoint source sets.
template <class Math, class S>
SoftmaxStats<S> merge(const SoftmaxStats<S>& a, const SoftmaxStats<S>& b) {
  if (a.output.shape() != b.output.shape())
    throw InvalidArgument("attnres::merge: statistics of shapes " + shape_to_string(a.output.shape()) + " and " +
                          shape_to_string(b.output.shape()));
  const std::int64_t T = a.output.dim(0), d = a.output.dim(1);
  SoftmaxStats<S> st{Tensor<S>({T, d}), std::vector<S>(T), std::vector<S>(T)};
  for (std::int64_t t = 0; t < T; ++t) {
    const S m = a.max[t] < b.max[t] ? b.max[t] : a.max[t];
    const S ca = Math::exp_diff(a.max[t], m), cb = Math::exp_diff(b.max[t], m);
    for (std::int64_t k = 0; k < d; ++k) st.output(t, k) = a.output(t, k) * ca + b.output(t, k) * cb;
    st.max[t] = m;
    st.sum[t] = a.sum[t] * ca + b.sum[t] * cb;
  }
  return st;
}

// h = o / l.
template <class S>
Tensor<S> normalised(const SoftmaxStats<S>& st) {
  Tensor<S> h(st.output.shape());
  const std::int64_t T = h.dim(0), d = h.dim(1);
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t k = 0; k < d; ++k) h(t, k) = st.output(t, k) / st.sum[t];
  return h;
}

// The direct form: weights alpha [T, n] = softmax of the scores, h [T, d] = sum_j alpha_j x_j.
template <class S>
struct Average {
  Tensor<S> h;
  Tensor<S> alpha;
};

template <class Math, class S>
Average<S> softmax_average(const Sources<S>& src) {
  detail::check_sources(src, "attnres::softmax_average");
  const std::int64_t T = src.values[0]->dim(0), d = src.values[0]->dim(1);
  const std::int64_t n = static_cast<std::int64_t>(src.values.size());
  Average<S> out{Tensor<S>({T, d}), Tensor<S>({T, n})};
  for (std::int64_t t = 0; t < T; ++t) {
    const S m = detail::max_score(src, t);
    S z(0);
    for (std::int64_t j = 0; j < n; ++j) {
      out.alpha(t, j) = Math::exp_diff(src.scores[j][t], m);
      z += out.alpha(t, j);
    }
    for (std::int64_t j = 0; j < n; ++j) out.alpha(t, j) /= z;
    for (std::int64_t j = 0; j < n; ++j)
      for (std::int64_t k = 0; k < d; ++k) out.h(t, k) += out.alpha(t, j) * (*src.values[j])(t, k);
  }
  return out;
}

}  // namespace k3ref::attnres
