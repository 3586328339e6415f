// The KDA recurrence as docs/conventions.md writes it, one token at a time, in plain loops:
// the definition every tuned form is held against. Per value head, decays a_t = exp(g_t):
//   S_t = Diag(a_t) S_{t-1}                         decay first
//   S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T      delta rule on the decayed state
//   o_t = S_t^T (scale q_t)                         read after the update
// Sums over the key channel run in order i = 0..K-1. The register-blocked recurrence
// (kda/recurrent.h) and the adjoint's recompute (kda/backward.h) perform exactly these
// operations, so they equal it bitwise in double and == in rationals (tests/kda/
// definition_test.cpp); the chunkwise forms equal it == in rationals.
#pragma once

#include <optional>
#include <vector>

#include "k3ref/kda/prepare.h"

namespace k3ref::kda::definition {

// One token's update of a K x V state (row-major, state[i * V + j]). `residual`, when not
// null, receives v_t - S_t^T k_t (V values), which the adjoint needs.
template <class S>
void update(S* state, std::int64_t K, std::int64_t V, const S* a, const S* k, const S* v, const S& beta,
            S* residual = nullptr) {
  std::vector<S> kS(static_cast<std::size_t>(V), S(0));
  for (std::int64_t i = 0; i < K; ++i)
    for (std::int64_t j = 0; j < V; ++j) {
      state[i * V + j] *= a[i];                // S = Diag(a) S
      kS[j] += k[i] * state[i * V + j];        // S^T k
    }
  for (std::int64_t j = 0; j < V; ++j) {
    const S r = v[j] - kS[j];
    if (residual) residual[j] = r;
    kS[j] = beta * r;                          // now u = beta (v - S^T k)
  }
  for (std::int64_t i = 0; i < K; ++i)
    for (std::int64_t j = 0; j < V; ++j) state[i * V + j] += k[i] * kS[j];  // S += k u^T
}

// o = S^T (scale q) for a K x V state.
template <class S>
void read(const S* state, std::int64_t K, std::int64_t V, const S* q, const S& scale, S* o) {
  for (std::int64_t j = 0; j < V; ++j) o[j] = S(0);
  for (std::int64_t i = 0; i < K; ++i) {
    const S q_scaled = scale * q[i];
    for (std::int64_t j = 0; j < V; ++j) o[j] += q_scaled * state[i * V + j];
  }
}

// The whole recurrence over prepared inputs, one thread. States are K-first: initial_state
// [N, HV, K, V] (zero when absent); the result's final_state [N, HV, K, V] and, with
// `all_states`, all_states [B, T, HV, K, V].
template <class S>
Outputs<S> recurrence(const PreparedInputs<S>& p, const std::optional<Tensor<S>>& initial_state, const Dims& d,
                      bool all_states = false) {
  const std::int64_t K = d.K, V = d.V;
  Outputs<S> out{Tensor<S>({d.B, d.T, d.HV, V}), Tensor<S>({d.N, d.HV, K, V}), std::nullopt};
  if (all_states) out.all_states = Tensor<S>({d.B, d.T, d.HV, K, V});
  for (std::int64_t n = 0; n < d.N; ++n)
    for (std::int64_t hv = 0; hv < d.HV; ++hv) {
      const std::int64_t b = d.seq_batch[n], h = hv / (d.HV / d.H);
      std::vector<S> state(static_cast<std::size_t>(K * V), S(0));
      if (initial_state) std::copy_n(&(*initial_state)(n, hv, 0, 0), K * V, state.begin());
      for (std::int64_t t = d.seq_begin[n]; t < d.seq_end[n]; ++t) {
        update(state.data(), K, V, &p.decay(b, t, hv, 0), &p.k(b, t, h, 0), &p.v(b, t, hv, 0), p.beta(b, t, hv));
        read(state.data(), K, V, &p.q(b, t, h, 0), p.scale, &out.o(b, t, hv, 0));
        if (all_states) std::copy(state.begin(), state.end(), &(*out.all_states)(b, t, hv, 0, 0));
      }
      std::copy(state.begin(), state.end(), &(*out.final_state)(n, hv, 0, 0));
    }
  return out;
}

}  // namespace k3ref::kda::definition
