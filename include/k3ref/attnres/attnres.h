// Attention Residuals (docs/attnres.md): the residual sum replaced by a softmax over
// depth. Per token on vectors of width d, batched over T tokens, one template over the
// scalar (double, high_precision, rational with a deterministic Math, num::Dual for
// gradients).
//
// Sources: v_0 = the embedding, v_l = the output of layer l (1 <= l <= L; every attention
// and every MLP sublayer is a layer). Slot l (1 <= l <= L) is the input h_l of layer l;
// slot L + 1 is the final aggregation, fed to the output norm. Slot l has a query w_l and
// an RMSNorm weight g_l (rows l - 1 of `queries` and `norm_weights`); a source x scores
//
//   s(x) = w_l · (g_l ⊙ x / sqrt(mean(x²) + eps))          (key = RMSNorm(x), value = x)
//
// and h_l = sum_j softmax_j(s(x_j)) x_j, no 1/sqrt(d), no temperature.
//
//   full:  slot l attends over v_0 .. v_{l-1}; slot L + 1 over v_0 .. v_L.
//   block: layers in blocks of S (the last takes the remainder): block n (1-based) holds
//          layers (n-1)S+1 .. min(nS, L). b_0 = v_0, b_n = sum of block n's outputs.
//          Layer l at position i of block n attends over b_0 .. b_{n-1} plus, for i > 1,
//          the partial sum b_n^{i-1} of the outputs of the block's earlier layers; slot
//          L + 1 over b_0 .. b_N.
//   two-phase (block): phase 1 batches the layers of block n against b_0 .. b_{n-1} and
//          returns (o, m, l); phase 2 walks the block, merging each layer's statistics with
//          its partial sum's by the online-softmax rule (softmax_merge.h).
//
// The layer outputs are either given (teacher forcing: `values` [L+1, T, d], which is what
// a kernel consumes) or produced by a sublayer callable from h_l (model_forward).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "k3ref/attnres/softmax_merge.h"
#include "k3ref/error.h"
#include "k3ref/tensor/tensor.h"

namespace k3ref::attnres {

// Seconds per element of (L + 1)^2 x T x d (every slot's scores and sum over its sources),
// for progress estimates: full_forward at L + 1 = 17, T = 256, d = 64 on one thread of the
// idle 2-core development machine, the middle of three runs.
inline constexpr double seconds_per_element_double = 3e-9;
inline constexpr double seconds_per_element_multiprecision = 0.24e-6;

// Which block a layer is in. Blocks and positions are 1-based, as in the paper.
struct BlockLayout {
  std::int64_t layers = 0;      // L
  std::int64_t block_size = 1;  // S

