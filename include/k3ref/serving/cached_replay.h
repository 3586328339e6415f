// The cached-replay decode (docs/serving.md, "Cached-replay decode"): a decode that does not
// store the state after every token but a checkpoint S0 and, since it, ring caches of the
// tokens' update vectors d_c, keys k_c and gates g_c. With w entries cached, the state is
//
//   S_w = A_{0,w} ⊙ S0 + sum_{c < w} A_{c+1,w} ⊙ (k_c d_c^T),   A_{c,w} = prod_{c <= e < w} a_e
//
// (a_e the decay of entry e, acting on the rows i < K of the K x V state), which is the
// recurrence S_c = Diag(a_c) S_{c-1} + k_c d_c^T with d_c = beta_c (v_c - (Diag(a_c) S_{c-1})^T k_c)
// unrolled. One decode step of a row at write position w rebuilds S_w, decays it by the
// token's gate, forms the token's d and output, and then either appends (d, k, g) at ring
// position w (w < L - 1) or, at w = L - 1, flushes: the state after the token becomes the
// new checkpoint and the ring starts again at 0 (the caller's cursor). So of a ring of L
// entries L - 1 are ever written. Rows whose state index is <= 0 are padding: their output
// is zero and nothing is read or written (slot 0 is the engine's null slot).
//
// The gates are cached in the form the options give them: log decays (the engines cache the
// fp32 g; the replay decay of entry c is exp of the sum of the later g) or decay factors
// (GateForm::decay_factor; products of the later factors, exact in rationals). One gate per
// value head (GDN, gate width 1) or one per key channel (KDA, gate width K).
#pragma once

#include <set>
#include <string>
#include <vector>

#include "k3ref/kda/recurrent.h"
#include "k3ref/serving/pool.h"

namespace k3ref::serving {

// What g_cache holds.
enum class ReplayGate {
  log_decay,     // the natural-log decay g; replay decays are exp(sum of g)
  decay_factor,  // exp(g) itself; replay decays are products (exact arithmetic)
};

// Deliberate defects of the decode step, for testing that the checks catch them (mutation
// testing: tests/serving/cached_replay_test.cpp). A reference computation uses none.
enum class ReplayFault {
  none,
  stale_write_position,  // a row at w > 0 runs at w - 1: the last entry is neither replayed nor kept
  flush_one_late,        // at w = L - 1 the token is appended instead of folded into the checkpoint
  replay_decay_dropped,  // the rebuilt state is S0 + sum d k^T, without the decays
  padded_row_written,    // a row with state index 0 is run and written like any other
};

template <class S>
struct ReplayCache {
  StatePool<S> checkpoint;  // slot s: the state at the slot's last checkpoint
  Tensor<S> d;              // [slots, HV, L, V] update vectors since the checkpoint
  Tensor<S> k;              // [slots, H, L, K] keys (after the L2 norm when the options ask for it)
  Tensor<S> g;              // [slots, HV, L, G] gates, G = 1 (per value head) or K (per channel)
  ReplayGate gate = ReplayGate::log_decay;

  std::int64_t capacity() const { return d.dim(2); }
  std::int64_t gate_width() const { return g.dim(3); }

