// Fragment pairs (eq. 17 of the K3 report; docs/kcp.md).
//
// Per value head, a token acts on the K x V state as the affine map
//   S -> M_t S + beta_t k_t v_t^T,   M_t = (I - beta_t k_t k_t^T) Diag(a_t),
// and so does any run of tokens: S -> M S + S~, with M the ordered product of the M_t
// (latest on the left) and S~ the state the run reaches from S = 0. The pair (M, S~) is
// the run's fragment. Fragments compose by
//   (M2, S~2) o (M1, S~1) = (M2 M1, M2 S~1 + S~2)          (run 1, then run 2)
// which is associative with identity (I, 0) and not commutative (proofs/kcp_composition.md).
// A document start is the constant map S -> h0, the fragment (0, h0): composing with it
// forgets everything before (proofs/kcp_document_boundary.md).
//
// Fragments are computed with the KDA recurrence itself (kda::recurrent_core), never
// with a second copy of it: S~ is the recurrence run from zero, and M is the recurrence
// run with v = 0 from the identity state (a K x K "state" whose columns are carried by
// the M_t exactly as the value columns are).
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "k3ref/error.h"
#include "k3ref/kda/recurrent.h"
#include "k3ref/kcp/plan.h"
#include "k3ref/tensor/tensor.h"

namespace k3ref::kcp {

// One affine map per value head: S -> transition[hv] S + state[hv].
template <class S>
struct Fragment {
  Tensor<S> transition;  // [HV, K, K]  M
  Tensor<S> state;       // [HV, K, V]  S~
  std::int64_t HV() const { return state.dim(0); }
  std::int64_t K() const { return state.dim(1); }
  std::int64_t V() const { return state.dim(2); }
  friend bool operator==(const Fragment& a, const Fragment& b) {
    return a.transition == b.transition && a.state == b.state;
  }
};

// (I, 0): the fragment of an empty run.
template <class S>
Fragment<S> identity_fragment(std::int64_t HV, std::int64_t K, std::int64_t V) {
  Fragment<S> f{Tensor<S>({HV, K, K}), Tensor<S>({HV, K, V})};
  for (std::int64_t h = 0; h < HV; ++h)
    for (std::int64_t i = 0; i < K; ++i) f.transition(h, i, i) = S(1);
  return f;
}

// (0, h0): a document starting from h0 ([HV, K, V]; zero when absent).
template <class S>
Fragment<S> reset_fragment(std::int64_t HV, std::int64_t K, std::int64_t V, const std::optional<Tensor<S>>& h0) {
  Fragment<S> f{Tensor<S>({HV, K, K}), h0 ? *h0 : Tensor<S>({HV, K, V})};
  if (f.state.shape() != Shape{HV, K, V}) throw InvalidArgument("kcp::reset_fragment: argument 'h0': expected [HV, K, V]");
  return f;
}

namespace detail {

// c[h] = a[h] b[h] for stacks of row-major matrices a [H, m, n], b [H, n, p]; zeros skipped
// (exact types pay for every multiplication; transitions after a reset are zero).
template <class S>
Tensor<S> batched_matmul(const Tensor<S>& a, const Tensor<S>& b) {
  const std::int64_t H = a.dim(0), m = a.dim(1), n = a.dim(2), p = b.dim(2);
  Tensor<S> c({H, m, p});
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t l = 0; l < n; ++l) {
        const S& x = a(h, i, l);
        if (x == S(0)) continue;
        for (std::int64_t j = 0; j < p; ++j) c(h, i, j) += x * b(h, l, j);
      }
  return c;
}

template <class S>
void check_compatible(const Fragment<S>& a, const Fragment<S>& b, const char* what) {
  if (a.state.shape() != b.state.shape() || a.transition.shape() != b.transition.shape())
    throw InvalidArgument(std::string("kcp::") + what + ": fragments of different shapes");
}

}  // namespace detail

// later o earlier: run `earlier`, then `later`.
template <class S>
Fragment<S> compose(const Fragment<S>& later, const Fragment<S>& earlier) {
  detail::check_compatible(later, earlier, "compose");
  Fragment<S> f{detail::batched_matmul(later.transition, earlier.transition),
                detail::batched_matmul(later.transition, earlier.state)};
  for (std::int64_t i = 0; i < f.state.numel(); ++i) f.state.data()[i] += later.state.data()[i];
  return f;
}

