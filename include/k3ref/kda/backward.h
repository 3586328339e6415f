// Gradients of the KDA forward: the analytic adjoint of the recurrence.
//
// For upstream gradients dO = dL/do [B, T, HV, V] and dF = dL/d(final state), i.e. the loss
//   L = sum o . dO + sum S_T . dF,
// this computes dL/d(every input) by a reverse pass over the state gradient
// G_t = dL/dS_t (proofs/kda_backward.md derives each line). Per token, going backwards,
// with S'_t = Diag(a_t) S_{t-1}, kS_t = S'_t^T k_t, u_t = beta_t (v_t - kS_t),
// S_t = S'_t + k_t u_t^T, o_t = S_t^T q^_t (q^ = scale q):
//   G      += q^_t dO_t^T                  o_t reads S_t
//   dq^_t   = S_t dO_t
//   du      = G^T k_t,   dk_t = G u_t      the outer product k_t u_t^T
//   dbeta_t = du . (v_t - kS_t),  dv_t = beta_t du,  dkS = -beta_t du
//   G'      = G + k_t dkS^T,  dk_t += S'_t dkS
//   da_t    = rowsum(G' o S_{t-1})        (o: elementwise product)
//   G       = Diag(a_t) G'                 = dL/dS_{t-1}
// then the stages' own gradients (L2 norm, gate, beta activation, grouped heads) map the
// prepared inputs' gradients back to the tensors the user passed.
//
// A second, independent derivative is forward-mode automatic differentiation through the
// templated forward (num::Dual); tests/kda/backward_test.cpp checks that both agree
// exactly in rationals and to 1e-54 at 200 bits, and against central finite differences.
#pragma once

#include "k3ref/kda/definition.h"
#include "k3ref/kda/recurrent.h"