  std::int64_t blocks() const { return block_size <= 0 ? 0 : (layers + block_size - 1) / block_size; }  // N
  std::int64_t block_of(std::int64_t l) const { return (l - 1) / block_size + 1; }
  std::int64_t position_of(std::int64_t l) const { return (l - 1) % block_size + 1; }
  std::int64_t first_layer(std::int64_t n) const { return (n - 1) * block_size + 1; }
  std::int64_t last_layer(std::int64_t n) const { return std::min(n * block_size, layers); }
  void validate() const {
    if (layers < 0) throw InvalidArgument("attnres: argument 'layers' must be >= 0");
    if (block_size < 1) throw InvalidArgument("attnres: argument 'block_size' must be >= 1");
  }
};

// The learned parameters of every slot.
template <class S>
struct Weights {
  Tensor<S> queries;       // [L + 1, d]
  Tensor<S> norm_weights;  // [L + 1, d]
  S eps = S(1e-6);
};

template <class S>
struct Outputs {
  Tensor<S> h;      // [L + 1, T, d]: row l - 1 is h_l; row L is the final aggregation
  Tensor<S> alpha;  // [L + 1, T, n_max]: weights; column j is source j (full: v_j; block: b_j,
                    // column n the partial sum), zero where slot l has no source j
  std::optional<Tensor<S>> block_sums;  // block forms: [N + 1, T, d], b_0 .. b_N
  // Two-phase only: the phase-1 statistics of each layer l (row l - 1) over b_0 .. b_{n-1}.
  std::optional<Tensor<S>> phase1_output;  // [L, T, d]
  std::optional<Tensor<S>> phase1_max;     // [L, T]
  std::optional<Tensor<S>> phase1_sum;     // [L, T]
};

namespace detail {

template <class S>
Tensor<S> row(const Tensor<S>& t, std::int64_t i) {
  Shape shape(t.shape().begin() + 1, t.shape().end());
  const std::int64_t n = checked_numel(shape, "row");
  std::vector<S> data(t.values().begin() + i * n, t.values().begin() + (i + 1) * n);
  return Tensor<S>(std::move(shape), std::move(data));
}

template <class S>
void set_row(Tensor<S>& t, std::int64_t i, const Tensor<S>& r) {
  std::copy(r.values().begin(), r.values().end(), t.values().begin() + i * r.numel());
}

// x / sqrt(mean(x²) + eps) per token: the weight-free part of RMSNorm, shared by every slot
// that scores this source (the batching of phase 1: each source is normalised once).
template <class Math, class S>
Tensor<S> rms_normalised(const Tensor<S>& x, const S& eps) {
  const std::int64_t T = x.dim(0), d = x.dim(1);
  Tensor<S> out({T, d});
  for (std::int64_t t = 0; t < T; ++t) {
    S ms(0);
    for (std::int64_t k = 0; k < d; ++k) ms += x(t, k) * x(t, k);
    const S inv = S(1) / Math::sqrt(ms / S(d) + eps);
    for (std::int64_t k = 0; k < d; ++k) out(t, k) = x(t, k) * inv;
  }
  return out;
}

// Scores of one source for slot `slot` (0-based row): w · (g ⊙ x̂) per token.
template <class S>
std::vector<S> slot_scores(const Weights<S>& w, std::int64_t slot, const Tensor<S>& normalised) {
  const std::int64_t T = normalised.dim(0), d = normalised.dim(1);
  std::vector<S> s(T);
  for (std::int64_t t = 0; t < T; ++t) {
    S acc(0);
    for (std::int64_t k = 0; k < d; ++k) acc += w.queries(slot, k) * (w.norm_weights(slot, k) * normalised(t, k));
    s[t] = acc;
  }
  return s;
}

// A source with its normalised key, computed once.
template <class S>
struct Source {
  Tensor<S> value;
  Tensor<S> normalised;
};

template <class Math, class S>
Source<S> make_source(Tensor<S> value, const S& eps) {
  Tensor<S> normalised = rms_normalised<Math>(value, eps);
  return Source<S>{std::move(value), std::move(normalised)};
}

template <class S>
Sources<S> gather(const Weights<S>& w, std::int64_t slot, const std::vector<const Source<S>*>& list) {
  Sources<S> src;
  for (const Source<S>* s : list) {
    src.scores.push_back(slot_scores(w, slot, s->normalised));
    src.values.push_back(&s->value);
  }
  return src;
}

template <class S>
void store_alpha(Tensor<S>& alpha, std::int64_t slot, const Tensor<S>& a) {
  for (std::int64_t t = 0; t < a.dim(0); ++t)
    for (std::int64_t j = 0; j < a.dim(1); ++j) alpha(slot, t, j) = a(t, j);
}

template <class S>
void check(const Weights<S>& w, std::int64_t L, std::int64_t d, const char* what) {
  const Shape expected{L + 1, d};
  if (w.queries.shape() != expected || w.norm_weights.shape() != expected)
    throw InvalidArgument(std::string(what) + ": queries " + shape_to_string(w.queries.shape()) + " and norm_weights " +
                          shape_to_string(w.norm_weights.shape()) + " must both be " + shape_to_string(expected));
}

}  // namespace detail

// Produces v_l [T, d] from l and h_l [T, d] (teacher forcing or a real sublayer).
template <class S>
using Sublayer = std::function<Tensor<S>(std::int64_t l, const Tensor<S>& h_l)>;

// ---- full AttnRes --------------------------------------------------------------------------

template <class S, class Math = StandardMath>
Outputs<S> full_forward_with(const Weights<S>& w, const Tensor<S>& embedding, std::int64_t L,
                             const Sublayer<S>& sublayer) {
  if (embedding.rank() != 2) throw InvalidArgument("attnres::full_forward: embedding must be [T, d]");
  const std::int64_t T = embedding.dim(0), d = embedding.dim(1);
  detail::check(w, L, d, "attnres::full_forward");
  Outputs<S> out{Tensor<S>({L + 1, T, d}), Tensor<S>({L + 1, T, L + 1}), {}, {}, {}, {}};
  std::vector<detail::Source<S>> sources;
  sources.reserve(L + 1);
  sources.push_back(detail::make_source<Math>(embedding, w.eps));
  for (std::int64_t l = 1; l <= L + 1; ++l) {
    std::vector<const detail::Source<S>*> list;
    for (const auto& s : sources) list.push_back(&s);
    const Average<S> avg = softmax_average<Math>(detail::gather(w, l - 1, list));
    detail::set_row(out.h, l - 1, avg.h);
    detail::store_alpha(out.alpha, l - 1, avg.alpha);
    if (l <= L) sources.push_back(detail::make_source<Math>(sublayer(l, avg.h), w.eps));
  }
  return out;
}

// Teacher forcing: values [L + 1, T, d] hold v_0 .. v_L.
template <class S, class Math = StandardMath>
Outputs<S> full_forward(const Weights<S>& w, const Tensor<S>& values) {
  if (values.rank() != 3 || values.dim(0) < 1) throw InvalidArgument("attnres::full_forward: values must be [L+1, T, d]");
  return full_forward_with<S, Math>(w, detail::row(values, 0), values.dim(0) - 1,
                                    [&](std::int64_t l, const Tensor<S>&) { return detail::row(values, l); });
}

// ---- block AttnRes -------------------------------------------------------------------------

enum class BlockForm { direct, two_phase };

template <class S, class Math = StandardMath>
Outputs<S> block_forward_with(const Weights<S>& w, const Tensor<S>& embedding, const BlockLayout& layout,
                              const Sublayer<S>& sublayer, BlockForm form = BlockForm::direct) {
  layout.validate();
  if (embedding.rank() != 2) throw InvalidArgument("attnres::block_forward: embedding must be [T, d]");
  const std::int64_t L = layout.layers, N = layout.blocks();
  const std::int64_t T = embedding.dim(0), d = embedding.dim(1);
  detail::check(w, L, d, "attnres::block_forward");
  Outputs<S> out{Tensor<S>({L + 1, T, d}), Tensor<S>({L + 1, T, N + 1}), Tensor<S>({N + 1, T, d}), {}, {}, {}};
  if (form == BlockForm::two_phase) {
    out.phase1_output = Tensor<S>({L, T, d});
    out.phase1_max = Tensor<S>({L, T});
    out.phase1_sum = Tensor<S>({L, T});
  }
  std::vector<detail::Source<S>> blocks;  // completed b_0 .. b_{n-1}
  blocks.reserve(N + 1);
  blocks.push_back(detail::make_source<Math>(embedding, w.eps));
  detail::set_row(*out.block_sums, 0, embedding);

  for (std::int64_t n = 1; n <= N; ++n) {
    const std::int64_t first = layout.first_layer(n), last = layout.last_layer(n);
    std::vector<const detail::Source<S>*> completed;
    for (const auto& b : blocks) completed.push_back(&b);

    // Phase 1 (two-phase form): every layer of the block against the completed blocks,
    // before any of them runs: it needs nothing from inside the block.
    std::vector<SoftmaxStats<S>> phase1;
    if (form == BlockForm::two_phase) {
      for (std::int64_t l = first; l <= last; ++l) {
        phase1.push_back(stats_of<Math>(detail::gather(w, l - 1, completed)));
        const SoftmaxStats<S>& st = phase1.back();
        detail::set_row(*out.phase1_output, l - 1, st.output);
        for (std::int64_t t = 0; t < T; ++t) {
          (*out.phase1_max)(l - 1, t) = st.max[t];
          (*out.phase1_sum)(l - 1, t) = st.sum[t];
        }
      }
    }

    Tensor<S> partial({T, d});  // b_n^{i-1}
    for (std::int64_t l = first; l <= last; ++l) {
      const std::int64_t i = l - first + 1;
      Tensor<S> h;
      std::optional<detail::Source<S>> partial_source;
      if (i > 1) partial_source = detail::make_source<Math>(partial, w.eps);
      std::vector<const detail::Source<S>*> list = completed;
      if (partial_source) list.push_back(&*partial_source);
      if (form == BlockForm::direct) {
        const Average<S> avg = softmax_average<Math>(detail::gather(w, l - 1, list));
        h = avg.h;
        detail::store_alpha(out.alpha, l - 1, avg.alpha);
      } else {
        // Phase 2: merge the layer's phase-1 statistics with its partial sum's.
        const SoftmaxStats<S>& st1 = phase1[static_cast<std::size_t>(l - first)];
        SoftmaxStats<S> st = st1;
        if (partial_source) st = merge<Math>(st1, stats_of<Math>(detail::gather(w, l - 1, {&*partial_source})));
        h = normalised(st);
        // alpha from the statistics: e(s_j - m) / l for each source
        const Sources<S> src = detail::gather(w, l - 1, list);
        for (std::int64_t t = 0; t < T; ++t)
          for (std::size_t j = 0; j < list.size(); ++j)
            out.alpha(l - 1, t, static_cast<std::int64_t>(j)) = Math::exp_diff(src.scores[j][t], st.max[t]) / st.sum[t];
      }
      detail::set_row(out.h, l - 1, h);
      const Tensor<S> v = sublayer(l, h);
      if (v.shape() != Shape{T, d})
        throw InvalidArgument("attnres::block_forward: layer " + std::to_string(l) + " output has shape " +
                              shape_to_string(v.shape()) + ", expected " + shape_to_string(Shape{T, d}));
      for (std::int64_t e = 0; e < partial.numel(); ++e) partial.values()[e] += v.values()[e];
    }
    detail::set_row(*out.block_sums, n, partial);
    blocks.push_back(detail::make_source<Math>(std::move(partial), w.eps));
  }

  // The final aggregation over b_0 .. b_N.
  std::vector<const detail::Source<S>*> all;
  for (const auto& b : blocks) all.push_back(&b);
  const Sources<S> src = detail::gather(w, L, all);
  if (form == BlockForm::direct) {
    const Average<S> avg = softmax_average<Math>(src);
    detail::set_row(out.h, L, avg.h);
    detail::store_alpha(out.alpha, L, avg.alpha);
  } else {
    // The output slot is the last block's next "layer": phase 1 over b_0 .. b_{N-1},
    // merged with the last block's (now complete) sum b_N.
    SoftmaxStats<S> st;
    if (N == 0) {
      st = stats_of<Math>(src);
    } else {
      std::vector<const detail::Source<S>*> earlier(all.begin(), all.end() - 1);
      st = merge<Math>(stats_of<Math>(detail::gather(w, L, earlier)),
                       stats_of<Math>(detail::gather(w, L, {all.back()})));
    }
    detail::set_row(out.h, L, normalised(st));
    for (std::int64_t t = 0; t < T; ++t)
      for (std::size_t j = 0; j < all.size(); ++j)
        out.alpha(L, t, static_cast<std::int64_t>(j)) = Math::exp_diff(src.scores[j][t], st.max[t]) / st.sum[t];
  }
  return out;
}

template <class S, class Math = StandardMath>
Outputs<S> block_forward(const Weights<S>& w, const Tensor<S>& values, std::int64_t block_size,
                         BlockForm form = BlockForm::direct) {
  if (values.rank() != 3 || values.dim(0) < 1) throw InvalidArgument("attnres::block_forward: values must be [L+1, T, d]");
  const BlockLayout layout{values.dim(0) - 1, block_size};
  return block_forward_with<S, Math>(
      w, detail::row(values, 0), layout, [&](std::int64_t l, const Tensor<S>&) { return detail::row(values, l); }, form);
}

}  // namespace k3ref::attnres