  // An empty cache (zero checkpoints) of `slots` slots for the given sizes and ring length L.
  static ReplayCache empty(const PoolLayout& layout, std::int64_t H, std::int64_t L, std::int64_t gate_width,
                           ReplayGate gate) {
    return {StatePool<S>::zeros(layout), Tensor<S>({layout.slots, layout.HV, L, layout.V}),
            Tensor<S>({layout.slots, H, L, layout.K}), Tensor<S>({layout.slots, layout.HV, L, gate_width}), gate};
  }
};

namespace detail {

// A_{from,to} of row i (gate channel i, or 0 for one gate per head) of head hv of a slot.
template <class S>
S replay_decay(const ReplayCache<S>& c, std::int64_t slot, std::int64_t hv, std::int64_t from, std::int64_t to,
               std::int64_t i) {
  const std::int64_t gi = c.gate_width() == 1 ? 0 : i;
  if (c.gate == ReplayGate::decay_factor) {
    S a(1);
    for (std::int64_t e = from; e < to; ++e) a *= c.g(slot, hv, e, gi);
    return a;
  }
  if constexpr (!num::scalar_traits<S>::has_transcendentals) {
    throw InvalidArgument("serving::cached_replay: log-decay gate caches need exp; use ReplayGate::decay_factor");
  } else {
    using std::exp;
    S sum(0);
    for (std::int64_t e = from; e < to; ++e) sum += c.g(slot, hv, e, gi);
    return exp(sum);
  }
}

// The cache's shapes against the inputs' sizes, and the rows' tables: one state index and
// one write position per row, a position in [0, L - 1], no slot named by two rows.
inline void validate_replay(const kda::Dims& d, const PoolLayout& pool, std::int64_t buffer_size, const Shape& d_cache,
                            const Shape& k_cache, const Shape& g_cache, const std::vector<std::int64_t>& state_index,
                            const std::vector<std::int64_t>& write_pos) {
  const std::string who = "serving::cached_replay_decode: ";
  validate_pool(pool, buffer_size, "serving::cached_replay_decode");
  if (pool.HV != d.HV || pool.K != d.K || pool.V != d.V)
    throw InvalidArgument(who + "the checkpoint pool's [HV, K, V] differ from the inputs'");
  const std::int64_t L = d_cache.size() == 4 ? d_cache[2] : 0;
  if (L < 1 || d_cache != Shape{pool.slots, d.HV, L, d.V} || k_cache != Shape{pool.slots, d.H, L, d.K} ||
      g_cache.size() != 4 || g_cache[0] != pool.slots || g_cache[1] != d.HV || g_cache[2] != L ||
      (g_cache[3] != 1 && g_cache[3] != d.K))
    throw InvalidArgument(who + "expected d [slots, HV, L, V], k [slots, H, L, K], g [slots, HV, L, 1 or K] with L >= 1, got d " +
                          shape_to_string(d_cache) + ", k " + shape_to_string(k_cache) + ", g " + shape_to_string(g_cache));
  if (static_cast<std::int64_t>(state_index.size()) != d.N || static_cast<std::int64_t>(write_pos.size()) != d.N)
    throw InvalidArgument(who + "arguments 'state_index' and 'write_pos': expected one entry per row (" +
                          std::to_string(d.N) + ")");
  std::set<std::int64_t> named;
  for (std::int64_t n = 0; n < d.N; ++n) {
    const std::int64_t s = state_index[static_cast<std::size_t>(n)], w = write_pos[static_cast<std::size_t>(n)];
    if (s <= 0) continue;  // padding: its write position is not read
    if (s >= pool.slots)
      throw InvalidArgument(who + "argument 'state_index': row " + std::to_string(n) + " names slot " + std::to_string(s) +
                            " of " + std::to_string(pool.slots));
    if (w < 0 || w > L - 1)
      throw InvalidArgument(who + "argument 'write_pos': row " + std::to_string(n) + " at " + std::to_string(w) +
                            ", outside [0, L - 1 = " + std::to_string(L - 1) + "]");
    if (!named.insert(s).second)
      throw InvalidArgument(who + "argument 'state_index': slot " + std::to_string(s) + " named by two rows");
  }
}

}  // namespace detail

// The state of `slot` with the first w ring entries replayed on its checkpoint, K-first
// [HV, K, V]. `decays`: false only for ReplayFault::replay_decay_dropped.
template <class S>
Tensor<S> rebuilt_state(const ReplayCache<S>& c, std::int64_t slot, std::int64_t w, bool decays = true) {
  Tensor<S> st = read_slot(c.checkpoint, slot);
  const std::int64_t HV = st.dim(0), K = st.dim(1), V = st.dim(2), group = HV / c.k.dim(1);
  for (std::int64_t hv = 0; hv < HV; ++hv)
    for (std::int64_t i = 0; i < K; ++i) {
      const S total = decays ? detail::replay_decay(c, slot, hv, 0, w, i) : S(1);
      for (std::int64_t j = 0; j < V; ++j) st(hv, i, j) *= total;
      for (std::int64_t e = 0; e < w; ++e) {
        const S ki = c.k(slot, hv / group, e, i) * (decays ? detail::replay_decay(c, slot, hv, e + 1, w, i) : S(1));
        for (std::int64_t j = 0; j < V; ++j) st(hv, i, j) += ki * c.d(slot, hv, e, j);
      }
    }
  return st;
}

// Where a row's cursor goes after a step at w: w + 1, or 0 after the flush at L - 1.
inline std::int64_t next_write_position(std::int64_t w, std::int64_t L) { return w == L - 1 ? 0 : w + 1; }

// One decode step of N rows, one token each: in.q [N, 1, H, K] (no cu_seqlens, no initial
// state: the cache holds the states), row n on slot state_index[n] at ring position
// write_pos[n] (in [0, L - 1]). Returns o [N, 1, HV, V]; the cache is updated in place (rows
// that are not padding name distinct slots). The checkpoint pool's layout must be
// opt.state_layout; the gate cache's form must match opt.gate (decay_factor with
// ReplayGate::decay_factor; log_decay, softplus or lower_bound in base e with log_decay).
template <class S>
Tensor<S> cached_replay_decode(const kda::Inputs<S>& in, const kda::Options<S>& opt, ReplayCache<S>& cache,
                               const std::vector<std::int64_t>& state_index, const std::vector<std::int64_t>& write_pos,
                               ReplayFault fault = ReplayFault::none) {
  const kda::Dims d = kda::validated_dims(in, opt, "serving::cached_replay_decode");
  detail::validate_replay(d, cache.checkpoint.layout, static_cast<std::int64_t>(cache.checkpoint.buffer.size()),
                          cache.d.shape(), cache.k.shape(),
                          cache.g.shape(), state_index, write_pos);
  if (in.initial_state || in.cu_seqlens || d.T != 1)
    throw InvalidArgument("serving::cached_replay_decode: argument 'in': expected one token per row [N, 1, ...], "
                          "no initial_state (the cache holds the states), no cu_seqlens");
  if (opt.state_layout != cache.checkpoint.layout.layout)
    throw InvalidArgument("serving::cached_replay_decode: option 'state_layout' differs from the checkpoint pool's");
  const bool factors = opt.gate == kda::GateForm::decay_factor;
  if (factors != (cache.gate == ReplayGate::decay_factor) || (!factors && opt.gate_base != kda::GateBase::e))
    throw InvalidArgument("serving::cached_replay_decode: the gate cache holds " +
                          std::string(cache.gate == ReplayGate::decay_factor ? "decay factors" : "log decays") +
                          ", which needs " +
                          (cache.gate == ReplayGate::decay_factor ? "gate 'decay_factor'" : "a log gate in base e"));
  const kda::PreparedInputs<S> p = kda::prepare(in, opt, d);
  // The gate the ring keeps: what the options give before exponentiation.
  Tensor<S> gate = in.g;
  if (opt.gate == kda::GateForm::softplus || opt.gate == kda::GateForm::lower_bound)
    gate = kda::gate_log_decay(in.g, opt.gate, in.A_log, in.dt_bias, opt.lower_bound);
  const std::int64_t L = cache.capacity(), G = cache.gate_width(), group = d.HV / d.H;
  Tensor<S> o({d.N, 1, d.HV, d.V});
  for (std::int64_t n = 0; n < d.N; ++n) {
    const std::int64_t s = state_index[static_cast<std::size_t>(n)];
    if (s < 0 || (s == 0 && fault != ReplayFault::padded_row_written)) continue;  // padding: o stays zero
    std::int64_t w = write_pos[static_cast<std::size_t>(n)];
    if (fault == ReplayFault::stale_write_position && w > 0) --w;
    const bool flush = w == (fault == ReplayFault::flush_one_late ? L : L - 1);
    Tensor<S> st = rebuilt_state(cache, s, w, fault != ReplayFault::replay_decay_dropped);
    for (std::int64_t hv = 0; hv < d.HV; ++hv) {
      const std::int64_t h = hv / group;
      const S* a = p.decay.data() + p.decay.offset(n, 0, hv, 0);
      const S* k = p.k.data() + p.k.offset(n, 0, h, 0);
      const S* q = p.q.data() + p.q.offset(n, 0, h, 0);
      const S* v = p.v.data() + p.v.offset(n, 0, hv, 0);
      const S* gt = gate.data() + gate.offset(n, 0, hv, 0);
      if (G == 1)
        for (std::int64_t i = 1; i < d.K; ++i)
          if (!(gt[i] == gt[0]))
            throw InvalidArgument("serving::cached_replay_decode: a gate cache of one gate per head needs the gate "
                                  "broadcast over K (GDN), row " + std::to_string(n));
      // The token: S <- Diag(a) S, d = beta (v - S^T k), S <- S + k d^T, o = S^T (scale q).
      std::vector<S> upd(static_cast<std::size_t>(d.V));
      for (std::int64_t j = 0; j < d.V; ++j) {
        S kS(0);
        for (std::int64_t i = 0; i < d.K; ++i) kS += k[i] * (a[i] * st(hv, i, j));
        upd[j] = p.beta(n, 0, hv) * (v[j] - kS);
      }
      for (std::int64_t j = 0; j < d.V; ++j) {
        S out(0);
        for (std::int64_t i = 0; i < d.K; ++i) {
          st(hv, i, j) = a[i] * st(hv, i, j) + k[i] * upd[j];
          out += st(hv, i, j) * (p.scale * q[i]);
        }
        o(n, 0, hv, j) = out;
      }
      if (flush) continue;
      for (std::int64_t j = 0; j < d.V; ++j) cache.d(s, hv, w, j) = upd[j];
      for (std::int64_t i = 0; i < G; ++i) cache.g(s, hv, w, i) = gt[i];
      for (std::int64_t i = 0; i < d.K; ++i) cache.k(s, h, w, i) = k[i];
    }
    if (flush) write_slot(cache.checkpoint, s, st);
  }
  return o;
}

}  // namespace k3ref::serving