namespace k3ref::kda {

// Upstream gradients: d_o [B, T, HV, V]; d_final_state [N, HV, K, V] in the options'
// layout, absent when the loss does not involve the final states.
template <class S>
struct Cotangents {
  Tensor<S> d_o;
  std::optional<Tensor<S>> d_final_state;
};

// Gradients with respect to the inputs as the user passed them: dg is with respect to
// `g` under Options::gate (the raw gate for softplus / lower_bound), dbeta with respect to
// `beta` before its activation. d_initial_state is always present ([N, HV, K, V] in the
// options' layout): the gradient with respect to the state a sequence starts from, also
// when the initial state was absent (zero).
template <class S>
struct Gradients {
  Tensor<S> dq, dk, dv, dg, dbeta;
  Tensor<S> d_initial_state;
  std::optional<Tensor<S>> dA_log;   // [HV], when A_log was given
  std::optional<Tensor<S>> ddt_bias;  // [HV, K], when dt_bias was given
};

// Gradients with respect to what the recurrence consumes (PreparedInputs): dq with respect
// to the normalised, unscaled q, per value head (grouped heads not yet summed); ddecay with
// respect to the multiplicative decays; dbeta with respect to the activated beta.
template <class S>
struct PreparedGradients {
  Tensor<S> dq;      // [B, T, HV, K]
  Tensor<S> dk;      // [B, T, HV, K]
  Tensor<S> dv;      // [B, T, HV, V]
  Tensor<S> ddecay;  // [B, T, HV, K]
  Tensor<S> dbeta;   // [B, T, HV]
  Tensor<S> d_initial_state;  // [N, HV, K, V], K-first
};

// Zero prepared gradients of the shapes of validated inputs, for a pass to accumulate into.
template <class S>
PreparedGradients<S> zero_prepared_gradients(const Dims& d) {
  return PreparedGradients<S>{Tensor<S>({d.B, d.T, d.HV, d.K}), Tensor<S>({d.B, d.T, d.HV, d.K}),
                              Tensor<S>({d.B, d.T, d.HV, d.V}), Tensor<S>({d.B, d.T, d.HV, d.K}),
                              Tensor<S>({d.B, d.T, d.HV}),       Tensor<S>({d.N, d.HV, d.K, d.V})};
}

// Tokens between the states the reverse pass stores: within a span it recomputes the
// states forward from the span's first one, so memory is O((T / span + span) K V).
inline constexpr std::int64_t backward_checkpoint_span = 16;

// The reverse pass for tokens [t0, t1) of one (batch row b, value head hv): starts from
// `state` = S_{t0-1} (K-first) and `G` = dL/dS_{t1-1} through later tokens only (K-first);
// on return G = dL/dS_{t0-1}. Writes the prepared gradients of those tokens. This is the
// building block of the whole-sequence pass, of the chunkwise backward (one chunk) and of
// the context-parallel backward (one rank).
template <class S>
void adjoint_span(const PreparedInputs<S>& p, const Dims& d, std::int64_t b, std::int64_t hv, std::int64_t t0,
                  std::int64_t t1, const std::vector<S>& state_before, const Tensor<S>& d_o, std::vector<S>& G,
                  PreparedGradients<S>& out) {
  const std::int64_t K = d.K, V = d.V, h = hv / (d.HV / d.H);
  const std::int64_t span = backward_checkpoint_span;
  // Checkpoints: the state before each span of `span` tokens.
  // The forward recompute is the definition's own token update (kda/definition.h).
  auto forward_token = [&](std::vector<S>& state, std::int64_t t, S* residual) {
    definition::update(state.data(), K, V, &p.decay(b, t, hv, 0), &p.k(b, t, h, 0), &p.v(b, t, hv, 0),
                       p.beta(b, t, hv), residual);
  };
  std::vector<std::vector<S>> checkpoints;
  {
    std::vector<S> st = state_before;
    for (std::int64_t t = t0; t < t1; ++t) {
      if ((t - t0) % span == 0) checkpoints.push_back(st);
      forward_token(st, t, nullptr);
    }
  }
  std::vector<S> du(static_cast<std::size_t>(V)), u(static_cast<std::size_t>(V));
  for (std::int64_t c = static_cast<std::int64_t>(checkpoints.size()); c-- > 0;) {
    const std::int64_t s0 = t0 + c * span, s1 = std::min(t1, s0 + span);
    // states[t - s0] = S_{t-1}; states[s1 - s0] = S_{s1-1}; residuals[t - s0] = v_t - S'_t^T k_t.
    std::vector<std::vector<S>> states{checkpoints[static_cast<std::size_t>(c)]};
    std::vector<S> residuals(static_cast<std::size_t>((s1 - s0) * V));
    for (std::int64_t t = s0; t < s1; ++t) {
      states.push_back(states.back());
      forward_token(states.back(), t, residuals.data() + (t - s0) * V);
    }
    for (std::int64_t t = s1; t-- > s0;) {
      const std::vector<S>& prev = states[static_cast<std::size_t>(t - s0)];
      const std::vector<S>& cur = states[static_cast<std::size_t>(t - s0 + 1)];
      const S* q = &p.q(b, t, h, 0);
      const S* k = &p.k(b, t, h, 0);
      const S* a = &p.decay(b, t, hv, 0);
      const S* dO = &d_o(b, t, hv, 0);
      const S& beta = p.beta(b, t, hv);
      // G += q^ dO^T; dq (unscaled q) = scale S_t dO.
      for (std::int64_t i = 0; i < K; ++i) {
        const S qi = p.scale * q[i];
        S acc(0);
        for (std::int64_t j = 0; j < V; ++j) {
          G[i * V + j] += qi * dO[j];
          acc += cur[i * V + j] * dO[j];
        }
        out.dq(b, t, hv, i) = p.scale * acc;
      }
      // u = beta (v - kS), kS = S'^T k with S' = Diag(a) S_{t-1}, from the recompute's residual.
      const S* residual = residuals.data() + (t - s0) * V;
      for (std::int64_t j = 0; j < V; ++j) u[j] = beta * residual[j];
      // du = G^T k; dk = G u.
      for (std::int64_t j = 0; j < V; ++j) du[j] = S(0);
      for (std::int64_t i = 0; i < K; ++i) {
        S acc(0);
        for (std::int64_t j = 0; j < V; ++j) {
          du[j] += G[i * V + j] * k[i];
          acc += G[i * V + j] * u[j];
        }
        out.dk(b, t, hv, i) = acc;
      }
      S dbeta(0);
      for (std::int64_t j = 0; j < V; ++j) {
        dbeta += du[j] * residual[j];
        out.dv(b, t, hv, j) = beta * du[j];
        du[j] = -beta * du[j];  // now dkS
      }
      out.dbeta(b, t, hv) = dbeta;
      // G' = G + k dkS^T; dk += S' dkS; da = rowsum(G' o S_{t-1}); G = Diag(a) G'.
      for (std::int64_t i = 0; i < K; ++i) {
        S dk_extra(0), da(0);
        for (std::int64_t j = 0; j < V; ++j) {
          S& g = G[i * V + j];
          g += k[i] * du[j];
          dk_extra += (a[i] * prev[i * V + j]) * du[j];
          da += g * prev[i * V + j];
          g *= a[i];
        }
        out.dk(b, t, hv, i) += dk_extra;
        out.ddecay(b, t, hv, i) = da;
      }
    }
  }
}

// The adjoint of recurrent_core: gradients with respect to the prepared inputs.
// `initial_state` and `cot.d_final_state` K-first ([N, HV, K, V]); recurrent_backward converts.
template <class S>
PreparedGradients<S> recurrent_adjoint(const PreparedInputs<S>& p, const std::optional<Tensor<S>>& initial_state,
                                       const Cotangents<S>& cot, const Options<S>& opt, const Dims& d) {
  const std::int64_t K = d.K, V = d.V;
  PreparedGradients<S> g = zero_prepared_gradients<S>(d);
  auto load = [&](const Tensor<S>& states, std::int64_t n, std::int64_t hv) {
    const S* src = states.data() + states.offset(n, hv, 0, 0);
    return std::vector<S>(src, src + K * V);
  };
  // Items (sequence, value head) write disjoint slices, so threads never change a result.
  exec::parallel_for(d.N * d.HV, opt.num_threads, [&](std::int64_t item) {
    const std::int64_t n = item / d.HV, hv = item % d.HV;
    std::vector<S> state = initial_state ? load(*initial_state, n, hv) : std::vector<S>(K * V, S(0));
    std::vector<S> G = cot.d_final_state ? load(*cot.d_final_state, n, hv) : std::vector<S>(K * V, S(0));
    adjoint_span(p, d, d.seq_batch[n], hv, d.seq_begin[n], d.seq_end[n], state, cot.d_o, G, g);
    std::copy(G.begin(), G.end(), g.d_initial_state.data() + g.d_initial_state.offset(n, hv, 0, 0));
  });
  return g;
}

namespace detail {

// Gradient of y = x / sqrt(|x|^2 + eps) along the last dimension: with r = (|x|^2 + eps)^-1/2,
// dx = r (dy - y (y . dy)).
template <class S>
Tensor<S> l2_normalize_backward(const Tensor<S>& x, const Tensor<S>& dy) {
  using std::sqrt;
  Tensor<S> dx(x.shape());
  const std::int64_t width = x.dim(x.rank() - 1);
  if (width == 0) return dx;
  for (std::int64_t row = 0; row < x.numel() / width; ++row) {
    const S* xr = x.data() + row * width;
    const S* dyr = dy.data() + row * width;
    S sum_sq(0);
    for (std::int64_t i = 0; i < width; ++i) sum_sq += xr[i] * xr[i];
    const S r = S(1) / sqrt(sum_sq + l2norm_eps<S>());
    S y_dot_dy(0);
    for (std::int64_t i = 0; i < width; ++i) y_dot_dy += (xr[i] * r) * dyr[i];
    for (std::int64_t i = 0; i < width; ++i) dx.data()[row * width + i] = r * (dyr[i] - (xr[i] * r) * y_dot_dy);
  }
  return dx;
}

// Sums per-value-head gradients [B, T, HV, K] over each group into [B, T, H, K], value heads
// in increasing order.
template <class S>
Tensor<S> sum_groups(const Tensor<S>& per_value_head, std::int64_t H) {
  const std::int64_t B = per_value_head.dim(0), T = per_value_head.dim(1), HV = per_value_head.dim(2),
                     K = per_value_head.dim(3), group = HV / H;
  Tensor<S> out({B, T, H, K});
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t hv = 0; hv < HV; ++hv)
        for (std::int64_t i = 0; i < K; ++i) out(b, t, hv / group, i) += per_value_head(b, t, hv, i);
  return out;
}

}  // namespace detail

