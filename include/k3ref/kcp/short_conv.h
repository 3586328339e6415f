// The short convolution in front of KDA's q, k and v (FLA's ShortConvolution with
// activation='silu', kernel width 4) and its halo exchange under context parallelism.
//
// Depthwise causal convolution per channel c, width W, inputs x [B, T, D]:
//   y_t[c] = act( bias[c] + sum_{i=0}^{W-1} weight[c, i] * x_{t-(W-1)+i}[c] )
// where positions before a document's first token read the document's convolution state
// (the W - 1 inputs before it, oldest first; zero when absent), never another document.
// This is F.conv1d(x, weight[:, None, :], bias, padding=W-1, groups=D)[..., :T] per
// document (cross-correlation, weight[:, W-1] multiplies the current token). The state
// after a document is its last W - 1 inputs (FLA's decode cache [N, D, W] holds the last W
// inputs including the current one; causal_conv1d's initial_states [N, D, W-1] is this one).
//
// Under context parallelism a rank needs the W - 1 inputs before its first token, if its
// first document began earlier: the halo. It is a scan too (state_out = last W - 1 of
// state_in ++ own tokens); a rank with fewer than W - 1 tokens must forward what it
// received, which a "previous rank's last W - 1 tokens" exchange gets wrong.
#pragma once

#include <optional>
#include <vector>

#include "k3ref/kcp/plan.h"
#include "k3ref/kda/stages.h"

