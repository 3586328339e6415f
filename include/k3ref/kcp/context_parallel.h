// Simulated context parallelism for KDA (docs/kcp.md).
//
// A packed B = 1 sequence of documents (cu_seqlens) is cut into P contiguous slices at
// arbitrary token positions. Each rank
//   1. computes its slice's fragment from a zero state (kcp::slice_fragment),
//   2. all-gathers the P fragments and merges the ones its first document needs into
//      its exact entering state,
//   3. reruns its slice from that state with the KDA recurrence.
// Gathered outputs and final states equal the single-device recurrence exactly (tested
// with == in rationals). The same code with the pieces of one device and a tree-shaped
// merge is the intra-device split of a long prefill (intra_device_forward).
#pragma once

#include <optional>
#include <vector>

#include "k3ref/kcp/fragment.h"
#include "k3ref/kcp/plan.h"
#include "k3ref/vocabulary.h"

namespace k3ref::kcp {

// How the gathered fragments become entering states.
enum class Merge {
  origin_rank,      // FLA's: rank r folds S <- M_j S + S~_j over j = origin..r-1 of its first document
  sequential_scan,  // exclusive prefix scan over all ranks, one composition after another
  tree_scan,        // exclusive prefix scan as a balanced tree (Blelloch); the intra-device merge
};
inline constexpr Choices<Merge, 3> merges{"merge",
                                          {{{Merge::origin_rank, "origin_rank", "FLA's"},
                                            {Merge::sequential_scan, "sequential_scan", ""},
                                            {Merge::tree_scan, "tree_scan", "Blelloch"}}}};

template <class S>
struct ContextParallelResult {
  Plan plan;
  std::vector<Fragment<S>> fragments;      // per rank, K-first: what each rank all-gathers
  std::vector<Tensor<S>> entering_states;  // per rank [HV, K, V] K-first: the state its first local
                                           // document starts from (zero for an empty rank)
  kda::Outputs<S> out;                     // o [1, T, HV, V]; final_state [N, HV, K, V] and
                                           // all_states in the options' layout
};

namespace detail {

// Inputs validated and prepared once, as every rank would see them.
template <class S>
struct SplitSetup {
  kda::Dims d;
  kda::PreparedInputs<S> p;
  std::optional<Tensor<S>> h0;  // [N, HV, K, V] K-first
  Plan plan;
};

template <class S>
SplitSetup<S> setup_split(const kda::Inputs<S>& in, const kda::Options<S>& opt, const std::vector<std::int64_t>& splits,
                          const char* who) {
  SplitSetup<S> s;
  s.d = kda::validated_dims(in, opt, who);
  if (s.d.B != 1)
    throw InvalidArgument(std::string(who) + ": argument 'q': context parallelism splits one packed sequence, B must be 1 (pack with cu_seqlens)");
  s.p = kda::prepare(in, opt, s.d);
  s.h0 = kda::to_k_first(in.initial_state, opt.state_layout);
  const std::vector<std::int64_t> cu = in.cu_seqlens ? *in.cu_seqlens : std::vector<std::int64_t>{0, s.d.T};
  s.plan = plan_split(cu, splits);
  return s;
}

template <class S>
Tensor<S> initial_of(const std::optional<Tensor<S>>& h0, std::int64_t doc, const kda::Dims& d) {
  return h0 ? block(*h0, doc) : Tensor<S>({d.HV, d.K, d.V});
}

}  // namespace detail

// Step 2: entering states from the gathered fragments.
template <class S>
std::vector<Tensor<S>> merge_entering_states(const Plan& plan, const std::vector<Fragment<S>>& fragments,
                                             const std::optional<Tensor<S>>& h0, const kda::Dims& d, Merge merge) {
  const std::int64_t P = plan.num_ranks();
  std::vector<Fragment<S>> prefix;  // exclusive prefixes for the scans
  if (merge == Merge::sequential_scan) {
    prefix.push_back(identity_fragment<S>(d.HV, d.K, d.V));
    for (std::int64_t r = 1; r < P; ++r) prefix.push_back(compose(fragments[r - 1], prefix.back()));
  } else if (merge == Merge::tree_scan) {
    prefix = exclusive_scan_tree(fragments, d.HV, d.K, d.V);
  }
  std::vector<Tensor<S>> entering;
  for (std::int64_t r = 0; r < P; ++r) {
    const RankSlice& s = plan.ranks[static_cast<std::size_t>(r)];
    if (s.empty()) {
      entering.emplace_back(Shape{d.HV, d.K, d.V});
    } else if (!s.continues) {
      entering.push_back(detail::initial_of(h0, s.first_doc, d));  // the document starts here
    } else if (merge == Merge::origin_rank) {
      Tensor<S> state({d.HV, d.K, d.V});
      for (std::int64_t j = s.origin_rank; j < r; ++j) state = apply(fragments[static_cast<std::size_t>(j)], state);
      entering.push_back(std::move(state));
    } else {
      entering.push_back(prefix[static_cast<std::size_t>(r)].state);  // prefix applied to the zero state
    }
  }
  return entering;
}

// The whole simulated run: fragments, merge, rerun, gather.
template <class S>
ContextParallelResult<S> context_parallel_forward(const kda::Inputs<S>& in, const kda::Options<S>& opt,
                                                  const std::vector<std::int64_t>& splits,
                                                  Merge merge = Merge::origin_rank) {
  const auto setup = detail::setup_split(in, opt, splits, "kcp::context_parallel_forward");
  const kda::Dims& d = setup.d;
  const Plan& plan = setup.plan;
  const std::int64_t P = plan.num_ranks();
  ContextParallelResult<S> res;
  res.plan = plan;

  // 1. Each rank's fragment, from its own tokens only.
  res.fragments.assign(static_cast<std::size_t>(P), identity_fragment<S>(d.HV, d.K, d.V));
  exec::parallel_for(P, opt.num_threads, [&](std::int64_t r) {
    res.fragments[static_cast<std::size_t>(r)] = slice_fragment(setup.p, d, plan.ranks[static_cast<std::size_t>(r)], setup.h0);
  });
  // 2. All-gather and merge.
  res.entering_states = merge_entering_states(plan, res.fragments, setup.h0, d, merge);
  // 3. Rerun each slice from its exact entering state; gather.
  kda::Outputs<S> out;
  out.o = Tensor<S>({1, d.T, d.HV, d.V});
  Tensor<S> final_state({d.N, d.HV, d.K, d.V});
  for (std::int64_t n = 0; n < d.N; ++n) detail::set_block(final_state, n, detail::initial_of(setup.h0, n, d));  // empty documents
  std::optional<Tensor<S>> all_states;
  if (opt.output_all_states) all_states = Tensor<S>({1, d.T, d.HV, d.K, d.V});
  exec::parallel_for(P, opt.num_threads, [&](std::int64_t r) {
    const RankSlice& s = plan.ranks[static_cast<std::size_t>(r)];
    if (s.empty()) return;
    const std::int64_t local_docs = static_cast<std::int64_t>(s.local_cu_seqlens.size()) - 1;
    Tensor<S> local_h0({local_docs, d.HV, d.K, d.V});
    for (std::int64_t j = 0; j < local_docs; ++j)
      detail::set_block(local_h0, j, j == 0 ? res.entering_states[static_cast<std::size_t>(r)]
                                            : detail::initial_of(setup.h0, s.first_doc + j, d));
    const auto local = kda::recurrent_core(detail::slice_prepared(setup.p, s.begin, s.end),
                                           std::optional<Tensor<S>>(local_h0),
                                           detail::core_options<S>(1, opt.output_all_states),
                                           detail::packed_dims(s.local_cu_seqlens, d.H, d.HV, d.K, d.V));
    std::copy(local.o.data(), local.o.data() + local.o.numel(), out.o.data() + out.o.offset(0, s.begin, 0, 0));
    if (all_states)
      std::copy(local.all_states->data(), local.all_states->data() + local.all_states->numel(),
                all_states->data() + all_states->offset(0, s.begin, 0, 0, 0));
    for (std::int64_t j = 0; j < local_docs; ++j) {
      const std::int64_t n = s.first_doc + j;
      if (plan.cu_seqlens[static_cast<std::size_t>(n) + 1] <= s.end)  // the document ends on this rank
        detail::set_block(final_state, n, detail::block(*local.final_state, j));
    }
  });
  if (opt.output_final_state) out.final_state = kda::from_k_first(std::move(final_state), opt.state_layout);
  out.all_states = kda::from_k_first(std::move(all_states), opt.state_layout);
  res.out = std::move(out);
  return res;
}

// The intra-device split of a prefill into `pieces` (SMs) cut by even_split(T, pieces,
// align), merged by the tree scan: on one device, same decomposition, no communication.
template <class S>
ContextParallelResult<S> intra_device_forward(const kda::Inputs<S>& in, const kda::Options<S>& opt,
                                              std::int64_t pieces, std::int64_t align = 1) {
  return context_parallel_forward(in, opt, even_split(in.q.dim(1), pieces, align), Merge::tree_scan);
}

}  // namespace k3ref::kcp