// Maps prepared gradients back through the stages (grouped heads, L2 norm, gate, beta
// activation) to gradients of the inputs as given; d_initial_state stays K-first.
template <class S>
Gradients<S> stage_backward(const Inputs<S>& in, const Options<S>& opt, const PreparedInputs<S>& p,
                            PreparedGradients<S> pg, const Dims& d) {
  Gradients<S> g;
  Tensor<S> dq = detail::sum_groups(pg.dq, d.H), dk = detail::sum_groups(pg.dk, d.H);
  if (opt.qk_l2norm) {
    if constexpr (num::scalar_traits<S>::has_transcendentals) {
      dq = detail::l2_normalize_backward(in.q, dq);
      dk = detail::l2_normalize_backward(in.k, dk);
    }
  }
  g.dq = std::move(dq);
  g.dk = std::move(dk);
  g.dv = std::move(pg.dv);

  // Decays: d(decay)/d(log decay) = decay in either base (2^(g log2 e) = e^g).
  g.dg = Tensor<S>(in.g.shape());
  if (opt.gate == GateForm::decay_factor) {
    g.dg = std::move(pg.ddecay);
  } else if constexpr (num::scalar_traits<S>::has_transcendentals) {
    using std::exp;
    const std::int64_t HV = d.HV, K = d.K;
    if (in.A_log && (opt.gate == GateForm::softplus || opt.gate == GateForm::lower_bound))
      g.dA_log = Tensor<S>({HV});
    if (in.dt_bias && (opt.gate == GateForm::softplus || opt.gate == GateForm::lower_bound))
      g.ddt_bias = Tensor<S>({HV, K});
    for (std::int64_t row = 0; row < d.B * d.T; ++row)
      for (std::int64_t h = 0; h < HV; ++h)
        for (std::int64_t c = 0; c < K; ++c) {
          const std::size_t at = static_cast<std::size_t>((row * HV + h) * K + c);
          const S dlog = pg.ddecay.data()[at] * p.decay.data()[at];
          if (opt.gate == GateForm::log_decay) {
            g.dg.data()[at] = dlog;
            continue;
          }
          const S x = in.g.data()[at] + (in.dt_bias ? (*in.dt_bias)(h, c) : S(0));
          const S e = in.A_log ? exp((*in.A_log)(h)) : S(1);
          S dx, dA;
          if (opt.gate == GateForm::softplus) {  // g = -e softplus(x)
            dx = -e * sigmoid(x) * dlog;
            dA = -e * softplus(x) * dlog;
          } else {  // g = lb sigmoid(z), z = e x (or x without A_log)
            const S z = in.A_log ? e * x : x, s = sigmoid(z);
            const S dz = *opt.lower_bound * s * (S(1) - s) * dlog;
            dx = in.A_log ? dz * e : dz;
            dA = dz * z;
          }
          g.dg.data()[at] = dx;
          if (g.dA_log) (*g.dA_log)(h) += dA;
          if (g.ddt_bias) (*g.ddt_bias)(h, c) += dx;
        }
  }

  if (opt.beta == BetaForm::as_given) {
    g.dbeta = std::move(pg.dbeta);
  } else if constexpr (num::scalar_traits<S>::has_transcendentals) {
    const S factor = opt.beta == BetaForm::two_sigmoid ? S(2) : S(1);
    g.dbeta = Tensor<S>(in.beta.shape());
    for (std::int64_t i = 0; i < in.beta.numel(); ++i) {
      const S s = sigmoid(in.beta.data()[i]);
      g.dbeta.data()[i] = pg.dbeta.data()[i] * factor * s * (S(1) - s);
    }
  }

  g.d_initial_state = std::move(pg.d_initial_state);  // K-first; the callers convert
  return g;
}

// Checks the cotangents' shapes against the validated inputs.
void validate_cotangents(const Dims& d, const Shape& d_o, const std::optional<Shape>& d_final_state,
                         StateLayout layout);

// The full KDA backward by the adjoint recurrence: validation, the forward's stages, the
// reverse pass, the stages' gradients.
template <class S>
Gradients<S> recurrent_backward(const Inputs<S>& in, const Options<S>& opt, const Cotangents<S>& cot) {
  const Dims d = validated_dims(in, opt);
  validate_cotangents(d, cot.d_o.shape(),
                      cot.d_final_state ? std::optional<Shape>(cot.d_final_state->shape()) : std::nullopt,
                      opt.state_layout);
  const PreparedInputs<S> p = prepare(in, opt, d);
  const Cotangents<S> cot_k_first{cot.d_o, to_k_first(cot.d_final_state, opt.state_layout)};
  Gradients<S> g =
      stage_backward(in, opt, p, recurrent_adjoint(p, to_k_first(in.initial_state, opt.state_layout), cot_k_first, opt, d), d);
  g.d_initial_state = from_k_first(std::move(g.d_initial_state), opt.state_layout);
  return g;
}

}  // namespace k3ref::kda