// M S + S~ for a state [HV, K, V].
template <class S>
Tensor<S> apply(const Fragment<S>& f, const Tensor<S>& state) {
  if (state.shape() != f.state.shape()) throw InvalidArgument("kcp::apply: argument 'state': expected [HV, K, V]");
  Tensor<S> out = detail::batched_matmul(f.transition, state);
  for (std::int64_t i = 0; i < out.numel(); ++i) out.data()[i] += f.state.data()[i];
  return out;
}

// Inclusive prefix scan, one composition after another: out[i] = f_i o ... o f_0.
template <class S>
std::vector<Fragment<S>> inclusive_scan_sequential(const std::vector<Fragment<S>>& f) {
  std::vector<Fragment<S>> out;
  out.reserve(f.size());
  for (std::size_t i = 0; i < f.size(); ++i) out.push_back(i == 0 ? f[0] : compose(f[i], out.back()));
  return out;
}

// Exclusive prefix scan as a balanced tree (Blelloch's up-sweep / down-sweep, log2 P
// levels of independent compositions): out[i] = f_{i-1} o ... o f_0, out[0] = identity.
// Only associativity is used; operands keep their order ("combine(earlier, later)").
template <class S>
std::vector<Fragment<S>> exclusive_scan_tree(const std::vector<Fragment<S>>& f, std::int64_t HV, std::int64_t K,
                                             std::int64_t V) {
  std::size_t n = 1;
  while (n < f.size()) n *= 2;
  std::vector<Fragment<S>> a(n, identity_fragment<S>(HV, K, V));
  std::copy(f.begin(), f.end(), a.begin());
  auto combine = [](const Fragment<S>& earlier, const Fragment<S>& later) { return compose(later, earlier); };
  for (std::size_t width = 1; width < n; width *= 2)  // up-sweep: a[right] = sum of its block
    for (std::size_t right = 2 * width - 1; right < n; right += 2 * width)
      a[right] = combine(a[right - width], a[right]);
  a[n - 1] = identity_fragment<S>(HV, K, V);
  for (std::size_t width = n / 2; width >= 1; width /= 2) {  // down-sweep: hand prefixes down
    for (std::size_t right = 2 * width - 1; right < n; right += 2 * width) {
      Fragment<S> left_sum = a[right - width];
      a[right - width] = a[right];                  // the left block's prefix is the parent's
      a[right] = combine(a[right], left_sum);       // the right block's: parent's, then left block
    }
  }
  a.resize(f.size());
  return a;
}

// Inclusive scan through the tree: out[i] = f_i o exclusive[i].
template <class S>
std::vector<Fragment<S>> inclusive_scan_tree(const std::vector<Fragment<S>>& f, std::int64_t HV, std::int64_t K,
                                             std::int64_t V) {
  std::vector<Fragment<S>> out = exclusive_scan_tree(f, HV, K, V);
  for (std::size_t i = 0; i < f.size(); ++i) out[i] = compose(f[i], out[i]);
  return out;
}

// M_t = (I - beta k k^T) Diag(a) written out (K x K): the definition the fragments built
// through the recurrence are checked against.
template <class S>
Tensor<S> token_transition(const S* k, const S& beta, const S* decay, std::int64_t K) {
  Tensor<S> m({K, K});
  for (std::int64_t i = 0; i < K; ++i)
    for (std::int64_t j = 0; j < K; ++j) m(i, j) = ((i == j ? S(1) : S(0)) - beta * k[i] * k[j]) * decay[j];
  return m;
}

// ---- fragments of token runs, through the recurrence ---------------------------------------

