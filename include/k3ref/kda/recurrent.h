// The KDA recurrence: the definition every other form of KDA is checked against.
//
// Per value head, with decays a_t = exp(g_t) (one per key channel):
//   S_t = Diag(a_t) S_{t-1}                         decay first
//   S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T      delta rule on the decayed state
//   o_t = S_t^T (scale q_t)                         read after the update
// S is K x V. Value head hv reads q/k head hv / (HV / H).
#pragma once

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

#include "k3ref/kda/options.h"
#include "k3ref/kda/stages.h"

namespace k3ref::kda {

// Inputs after the optional stages: what the recurrence itself consumes.
template <class S>
struct PreparedInputs {
  Tensor<S> q;      // [B, T, H, K], normalised if requested, not yet scaled
  Tensor<S> k;      // [B, T, H, K]
  Tensor<S> v;      // [B, T, HV, V]
  Tensor<S> decay;  // [B, T, HV, K] multiplicative decays exp(g)
  Tensor<S> beta;   // [B, T, HV] activated
  S scale;
};

template <class S>
InputShapes shapes_of(const Inputs<S>& in, const Options<S>& opt) {
  InputShapes s;
  s.q = in.q.shape();
  s.k = in.k.shape();
  s.v = in.v.shape();
  s.g = in.g.shape();
  s.beta = in.beta.shape();
  if (in.initial_state) s.initial_state = in.initial_state->shape();
  if (in.A_log) s.A_log = in.A_log->shape();
  if (in.dt_bias) s.dt_bias = in.dt_bias->shape();
  s.cu_seqlens = in.cu_seqlens ? &*in.cu_seqlens : nullptr;
  s.gate = opt.gate;
  s.has_lower_bound = opt.lower_bound.has_value();
  s.state_layout = opt.state_layout;
  return s;
}

// Runs the optional stages (L2 norm, gate, beta activation, default scale).
template <class S>
PreparedInputs<S> prepare(const Inputs<S>& in, const Options<S>& opt, const Dims& d) {
  PreparedInputs<S> p;
  if (opt.qk_l2norm) {
    if constexpr (num::scalar_traits<S>::has_transcendentals) {
      p.q = l2_normalize(in.q);
      p.k = l2_normalize(in.k);
    } else {
      throw InvalidArgument("kda: option 'qk_l2norm' needs sqrt; normalise inputs beforehand in exact arithmetic");
    }
  } else {
    p.q = in.q;
    p.k = in.k;
  }
  p.v = in.v;
  switch (opt.gate) {
    case GateForm::decay_factor: p.decay = in.g; break;
    case GateForm::log_decay: p.decay = decay_factors(in.g, opt.gate_base); break;
    case GateForm::softplus:
    case GateForm::lower_bound:
      p.decay = decay_factors(gate_log_decay(in.g, opt.gate, in.A_log, in.dt_bias, opt.lower_bound), opt.gate_base);
      break;
  }
  p.beta = activate_beta(in.beta, opt.beta);
  p.scale = opt.scale ? *opt.scale : default_scale<S>(d.K);
  return p;
}

namespace detail {

// Runs `work(i)` for i in [0, count) on up to `threads` threads. Items are independent,
// so the result does not depend on the thread count.
template <class Work>
void parallel_for(std::int64_t count, int threads, Work&& work) {
  const int n = std::max(1, std::min<int>(threads, static_cast<int>(std::min<std::int64_t>(count, 1 << 20))));
  if (n == 1) {
    for (std::int64_t i = 0; i < count; ++i) work(i);
    return;
  }
  std::atomic<std::int64_t> next{0};
  std::vector<std::thread> pool;
  std::exception_ptr failure;
  std::atomic<bool> failed{false};
  for (int t = 0; t < n; ++t)
    pool.emplace_back([&] {
      for (std::int64_t i; (i = next.fetch_add(1)) < count;) {
        try {
          work(i);
        } catch (...) {
          if (!failed.exchange(true)) failure = std::current_exception();
        }
      }
      num::release_thread_caches();
    });
  for (auto& th : pool) th.join();
  if (failure) std::rethrow_exception(failure);
}

}  // namespace detail

// The recurrence on one K x V state held row-major (state[i * V + j]) is split into two
// sweeps over the state per token:
//   sweep A (token t):  S <- Diag(a_t) S,  kS <- S^T k_t
//   sweep B (token t):  S <- S + k_t u_t^T with u_t = beta_t (v_t - kS),  o_t <- S^T q_t
// and sweep B of token t is fused with sweep A of token t+1, so the state is read once
// per token (it is memory traffic, not arithmetic, that bounds this loop). Each element
// sees the same operations in the same order as the unfused form, so the result is
// bit-identical to it in every scalar type. Pointers never alias (restrict lets the
// compiler vectorise the inner loops).
// The state's columns are processed in blocks of `column_block`, so that a block of
// the accumulators (S^T k, o) stays in registers while the rows stream past; within a
// column every element still sees its operations in the original order.
inline constexpr std::int64_t column_block = 32;

template <class S>
void decay_and_project(S* __restrict state, std::int64_t K, std::int64_t V, const S* __restrict decay,
                       const S* __restrict k, S* __restrict kS) {
  for (std::int64_t j0 = 0; j0 < V; j0 += column_block) {
    const std::int64_t width = std::min(column_block, V - j0);
    S acc[column_block];
    for (std::int64_t j = 0; j < width; ++j) acc[j] = S(0);
    for (std::int64_t i = 0; i < K; ++i) {
      S* __restrict row = state + i * V + j0;
      const S a = decay[i];
      const S ki = k[i];
      for (std::int64_t j = 0; j < width; ++j) {
        row[j] *= a;
        acc[j] += ki * row[j];
      }
    }
    for (std::int64_t j = 0; j < width; ++j) kS[j0 + j] = acc[j];
  }
}

// Sweep B of one token, fused with sweep A of the next when `next_decay` is not null.
template <class S>
void update_read_then_decay_next(S* __restrict state, std::int64_t K, std::int64_t V, const S* __restrict k,
                                 const S* __restrict u, const S* __restrict q_scaled, S* __restrict o,
                                 const S* __restrict next_decay, const S* __restrict next_k,
                                 S* __restrict next_kS) {
  for (std::int64_t j0 = 0; j0 < V; j0 += column_block) {
    const std::int64_t width = std::min(column_block, V - j0);
    S out[column_block], next[column_block], uj[column_block];
    for (std::int64_t j = 0; j < width; ++j) {
      out[j] = S(0);
      next[j] = S(0);
      uj[j] = u[j0 + j];
    }
    for (std::int64_t i = 0; i < K; ++i) {
      S* __restrict row = state + i * V + j0;
      const S ki = k[i];
      const S qi = q_scaled[i];
      for (std::int64_t j = 0; j < width; ++j) {
        row[j] += ki * uj[j];
        out[j] += qi * row[j];
      }
      if (next_decay) {
        const S a = next_decay[i];
        const S nki = next_k[i];
        for (std::int64_t j = 0; j < width; ++j) {
          row[j] *= a;
          next[j] += nki * row[j];
        }
      }
    }
    for (std::int64_t j = 0; j < width; ++j) {
      o[j0 + j] = out[j];
      if (next_decay) next_kS[j0 + j] = next[j];
    }
  }
}

// The recurrence over prepared inputs. `initial_state` in the layout of `opt`.
template <class S>
Outputs<S> recurrent_core(const PreparedInputs<S>& p, const std::optional<Tensor<S>>& initial_state,
                          const Options<S>& opt, const Dims& d) {
  Outputs<S> out;
  out.o = Tensor<S>({d.B, d.T, d.HV, d.V});
  const bool v_first = opt.state_layout == StateLayout::v_first;
  const Shape state_shape = v_first ? Shape{d.N, d.HV, d.V, d.K} : Shape{d.N, d.HV, d.K, d.V};
  if (opt.output_final_state) out.final_state = Tensor<S>(state_shape);
  if (opt.output_all_states)
    out.all_states = Tensor<S>(v_first ? Shape{d.B, d.T, d.HV, d.V, d.K} : Shape{d.B, d.T, d.HV, d.K, d.V});
  const std::int64_t group = d.HV / d.H;
  const std::int64_t K = d.K, V = d.V;

  // Copies a K-first working state to or from a tensor slot in the user's layout.
  auto store = [&](const std::vector<S>& st, S* dst) {
    for (std::int64_t i = 0; i < K; ++i)
      for (std::int64_t j = 0; j < V; ++j) dst[v_first ? j * K + i : i * V + j] = st[i * V + j];
  };

  detail::parallel_for(d.N * d.HV, opt.num_threads, [&](std::int64_t item) {
    const std::int64_t n = item / d.HV, hv = item % d.HV, h = hv / group;
    const std::int64_t b = d.seq_batch[n];
    std::vector<S> st(static_cast<std::size_t>(K * V), S(0)), kS(V), u(V), q_scaled(K);
    if (initial_state) {
      const S* src = initial_state->data() + initial_state->offset(n, hv, 0, 0);
      for (std::int64_t i = 0; i < K; ++i)
        for (std::int64_t j = 0; j < V; ++j) st[i * V + j] = src[v_first ? j * K + i : i * V + j];
    }
    const std::int64_t begin = d.seq_begin[n], end = d.seq_end[n];
    auto decay_at = [&](std::int64_t t) { return p.decay.data() + p.decay.offset(b, t, hv, 0); };
    auto k_at = [&](std::int64_t t) { return p.k.data() + p.k.offset(b, t, h, 0); };
    // While the state is current for token t's sweep B, kS holds S^T k_t after decay.
    // The state after every token is only materialised when all_states is requested,
    // so then the sweeps are not fused (the next decay must not touch it yet).
    const bool fuse = !out.all_states;
    if (begin < end) decay_and_project(st.data(), K, V, decay_at(begin), k_at(begin), kS.data());
    for (std::int64_t t = begin; t < end; ++t) {
      const S* q = p.q.data() + p.q.offset(b, t, h, 0);
      for (std::int64_t i = 0; i < K; ++i) q_scaled[i] = p.scale * q[i];
      const S* v = p.v.data() + p.v.offset(b, t, hv, 0);
      const S& beta = p.beta(b, t, hv);
      for (std::int64_t j = 0; j < V; ++j) u[j] = beta * (v[j] - kS[j]);
      const bool has_next = t + 1 < end;
      update_read_then_decay_next(st.data(), K, V, k_at(t), u.data(), q_scaled.data(),
                                  out.o.data() + out.o.offset(b, t, hv, 0),
                                  fuse && has_next ? decay_at(t + 1) : nullptr, has_next ? k_at(t + 1) : nullptr,
                                  kS.data());
      if (out.all_states) {
        store(st, out.all_states->data() + out.all_states->offset(b, t, hv, 0, 0));
        if (has_next) decay_and_project(st.data(), K, V, decay_at(t + 1), k_at(t + 1), kS.data());
      }
    }
    if (out.final_state) store(st, out.final_state->data() + out.final_state->offset(n, hv, 0, 0));
  });
  return out;
}

// The full KDA forward by the recurrence: validation, optional stages, recurrence.
template <class S>
Outputs<S> recurrent_forward(const Inputs<S>& in, const Options<S>& opt = {}) {
  const Dims d = validate(shapes_of(in, opt));
  if (opt.lower_bound && !(*opt.lower_bound < S(0)))
    throw InvalidArgument("kda: argument 'lower_bound': must be negative");
  if (opt.num_threads < 1) throw InvalidArgument("kda: argument 'num_threads': must be at least 1");
  return recurrent_core(prepare(in, opt, d), in.initial_state, opt, d);
}

}  // namespace k3ref::kda
