// Tests of simulated context parallelism: any split of any packed document layout over P
// ranks, and the intra-device split into S pieces, reproduce the single-device recurrence
// exactly (== in rationals); with real gates at 256 bits and in double, to rounding.
#include "test_support.h"

#include "k3ref/kcp/context_parallel.h"

namespace k3ref::kcp {
namespace {

using namespace test;

// ---- the plan -----------------------------------------------------------------------------

RC_GTEST_PROP(KcpPlan, EachRankKnowsWhereItsFirstDocumentBegan, ()) {
  const auto cu = random_documents(6, 8);
  const auto splits = random_splits(cu.back(), 8);
  const Plan plan = plan_split(cu, splits);
  for (std::int64_t r = 0; r < plan.num_ranks(); ++r) {
    const RankSlice& s = plan.ranks[static_cast<std::size_t>(r)];
    if (s.empty()) continue;
    // Brute force: walk back token by token while the document stays the same.
    std::int64_t t = s.begin;
    while (t > 0 && document_of(cu, t - 1) == s.first_doc) --t;
    RC_ASSERT(t == cu[static_cast<std::size_t>(s.first_doc)]);
    RC_ASSERT(s.continues == (t < s.begin));
    std::int64_t owner = 0;
    while (!(splits[static_cast<std::size_t>(owner)] <= t && t < splits[static_cast<std::size_t>(owner) + 1])) ++owner;
    RC_ASSERT(s.origin_rank == owner);
    RC_ASSERT(s.local_cu_seqlens.front() == 0 && s.local_cu_seqlens.back() == s.end - s.begin);
    RC_ASSERT(static_cast<std::int64_t>(s.local_cu_seqlens.size()) - 1 == s.last_doc - s.first_doc + 1);
  }
}

TEST(KcpPlan, EvenSplitCoversTheSequenceAndRespectsAlignment) {
  EXPECT_EQ(even_split(10, 3), (std::vector<std::int64_t>{0, 4, 7, 10}));
  EXPECT_EQ(even_split(100, 4, 16), (std::vector<std::int64_t>{0, 16, 48, 64, 100}));
  EXPECT_EQ(even_split(2, 4), (std::vector<std::int64_t>{0, 1, 2, 2, 2}));
  EXPECT_THROW(plan_split({0, 5}, {0, 3}), InvalidArgument);
  EXPECT_THROW(plan_split({0, 5}, {0, 4, 3, 5}), InvalidArgument);
  EXPECT_THROW(plan_split({0, 3, 2}, {0, 2}), InvalidArgument);
}

// ---- split equals unsplit, exactly --------------------------------------------------------

void check_split_equals_unsplit(Merge merge) {
  const Sizes s = random_sizes();
  const auto cu = random_documents(5, 8);
  const bool v_first = *rc::gen::arbitrary<bool>();
  const bool with_h0 = *rc::gen::arbitrary<bool>();
  const auto in = random_packed_inputs(s, cu, with_h0, v_first);
  auto opt = exact_options(v_first ? kda::StateLayout::v_first : kda::StateLayout::k_first);
  opt.output_all_states = *rc::gen::arbitrary<bool>();
  opt.num_threads = *rc::gen::inRange(1, 3);
  const auto splits = random_splits(cu.back(), 8);
  const auto single = kda::recurrent_forward(in, opt);
  const auto cp = context_parallel_forward(in, opt, splits, merge);
  RC_ASSERT(cp.out.o == single.o);
  RC_ASSERT(*cp.out.final_state == *single.final_state);
  if (opt.output_all_states) RC_ASSERT(*cp.out.all_states == *single.all_states);
  // The merged entering state of a continuing rank is the single-device state just before it.
  auto all_opt = exact_options();
  all_opt.output_all_states = true;
  auto in_k_first = in;
  if (v_first && in.initial_state) in_k_first.initial_state = kda::transpose_last_two(*in.initial_state);
  const auto states = *kda::recurrent_forward(in_k_first, all_opt).all_states;
  for (const RankSlice& r : cp.plan.ranks) {
    if (r.empty() || !r.continues) continue;
    const auto& e = cp.entering_states[static_cast<std::size_t>(&r - cp.plan.ranks.data())];
    for (std::int64_t i = 0; i < e.numel(); ++i) RC_ASSERT(e.data()[i] == states.data()[(r.begin - 1) * e.numel() + i]);
  }
}

RC_GTEST_PROP(KcpContextParallel, SplitEqualsSingleDeviceWithFlaOriginRankMerge, ()) {
  check_split_equals_unsplit(Merge::origin_rank);
}
RC_GTEST_PROP(KcpContextParallel, SplitEqualsSingleDeviceWithSequentialScan, ()) {
  check_split_equals_unsplit(Merge::sequential_scan);
}
RC_GTEST_PROP(KcpContextParallel, SplitEqualsSingleDeviceWithTreeScan, ()) { check_split_equals_unsplit(Merge::tree_scan); }

// One long document over many ranks (the case that exercises the whole chain of M's).
RC_GTEST_PROP(KcpContextParallel, OneDocumentAcrossAllRanks, ()) {
  const Sizes s = random_sizes();
  const std::int64_t T = *rc::gen::inRange(1, 25);
  const auto in = random_packed_inputs(s, {0, T}, true);
  const auto opt = exact_options();
  const auto splits = random_splits(T, 8);
  const auto cp = context_parallel_forward(in, opt, splits, Merge::origin_rank);
  const auto single = kda::recurrent_forward(in, opt);
  RC_ASSERT(cp.out.o == single.o);
  RC_ASSERT(*cp.out.final_state == *single.final_state);
}

// The document-boundary rule: a rank whose last document starts inside it sends a zero
// transition, so nothing it received can leak into the next document; changing the
// state entering it changes none of the later ranks' entering states.
RC_GTEST_PROP(KcpContextParallel, DocumentBoundaryZeroesTheCarriedTransition, ()) {
  const Sizes s = random_sizes();
  const auto cu = random_documents(5, 6);
  const auto in = random_packed_inputs(s, cu, true);
  const auto opt = exact_options();
  const auto splits = random_splits(cu.back(), 6);
  const auto cp = context_parallel_forward(in, opt, splits);
  const Tensor<Q> zero({s.HV, s.K, s.K});
  for (std::size_t r = 0; r < cp.plan.ranks.size(); ++r) {
    const RankSlice& x = cp.plan.ranks[r];
    if (x.empty()) continue;
    const bool boundary_inside = x.last_doc != x.first_doc || !x.continues;
    if (boundary_inside) {
      RC_ASSERT(cp.fragments[r].transition == zero);
      const auto other = random_tensor({s.HV, s.K, s.V}, -4, 4);
      RC_ASSERT(apply(cp.fragments[r], other) == cp.fragments[r].state);
    }
  }
}

// ---- intra-device split -------------------------------------------------------------------

RC_GTEST_PROP(KcpIntraDevice, PiecesMergedByTheTreeEqualTheRecurrence, ()) {
  const Sizes s = random_sizes();
  const auto cu = random_documents(3, 12);
  const auto in = random_packed_inputs(s, cu, *rc::gen::arbitrary<bool>());
  const auto opt = exact_options();
  const std::int64_t pieces = *rc::gen::inRange(1, 17), align = *rc::gen::element(1, 2, 4, 16);
  const auto single = kda::recurrent_forward(in, opt);
  const auto split = intra_device_forward(in, opt, pieces, align);
  RC_ASSERT(static_cast<std::int64_t>(split.plan.ranks.size()) == pieces);
  RC_ASSERT(split.out.o == single.o);
  RC_ASSERT(*split.out.final_state == *single.final_state);
}

// ---- real gates ---------------------------------------------------------------------------

// Every gate form and base, sigmoid and 2 sigmoid beta, the in-kernel L2 norm: the split at
// 256 bits agrees with the recurrence to rounding (the merge adds M S + S~ in another
// order than the recurrence, so equality is not bitwise), and the double tier to ~1e-14.
// Measured (relative to the largest entry) over 500 cases, seeds 20261130 and 1-4: at most
// 1.3e-79 at 256 bits and 2.2e-14 in double; seeds 5-16 reach 2.3e-78 at 256 bits (256 bits
// round at 8.6e-78). Bounds: 4x the worst, 9.2e-78 and 8.8e-14.
RC_GTEST_PROP(KcpContextParallel, RealGatesAgreeAtHighPrecisionAndInDouble, ()) {
  const Sizes s = random_sizes();
  const auto cu = random_documents(4, 8);
  const auto c = random_real_gate_case(s, cu);
  const auto splits = random_splits(cu.back(), 8);
  const auto merge = *rc::gen::element(Merge::origin_rank, Merge::sequential_scan, Merge::tree_scan);
  const auto single = kda::recurrent_forward(c.in, c.opt);
  const auto cp = context_parallel_forward(c.in, c.opt, splits, merge);
  RC_ASSERT(max_relative_difference(cp.out.o, single.o) < 9.2e-78);
  RC_ASSERT(max_relative_difference(*cp.out.final_state, *single.final_state) < 9.2e-78);

  auto down = [](const Tensor<HP>& t) { return t.map<double>([](const HP& x) { return static_cast<double>(x); }); };
  kda::Inputs<double> d{down(c.in.q), down(c.in.k), down(c.in.v), down(c.in.g), down(c.in.beta),
                        down(*c.in.initial_state), std::nullopt, std::nullopt, c.in.cu_seqlens};
  if (c.in.A_log) d.A_log = down(*c.in.A_log);
  if (c.in.dt_bias) d.dt_bias = down(*c.in.dt_bias);
  kda::Options<double> od;
  od.qk_l2norm = true;
  od.gate = c.opt.gate;
  od.gate_base = c.opt.gate_base;
  od.beta = c.opt.beta;
  if (c.opt.lower_bound) od.lower_bound = static_cast<double>(*c.opt.lower_bound);
  const auto cpd = context_parallel_forward(d, od, splits, merge);
  RC_ASSERT(max_relative_difference(cpd.out.o, down(single.o)) < 8.8e-14);
  RC_ASSERT(max_relative_difference(*cpd.out.final_state, down(*single.final_state)) < 8.8e-14);
}

// ---- arguments ----------------------------------------------------------------------------

TEST(KcpContextParallel, RejectsBatchedInputsAndBadSplits) {
  kda::Inputs<double> in;
  in.q = Tensor<double>({2, 3, 1, 2});
  in.k = in.q;
  in.v = Tensor<double>({2, 3, 1, 2});
  in.g = Tensor<double>({2, 3, 1, 2});
  in.beta = Tensor<double>({2, 3, 1});
  EXPECT_THROW(context_parallel_forward(in, kda::Options<double>{}, {0, 3}), InvalidArgument);
  in.q = Tensor<double>({1, 3, 1, 2});
  in.k = in.q;
  in.v = Tensor<double>({1, 3, 1, 2});
  in.g = Tensor<double>({1, 3, 1, 2});
  in.beta = Tensor<double>({1, 3, 1});
  EXPECT_THROW(context_parallel_forward(in, kda::Options<double>{}, {0, 2}), InvalidArgument);
  EXPECT_NO_THROW(context_parallel_forward(in, kda::Options<double>{}, {0, 1, 3}));
}

}  // namespace
}  // namespace k3ref::kcp