namespace detail {

// Tokens [t0, t1) of batch row 0 of a [1, T, ...] tensor.
template <class S>
Tensor<S> slice_tokens(const Tensor<S>& t, std::int64_t t0, std::int64_t t1) {
  Shape shape = t.shape();
  shape[1] = t1 - t0;
  const std::int64_t row = t.dim(1) == 0 ? 0 : t.numel() / (t.dim(0) * t.dim(1));
  std::vector<S> data(t.data() + t0 * row, t.data() + t1 * row);
  return Tensor<S>(shape, std::move(data));
}

template <class S>
kda::PreparedInputs<S> slice_prepared(const kda::PreparedInputs<S>& p, std::int64_t t0, std::int64_t t1) {
  return kda::PreparedInputs<S>{slice_tokens(p.q, t0, t1), slice_tokens(p.k, t0, t1), slice_tokens(p.v, t0, t1),
                                slice_tokens(p.decay, t0, t1), slice_tokens(p.beta, t0, t1), p.scale};
}

// Dims of B = 1 packed sequences with the given cu_seqlens.
inline kda::Dims packed_dims(const std::vector<std::int64_t>& cu, std::int64_t H, std::int64_t HV, std::int64_t K,
                             std::int64_t V) {
  kda::Dims d;
  d.B = 1;
  d.T = cu.back();
  d.H = H;
  d.HV = HV;
  d.K = K;
  d.V = V;
  d.N = static_cast<std::int64_t>(cu.size()) - 1;
  for (std::int64_t n = 0; n < d.N; ++n) {
    d.seq_batch.push_back(0);
    d.seq_begin.push_back(cu[static_cast<std::size_t>(n)]);
    d.seq_end.push_back(cu[static_cast<std::size_t>(n) + 1]);
  }
  return d;
}

template <class S>
kda::Options<S> core_options(int threads, bool all_states = false) {
  kda::Options<S> o;
  o.state_layout = kda::StateLayout::k_first;
  o.output_final_state = true;
  o.output_all_states = all_states;
  o.num_threads = threads;
  return o;
}

// [HV, K, V] block n of a [N, HV, K, V] tensor.
template <class S>
Tensor<S> block(const Tensor<S>& t, std::int64_t n) {
  const std::int64_t size = t.numel() / t.dim(0);
  Shape shape(t.shape().begin() + 1, t.shape().end());
  return Tensor<S>(shape, std::vector<S>(t.data() + n * size, t.data() + (n + 1) * size));
}

template <class S>
void set_block(Tensor<S>& t, std::int64_t n, const Tensor<S>& value) {
  std::copy(value.data(), value.data() + value.numel(), t.data() + n * value.numel());
}

}  // namespace detail

// The fragment (M, S~) of tokens [t0, t1) of a prepared B = 1 sequence, all tokens one
// run (no document boundary applied): the pure eq. 17 pair.
template <class S>
Fragment<S> run_fragment(const kda::PreparedInputs<S>& p, const kda::Dims& d, std::int64_t t0, std::int64_t t1,
                         int threads = 1) {
  if (!(0 <= t0 && t0 <= t1 && t1 <= d.T)) throw InvalidArgument("kcp::run_fragment: token range outside [0, T]");
  if (t0 == t1) return identity_fragment<S>(d.HV, d.K, d.V);
  const kda::PreparedInputs<S> part = detail::slice_prepared(p, t0, t1);
  const std::int64_t L = t1 - t0;
  // S~: the recurrence from the zero state.
  const auto from_zero = kda::recurrent_core(part, std::optional<Tensor<S>>(), detail::core_options<S>(threads),
                                             detail::packed_dims({0, L}, d.H, d.HV, d.K, d.V));
  // M: the recurrence with v = 0 from the identity (V replaced by K columns).
  kda::PreparedInputs<S> carry = part;
  carry.v = Tensor<S>({1, L, d.HV, d.K});
  Tensor<S> eye({1, d.HV, d.K, d.K});
  for (std::int64_t h = 0; h < d.HV; ++h)
    for (std::int64_t i = 0; i < d.K; ++i) eye(0, h, i, i) = S(1);
  const auto carried = kda::recurrent_core(carry, std::optional<Tensor<S>>(eye), detail::core_options<S>(threads),
                                           detail::packed_dims({0, L}, d.H, d.HV, d.K, d.K));
  return Fragment<S>{detail::block(*carried.final_state, 0), detail::block(*from_zero.final_state, 0)};
}

// The fragment of a rank's slice with document boundaries: the map from the state its
// first document enters with to the state its last document leaves with. When the last
// document starts inside the slice (at or after `begin`), the map forgets the entering
// state: (run of the last document's part) o (0, h0[last_doc]). `h0` per document,
// K-first [N, HV, K, V], or none (zero initial states, as in training).
template <class S>
Fragment<S> slice_fragment(const kda::PreparedInputs<S>& p, const kda::Dims& d, const RankSlice& s,
                           const std::optional<Tensor<S>>& h0, int threads = 1) {
  if (s.empty()) return identity_fragment<S>(d.HV, d.K, d.V);
  Fragment<S> run = run_fragment(p, d, s.last_part_begin, s.end, threads);
  const bool last_starts_here = s.last_doc != s.first_doc || !s.continues;
  if (!last_starts_here) return run;
  const auto start = h0 ? std::optional<Tensor<S>>(detail::block(*h0, s.last_doc)) : std::nullopt;
  return compose(run, reset_fragment<S>(d.HV, d.K, d.V, start));
}

}  // namespace k3ref::kcp
