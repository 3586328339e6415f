// Random packed multi-document KDA inputs and splits for the kcp tests (RapidCheck).
#pragma once

#include <rapidcheck.h>

#include <algorithm>
#include <vector>

#include "../kda/kda_test_util.h"
#include "k3ref/kda/recurrent.h"
#include "k3ref/num/scalar.h"

namespace k3ref::kcp::testing {

using Q = num::rational;
using HP = num::high_precision<256>;

// The exact-input generators of the KDA tests (same draws).
using kda::test_util::random_decays;
using kda::test_util::random_packed_inputs;
using kda::test_util::random_tensor;
using kda::test_util::small_rational;

// cu_seqlens of 1..5 documents of 0..max_len tokens (empty documents included).
inline std::vector<std::int64_t> random_documents(int max_docs = 5, int max_len = 8) {
  const int N = *rc::gen::inRange(1, max_docs + 1);
  std::vector<std::int64_t> cu{0};
  for (int n = 0; n < N; ++n) cu.push_back(cu.back() + *rc::gen::inRange(0, max_len + 1));
  return cu;
}

// P + 1 split positions 0 = s_0 <= ... <= s_P = T at arbitrary tokens (empty ranks allowed).
inline std::vector<std::int64_t> random_splits(std::int64_t T, int max_ranks = 8) {
  const int P = *rc::gen::inRange(1, max_ranks + 1);
  std::vector<std::int64_t> s{0};
  for (int r = 1; r < P; ++r) s.push_back(*rc::gen::inRange<std::int64_t>(0, T + 1));
  s.push_back(T);
  std::sort(s.begin(), s.end());
  return s;
}

struct Sizes {
  std::int64_t H, HV, K, V;
};

inline Sizes random_sizes() {
  const std::int64_t H = *rc::gen::inRange(1, 3);
  return Sizes{H, H * *rc::gen::inRange(1, 3), *rc::gen::inRange<std::int64_t>(1, 4), *rc::gen::inRange<std::int64_t>(1, 4)};
}


inline kda::Options<Q> exact_options(bool v_first = false) {
  kda::Options<Q> opt;
  opt.gate = kda::GateForm::decay_factor;
  opt.scale = Q(1) / Q(2);
  opt.state_layout = v_first ? kda::StateLayout::v_first : kda::StateLayout::k_first;
  return opt;
}

// A real-gate configuration at 256 bits: every gate form, base and beta form in turn.
struct RealGateCase {
  kda::Inputs<HP> in;
  kda::Options<HP> opt;
};

inline RealGateCase random_real_gate_case(const Sizes& s, const std::vector<std::int64_t>& cu) {
  const std::int64_t T = cu.back(), N = static_cast<std::int64_t>(cu.size()) - 1;
  auto lift = [](const Tensor<Q>& t) { return t.map<HP>([](const Q& x) { return HP(x); }); };
  RealGateCase c;
  c.in.q = lift(random_tensor({1, T, s.H, s.K}, -4, 4));
  c.in.k = lift(random_tensor({1, T, s.H, s.K}, -4, 4));
  c.in.v = lift(random_tensor({1, T, s.HV, s.V}, -4, 4));
  c.in.g = lift(random_tensor({1, T, s.HV, s.K}, -8, 8));
  c.in.beta = lift(random_tensor({1, T, s.HV}, -8, 8));
  c.in.initial_state = lift(random_tensor({N, s.HV, s.K, s.V}, -4, 4));
  c.in.cu_seqlens = cu;
  const int form = *rc::gen::inRange(0, 4);
  c.opt.qk_l2norm = true;
  c.opt.beta = *rc::gen::element(kda::BetaForm::sigmoid, kda::BetaForm::two_sigmoid);
  c.opt.gate_base = *rc::gen::element(kda::GateBase::e, kda::GateBase::two);
  if (form == 0) {
    c.opt.gate = kda::GateForm::log_decay;
    c.in.g = c.in.g.map<HP>([](const HP& x) { return -abs(x) / HP(4); });
  } else if (form == 1) {
    c.opt.gate = kda::GateForm::softplus;
    c.in.A_log = lift(random_tensor({s.HV}, -2, 2));
    c.in.dt_bias = lift(random_tensor({s.HV, s.K}, -2, 2));
  } else {
    c.opt.gate = kda::GateForm::lower_bound;
    c.opt.lower_bound = HP(-5);
    if (form == 2) c.in.A_log = lift(random_tensor({s.HV}, -2, 2));
    c.in.dt_bias = lift(random_tensor({s.HV, s.K}, -2, 2));
  }
  return c;
}

// max |a - b| / max(max |b|, tiny).
template <class S>
double relative_difference(const Tensor<S>& a, const Tensor<S>& b) {
  S diff(0), ref(0);
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    using std::abs;
    diff = std::max(diff, S(abs(a.data()[i] - b.data()[i])));
    ref = std::max(ref, S(abs(b.data()[i])));
  }
  if (ref == S(0)) return static_cast<double>(diff);
  return static_cast<double>(diff / ref);
}

}  // namespace k3ref::kcp::testing
