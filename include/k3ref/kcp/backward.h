// The backward state pass of context parallelism: the gradient of a loss with respect to
// each rank's entering state, carried from later ranks to earlier ones.
//
// For a loss with upstream gradients dO = dL/do [1, T, HV, V] and dF = dL/d(final state)
// [N, HV, K, V], let G_t = dL/dS_t (state after token t, total). Since S_t = M_t S_{t-1} + ...
// and o_t = S_t^T q^_t (q^ = scale q),
//   dL/dS_{t-1} = M_t^T (q^_t dO_t^T + dL/dS_t through later tokens).
// Over a run of tokens this is again affine in the gradient arriving at its end:
//   Lambda_in = M^T Lambda_out + G~,
// M the run's forward transition and G~ the gradient reached from Lambda_out = 0 (local
// outputs and the final states of documents ending in the run). The pair (M^T, G~) is the
// run's adjoint fragment; the ranks' adjoint fragments compose in reverse order
// (a reverse scan with transposed transitions), and a document boundary cuts the carry
// exactly as in the forward pass (proofs/kcp_backward.md).
#pragma once

#include "k3ref/kcp/context_parallel.h"
#include "k3ref/kda/backward.h"

namespace k3ref::kcp {

template <class S>
struct StateBackwardResult {
  Plan plan;
  std::vector<Fragment<S>> adjoint_fragments;  // per rank: Lambda_in = transition Lambda_out + state (K-first)
  std::vector<Tensor<S>> entering_gradients;   // per rank [HV, K, V] K-first: dL/d(state its first local
                                               // document starts from); for an empty rank, what passes through
  Tensor<S> initial_state_gradient;            // [N, HV, K, V] dL/dh0, options' layout
};

namespace detail {

// [HV, A, B] -> [HV, B, A].
template <class S>
Tensor<S> transpose_heads(const Tensor<S>& t) {
  Tensor<S> out({t.dim(0), t.dim(2), t.dim(1)});
  for (std::int64_t h = 0; h < t.dim(0); ++h)
    for (std::int64_t i = 0; i < t.dim(1); ++i)
      for (std::int64_t j = 0; j < t.dim(2); ++j) out(h, j, i) = t(h, i, j);
  return out;
}

}  // namespace detail

// Reverse sweep over tokens [t0, t1): from G = dL/d(state after token t1 - 1) through later
// tokens only, returns dL/d(state entering token t0). Per token: G += q^_t dO_t^T, then
// G <- M_t^T G = Diag(a_t) (G - beta_t k_t (k_t^T G)).
template <class S>
Tensor<S> adjoint_run(const kda::PreparedInputs<S>& p, const kda::Dims& d, std::int64_t t0, std::int64_t t1,
                      const Tensor<S>& d_o, Tensor<S> G) {
  const std::int64_t group = d.HV / d.H, K = d.K, V = d.V;
  std::vector<S> kG(static_cast<std::size_t>(V));
  for (std::int64_t t = t1; t-- > t0;)
    for (std::int64_t hv = 0; hv < d.HV; ++hv) {
      const std::int64_t h = hv / group;
      for (std::int64_t i = 0; i < K; ++i) {
        const S qi = p.scale * p.q(0, t, h, i);
        for (std::int64_t j = 0; j < V; ++j) G(hv, i, j) += qi * d_o(0, t, hv, j);
      }
      const S& beta = p.beta(0, t, hv);
      for (std::int64_t j = 0; j < V; ++j) {
        kG[static_cast<std::size_t>(j)] = S(0);
        for (std::int64_t i = 0; i < K; ++i) kG[static_cast<std::size_t>(j)] += p.k(0, t, h, i) * G(hv, i, j);
      }
      for (std::int64_t i = 0; i < K; ++i) {
        const S bk = beta * p.k(0, t, h, i), a = p.decay(0, t, hv, i);
        for (std::int64_t j = 0; j < V; ++j) G(hv, i, j) = a * (G(hv, i, j) - bk * kG[static_cast<std::size_t>(j)]);
      }
    }
  return G;
}

// Reverse scan: Lambda_r = A_r(Lambda_{r+1}), Lambda_P = 0. `merge` as in the forward:
// origin_rank folds, for each rank, the adjoint fragments from the rank where its last
// document ends back to r + 1 (FLA's mirror pass); the scans run over the reversed list.
template <class S>
std::vector<Tensor<S>> reverse_scan(const Plan& plan, const std::vector<Fragment<S>>& adjoint, const kda::Dims& d,
                                    Merge merge) {
  const std::int64_t P = plan.num_ranks();
  std::vector<Tensor<S>> lambda(static_cast<std::size_t>(P) + 1, Tensor<S>({d.HV, d.K, d.V}));
  if (merge == Merge::origin_rank) {
    for (std::int64_t r = P; r-- > 0;) {
      // The rank on which the document crossing r's end finishes (or r itself if none crosses).
      const RankSlice& s = plan.ranks[static_cast<std::size_t>(r)];
      if (s.empty()) {  // nothing to add: what arrives passes through
        lambda[static_cast<std::size_t>(r)] = lambda[static_cast<std::size_t>(r) + 1];
        continue;
      }
      std::int64_t last = r;
      if (s.carries) {
        const std::int64_t doc_end = plan.cu_seqlens[static_cast<std::size_t>(s.last_doc) + 1];
        while (last + 1 < P && plan.splits[static_cast<std::size_t>(last) + 1] < doc_end) ++last;
      }
      Tensor<S> g({d.HV, d.K, d.V});
      for (std::int64_t j = last; j > r; --j) g = apply(adjoint[static_cast<std::size_t>(j)], g);
      lambda[static_cast<std::size_t>(r)] = apply(adjoint[static_cast<std::size_t>(r)], g);
    }
  } else {
    const std::vector<Fragment<S>> reversed(adjoint.rbegin(), adjoint.rend());
    const auto prefix = merge == Merge::tree_scan ? inclusive_scan_tree(reversed, d.HV, d.K, d.V)
                                                  : inclusive_scan_sequential(reversed);
    for (std::int64_t i = 0; i < P; ++i) lambda[static_cast<std::size_t>(P - 1 - i)] = prefix[static_cast<std::size_t>(i)].state;
  }
  lambda.pop_back();
  return lambda;
}

// The full backward state pass. d_o [1, T, HV, V]; d_final [N, HV, K, V] in the options'
// layout (absent: no loss on final states).
template <class S>
StateBackwardResult<S> context_parallel_state_backward(const kda::Inputs<S>& in, const kda::Options<S>& opt,
                                                       const std::vector<std::int64_t>& splits, const Tensor<S>& d_o,
                                                       const std::optional<Tensor<S>>& d_final,
                                                       Merge merge = Merge::origin_rank) {
  const auto setup = detail::setup_split(in, opt, splits, "kcp::context_parallel_state_backward");
  const kda::Dims& d = setup.d;
  const Plan& plan = setup.plan;
  const auto& cu = plan.cu_seqlens;
  if (d_o.shape() != Shape{1, d.T, d.HV, d.V})
    throw InvalidArgument("kcp::context_parallel_state_backward: argument 'd_o': expected [1, T, HV, V]");
  const bool v_first = opt.state_layout == kda::StateLayout::v_first;
  std::optional<Tensor<S>> dF;
  if (d_final) {
    if (d_final->shape() != (v_first ? Shape{d.N, d.HV, d.V, d.K} : Shape{d.N, d.HV, d.K, d.V}))
      throw InvalidArgument("kcp::context_parallel_state_backward: argument 'd_final': expected the final state's shape");
    dF = kda::to_k_first(*d_final, opt.state_layout);
  }
  auto final_grad = [&](std::int64_t n) { return detail::initial_of(dF, n, d); };
  const std::int64_t P = plan.num_ranks();

  // Local pass per rank: G~ of every local document part, and the adjoint fragment.
  std::vector<std::vector<Tensor<S>>> local(static_cast<std::size_t>(P));
  StateBackwardResult<S> res;
  res.plan = plan;
  res.adjoint_fragments.assign(static_cast<std::size_t>(P), identity_fragment<S>(d.HV, d.K, d.V));
  exec::parallel_for(P, opt.num_threads, [&](std::int64_t r) {
    const RankSlice& s = plan.ranks[static_cast<std::size_t>(r)];
    if (s.empty()) return;
    auto& parts = local[static_cast<std::size_t>(r)];
    for (std::size_t j = 0; j + 1 < s.local_cu_seqlens.size(); ++j) {
      const std::int64_t n = s.first_doc + static_cast<std::int64_t>(j);
      const std::int64_t t0 = s.begin + s.local_cu_seqlens[j], t1 = s.begin + s.local_cu_seqlens[j + 1];
      const bool ends_here = cu[static_cast<std::size_t>(n) + 1] == t1;
      parts.push_back(adjoint_run(setup.p, d, t0, t1, d_o, ends_here ? final_grad(n) : Tensor<S>({d.HV, d.K, d.V})));
    }
    // The carry through the rank exists only if one document covers the whole slice and goes on.
    const bool passes = s.first_doc == s.last_doc && s.carries;
    Fragment<S> a{Tensor<S>({d.HV, d.K, d.K}), parts.front()};
    if (passes) a.transition = detail::transpose_heads(run_fragment(setup.p, d, s.begin, s.end).transition);
    res.adjoint_fragments[static_cast<std::size_t>(r)] = std::move(a);
  });

  // Reverse scan over ranks.
  res.entering_gradients = reverse_scan(plan, res.adjoint_fragments, d, merge);

  // dL/dh0 for every document: where it starts, with the carry from the next rank if it goes on.
  Tensor<S> dh0({d.N, d.HV, d.K, d.V});
  for (std::int64_t n = 0; n < d.N; ++n)
    if (cu[static_cast<std::size_t>(n)] == cu[static_cast<std::size_t>(n) + 1]) detail::set_block(dh0, n, final_grad(n));
  for (std::int64_t r = 0; r < P; ++r) {
    const RankSlice& s = plan.ranks[static_cast<std::size_t>(r)];
    if (s.empty()) continue;
    const auto& parts = local[static_cast<std::size_t>(r)];
    for (std::size_t j = 0; j < parts.size(); ++j) {
      if (j == 0 && s.continues) continue;  // its start is on an earlier rank
      const std::int64_t n = s.first_doc + static_cast<std::int64_t>(j);
      const bool last = j + 1 == parts.size();
      if (j == 0 && !s.continues && s.first_doc == s.last_doc) {
        detail::set_block(dh0, n, res.entering_gradients[static_cast<std::size_t>(r)]);  // whole slice, carry included
      } else if (last && s.carries) {
        Fragment<S> a{detail::transpose_heads(run_fragment(setup.p, d, s.last_part_begin, s.end).transition), parts[j]};
        const Tensor<S> next = r + 1 < P ? res.entering_gradients[static_cast<std::size_t>(r) + 1]
                                         : Tensor<S>({d.HV, d.K, d.V});
        detail::set_block(dh0, n, apply(a, next));
      } else {
        detail::set_block(dh0, n, parts[j]);
      }
    }
  }
  res.initial_state_gradient = kda::from_k_first(std::move(dh0), opt.state_layout);
  return res;
}

// The full context-parallel backward: after the state pass above, each rank runs the
// adjoint recurrence over its own slice (kda::adjoint_span), starting from the forward
// state it entered with and from the state gradient that arrives at its end from the next
// rank, and writes the gradients of its own tokens. Gathered, they equal the single-device
// backward exactly (tests/kcp/backward_test.cpp). Only the token ranges differ between
// ranks, so a kernel's rank r can be checked alone on its slice of each gradient.
template <class S>
struct ContextParallelBackwardResult {
  StateBackwardResult<S> state;    // plan, adjoint fragments, entering (state) gradients, dL/dh0
  std::vector<Tensor<S>> entering_states;  // per rank [HV, K, V] K-first, from the forward pass
  kda::Gradients<S> gradients;     // gathered over ranks
};

template <class S>
ContextParallelBackwardResult<S> context_parallel_backward(const kda::Inputs<S>& in, const kda::Options<S>& opt,
                                                           const std::vector<std::int64_t>& splits,
                                                           const kda::Cotangents<S>& cot,
                                                           Merge merge = Merge::origin_rank) {
  const auto setup = detail::setup_split(in, opt, splits, "kcp::context_parallel_backward");
  const kda::Dims& d = setup.d;
  kda::validate_cotangents(d, cot.d_o.shape(),
                           cot.d_final_state ? std::optional<Shape>(cot.d_final_state->shape()) : std::nullopt,
                           opt.state_layout);
  ContextParallelBackwardResult<S> res;
  res.state = context_parallel_state_backward(in, opt, splits, cot.d_o, cot.d_final_state, merge);
  res.entering_states = context_parallel_forward(in, opt, splits, merge).entering_states;
  const Plan& plan = res.state.plan;
  const auto& cu = plan.cu_seqlens;
  const std::optional<Tensor<S>> dF = kda::to_k_first(cot.d_final_state, opt.state_layout);

  kda::PreparedGradients<S> pg = kda::zero_prepared_gradients<S>(d);  // B = 1 here
  const std::int64_t P = plan.num_ranks();
  // Ranks write disjoint token ranges.
  exec::parallel_for(P, opt.num_threads, [&](std::int64_t r) {
    const RankSlice& s = plan.ranks[static_cast<std::size_t>(r)];
    if (s.empty()) return;
    for (std::size_t j = 0; j + 1 < s.local_cu_seqlens.size(); ++j) {
      const std::int64_t n = s.first_doc + static_cast<std::int64_t>(j);
      const std::int64_t t0 = s.begin + s.local_cu_seqlens[j], t1 = s.begin + s.local_cu_seqlens[j + 1];
      if (t0 == t1) continue;
      const Tensor<S> before = j == 0 ? res.entering_states[static_cast<std::size_t>(r)] : detail::initial_of(setup.h0, n, d);
      const bool ends_here = cu[static_cast<std::size_t>(n) + 1] == t1;
      Tensor<S> after({d.HV, d.K, d.V});
      if (ends_here)
        after = detail::initial_of(dF, n, d);
      else if (r + 1 < P)
        after = res.state.entering_gradients[static_cast<std::size_t>(r) + 1];
      for (std::int64_t hv = 0; hv < d.HV; ++hv) {
        const std::size_t at = static_cast<std::size_t>(hv * d.K * d.V), size = static_cast<std::size_t>(d.K * d.V);
        std::vector<S> state(before.data() + at, before.data() + at + size), G(after.data() + at, after.data() + at + size);
        kda::adjoint_span(setup.p, d, 0, hv, t0, t1, state, cot.d_o, G, pg);
      }
    }
  });
  res.gradients = kda::stage_backward(in, opt, setup.p, std::move(pg), d);
  res.gradients.d_initial_state = res.state.initial_state_gradient;
  return res;
}

}  // namespace k3ref::kcp