namespace k3ref::kcp {

enum class ConvActivation { none, silu };

template <class S>
struct ShortConvInputs {
  Tensor<S> x;                                          // [B, T, D]
  Tensor<S> weight;                                     // [D, W]
  std::optional<Tensor<S>> bias;                        // [D]
  std::optional<Tensor<S>> initial_state;               // [N, D, W - 1], oldest first
  std::optional<std::vector<std::int64_t>> cu_seqlens;  // [N + 1], requires B == 1
};

template <class S>
struct ShortConvOutputs {
  Tensor<S> y;            // [B, T, D]
  Tensor<S> final_state;  // [N, D, W - 1]
};

template <class S>
S silu(const S& x) {
  static_assert(num::scalar_traits<S>::has_transcendentals, "silu needs exp");
  return x * kda::sigmoid(x);
}

template <class S>
S conv_activate(const S& x, ConvActivation act) {
  if (act == ConvActivation::none) return x;
  if constexpr (num::scalar_traits<S>::has_transcendentals) {
    return silu(x);
  } else {
    throw InvalidArgument("kcp::short_conv: activation 'silu' needs exp; use 'none' in exact arithmetic");
  }
}

// The reference.
template <class S>
ShortConvOutputs<S> short_conv_forward(const ShortConvInputs<S>& in, ConvActivation act) {
  if (in.x.rank() != 3) throw InvalidArgument("kcp::short_conv_forward: argument 'x': expected [B, T, D]");
  const std::int64_t B = in.x.dim(0), T = in.x.dim(1), D = in.x.dim(2);
  if (in.weight.rank() != 2 || in.weight.dim(0) != D || in.weight.dim(1) < 1)
    throw InvalidArgument("kcp::short_conv_forward: argument 'weight': expected [D, W] with W >= 1");
  const std::int64_t W = in.weight.dim(1);
  if (in.bias && in.bias->shape() != Shape{D}) throw InvalidArgument("kcp::short_conv_forward: argument 'bias': expected [D]");
  std::vector<std::int64_t> begin, end, row;
  if (in.cu_seqlens) {
    const auto& cu = *in.cu_seqlens;
    if (B != 1) throw InvalidArgument("kcp::short_conv_forward: argument 'cu_seqlens': requires B == 1");
    if (cu.size() < 2 || cu.front() != 0 || cu.back() != T)
      throw InvalidArgument("kcp::short_conv_forward: argument 'cu_seqlens': must run from 0 to T");
    for (std::size_t n = 0; n + 1 < cu.size(); ++n) {
      if (cu[n + 1] < cu[n]) throw InvalidArgument("kcp::short_conv_forward: argument 'cu_seqlens': must be non-decreasing");
      begin.push_back(cu[n]);
      end.push_back(cu[n + 1]);
      row.push_back(0);
    }
  } else {
    for (std::int64_t b = 0; b < B; ++b) {
      begin.push_back(0);
      end.push_back(T);
      row.push_back(b);
    }
  }
  const std::int64_t N = static_cast<std::int64_t>(begin.size());
  if (in.initial_state && in.initial_state->shape() != Shape{N, D, W - 1})
    throw InvalidArgument("kcp::short_conv_forward: argument 'initial_state': expected [N, D, W - 1]");
  ShortConvOutputs<S> out{Tensor<S>({B, T, D}), Tensor<S>({N, D, W - 1})};
  for (std::int64_t n = 0; n < N; ++n) {
    const std::int64_t b = row[static_cast<std::size_t>(n)], t0 = begin[static_cast<std::size_t>(n)],
                       t1 = end[static_cast<std::size_t>(n)];
    // Input at position tau of the document, reading the state before its start.
    auto input = [&](std::int64_t tau, std::int64_t c) -> S {
      if (tau >= t0) return in.x(b, tau, c);
      const std::int64_t back = t0 - tau;  // 1 = newest state entry
      return in.initial_state ? (*in.initial_state)(n, c, W - 1 - back) : S(0);
    };
    for (std::int64_t t = t0; t < t1; ++t)
      for (std::int64_t c = 0; c < D; ++c) {
        S acc = in.bias ? (*in.bias)(c) : S(0);
        for (std::int64_t i = 0; i < W; ++i) acc += in.weight(c, i) * input(t - (W - 1) + i, c);
        out.y(b, t, c) = conv_activate(acc, act);
      }
    for (std::int64_t c = 0; c < D; ++c)
      for (std::int64_t m = 0; m < W - 1; ++m) out.final_state(n, c, m) = input(t1 - (W - 1) + m, c);
  }
  return out;
}

// How a rank obtains its halo.
enum class HaloRule {
  chained,             // each rank forwards last W - 1 of (what it received ++ its own tokens): always right
  previous_rank_only,  // only the previous rank's own last W - 1 tokens: wrong when that rank is shorter
};

template <class S>
struct ShortConvSplitResult {
  Plan plan;
  std::vector<Tensor<S>> halos;        // per rank [D, W - 1]: the state its first document starts from
  std::vector<std::int64_t> halo_hops;  // per rank: how many earlier ranks' tokens its halo holds
  ShortConvOutputs<S> out;              // gathered
};

// Split into ranks at `splits` (B == 1), exchange halos, run each rank's slice with the
// reference, gather.
template <class S>
ShortConvSplitResult<S> short_conv_context_parallel(const ShortConvInputs<S>& in, ConvActivation act,
                                                    const std::vector<std::int64_t>& splits,
                                                    HaloRule rule = HaloRule::chained) {
  if (in.x.rank() != 3 || in.x.dim(0) != 1)
    throw InvalidArgument("kcp::short_conv_context_parallel: argument 'x': expected [1, T, D]");
  const std::int64_t T = in.x.dim(1), D = in.x.dim(2), W = in.weight.dim(1);
  const std::vector<std::int64_t> cu = in.cu_seqlens ? *in.cu_seqlens : std::vector<std::int64_t>{0, T};
  ShortConvSplitResult<S> res;
  res.plan = plan_split(cu, splits);
  const Plan& plan = res.plan;
  const std::int64_t P = plan.num_ranks(), N = plan.num_docs();
  auto initial = [&](std::int64_t n) {
    Tensor<S> s({D, W - 1});
    if (in.initial_state)
      for (std::int64_t c = 0; c < D; ++c)
        for (std::int64_t m = 0; m < W - 1; ++m) s(c, m) = (*in.initial_state)(n, c, m);
    return s;
  };
  // Window of the W - 1 inputs before position `at` of document n, from `state` (the
  // window before `from`) followed by the tokens [from, at).
  auto window = [&](const Tensor<S>& state, std::int64_t from, std::int64_t at) {
    Tensor<S> s({D, W - 1});
    for (std::int64_t m = 0; m < W - 1; ++m) {
      const std::int64_t tau = at - (W - 1) + m;
      for (std::int64_t c = 0; c < D; ++c) s(c, m) = tau >= from ? in.x(0, tau, c) : state(c, W - 1 - (from - tau));
    }
    return s;
  };
  res.halos.assign(static_cast<std::size_t>(P), Tensor<S>({D, W - 1}));
  res.halo_hops.assign(static_cast<std::size_t>(P), 0);
  Tensor<S> outgoing({D, W - 1});  // window after the last non-empty rank so far, for its last document
  std::int64_t prev = -1;          // last non-empty rank so far
  for (std::int64_t r = 0; r < P; ++r) {
    const RankSlice& s = plan.ranks[static_cast<std::size_t>(r)];
    if (s.empty()) continue;
    const std::int64_t doc_start = cu[static_cast<std::size_t>(s.first_doc)];
    Tensor<S> halo = initial(s.first_doc);
    if (s.continues) {
      if (rule == HaloRule::chained) {
        halo = outgoing;
      } else {
        const RankSlice& p = plan.ranks[static_cast<std::size_t>(prev)];
        const std::int64_t from = std::max(p.begin, doc_start);  // tokens the previous rank holds
        Tensor<S> state = from == doc_start ? initial(s.first_doc) : Tensor<S>({D, W - 1});  // missing: zeros
        halo = window(state, from, s.begin);
      }
      // Earlier ranks whose tokens fall in the window [begin - (W - 1), begin) of this document.
      const std::int64_t lo = std::max(doc_start, s.begin - (W - 1));
      for (std::int64_t j = r - 1; j >= 0; --j) {
        const RankSlice& q = plan.ranks[static_cast<std::size_t>(j)];
        if (!q.empty() && q.end > lo) ++res.halo_hops[static_cast<std::size_t>(r)];
      }
    }
    res.halos[static_cast<std::size_t>(r)] = halo;
    // What leaves this rank for its last document.
    const Tensor<S> last_in = s.last_doc == s.first_doc ? halo : initial(s.last_doc);
    outgoing = window(last_in, s.last_part_begin, s.end);
    prev = r;
  }
  // Each rank runs the reference on its slice.
  res.out = ShortConvOutputs<S>{Tensor<S>({1, T, D}), Tensor<S>({N, D, W - 1})};
  for (std::int64_t n = 0; n < N; ++n)
    if (cu[static_cast<std::size_t>(n)] == cu[static_cast<std::size_t>(n) + 1]) {
      const Tensor<S> s = initial(n);
      std::copy(s.data(), s.data() + s.numel(), res.out.final_state.data() + n * s.numel());
    }
  for (std::int64_t r = 0; r < P; ++r) {
    const RankSlice& s = plan.ranks[static_cast<std::size_t>(r)];
    if (s.empty()) continue;
    const std::int64_t L = s.end - s.begin, local_docs = static_cast<std::int64_t>(s.local_cu_seqlens.size()) - 1;
    ShortConvInputs<S> part;
    part.x = Tensor<S>({1, L, D}, std::vector<S>(in.x.data() + s.begin * D, in.x.data() + s.end * D));
    part.weight = in.weight;
    part.bias = in.bias;
    part.cu_seqlens = s.local_cu_seqlens;
    Tensor<S> states({local_docs, D, W - 1});
    for (std::int64_t j = 0; j < local_docs; ++j) {
      const Tensor<S> st = j == 0 ? res.halos[static_cast<std::size_t>(r)] : initial(s.first_doc + j);
      std::copy(st.data(), st.data() + st.numel(), states.data() + j * st.numel());
    }
    part.initial_state = states;
    const auto local = short_conv_forward(part, act);
    std::copy(local.y.data(), local.y.data() + local.y.numel(), res.out.y.data() + s.begin * D);
    for (std::int64_t j = 0; j < local_docs; ++j) {
      const std::int64_t n = s.first_doc + j;
      if (cu[static_cast<std::size_t>(n) + 1] <= s.end)
        std::copy(local.final_state.data() + j * D * (W - 1), local.final_state.data() + (j + 1) * D * (W - 1),
                  res.out.final_state.data() + n * D * (W - 1));
    }
  }
  return res;
}

}  // namespace k3ref::kcp
