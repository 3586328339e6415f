// The KDA layer as one operator: the whole mixer from hidden states to hidden states
// (docs/kda-layer.md), the operator a fused whole-mixer decode or verify kernel implements.
//
//   q, k = act(conv(x Wq)), act(conv(x Wk))      [tokens, H * K], short convolution with SiLU
//   v    = act(conv(x Wv))                       [tokens, HV * V]   (no conv: act(x W) alone)
//   g    = f_b(f_a(x))                           [tokens, HV, K], raw gate (softplus or lower bound,
//                                                with A_log and dt_bias, inside kda::prepare)
//   beta = x Wb                                  [tokens, HV], sigmoid (or 2 sigmoid) inside kda::prepare
//   o    = KDA(l2norm(q), l2norm(k), v, g, beta) [tokens, HV, V]
//   o    = rmsnorm(o) * w * sigmoid(g_b(g_a(x)) + bias)   per value head, over V
//   y    = o Wo                                  [tokens, D]
//
// Every piece is optional as in FLA's KimiDeltaAttention: the short convolution (and its
// bias), the low-rank factor of either gate projection, A_log, dt_bias, the norm's weight,
// the output gate, the output normalisation. The stages are the operator references
// themselves (kcp::short_conv_forward, kda::recurrent_forward, serving::continuous_batching_decode,
// serving::speculative_verify); this header adds the projections, the output stage and the
// bookkeeping of the convolution states beside the recurrent states. In exact arithmetic the
// layer runs when every transcendental stage is off (conv activation none, decay-factor
// gate, beta as given, no L2 norm, no output norm): the projections, convolution, recurrence
// and output projection are then exact.
#pragma once

#include <algorithm>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "k3ref/kcp/short_conv.h"
#include "k3ref/kda/recurrent.h"
#include "k3ref/serving/decode.h"

namespace k3ref::layer {

using kcp::ConvActivation;

// The parameters of one layer, as nn.Linear stores them: weight [out, in].
template <class S>
struct Weights {
  Tensor<S> q_proj, k_proj;                         // [H * K, D]
  Tensor<S> v_proj;                                 // [HV * V, D]
  std::optional<Tensor<S>> q_conv, k_conv, v_conv;  // [C, W] each, all or none: the short convolution
  std::optional<Tensor<S>> q_conv_bias, k_conv_bias, v_conv_bias;  // [C] (FLA conv_bias=True)
  std::optional<Tensor<S>> f_a;                     // [R, D]; absent: f_b is full rank
  Tensor<S> f_b;                                    // [HV * K, R] (or [HV * K, D])
  Tensor<S> b_proj;                                 // [HV, D]
  std::optional<Tensor<S>> A_log;                   // [HV]
  std::optional<Tensor<S>> dt_bias;                 // [HV * K]
  std::optional<Tensor<S>> g_a;                     // [R, D]; absent: g_b is full rank
  std::optional<Tensor<S>> g_b;                     // [HV * V, R] (or [HV * V, D]); absent: no output gate
  std::optional<Tensor<S>> g_bias;                  // [HV * V]
  std::optional<Tensor<S>> norm_weight;             // [V]
  Tensor<S> o_proj;                                 // [D, HV * V]
};

template <class S>
struct Options {
  std::int64_t H = 1, HV = 1;  // q/k heads, value heads (HV a multiple of H)
  kda::GateForm gate = kda::GateForm::softplus;  // softplus, lower_bound, or decay_factor (exact)
  std::optional<S> lower_bound;
  kda::BetaForm beta = kda::BetaForm::sigmoid;  // two_sigmoid: FLA allow_neg_eigval
  bool qk_l2norm = true;
  ConvActivation activation = ConvActivation::silu;  // of the convolution (or of the projections without it)
  bool output_norm = true;                           // the gated RMSNorm
  S norm_eps = S(1) / S(100000);                     // FLA's default 1e-5
  std::optional<S> scale;                            // default K^-1/2
  int num_threads = 1;
};

// Sizes read off the weights and options.
struct Dims {
  std::int64_t D = 0, H = 0, HV = 0, K = 0, V = 0, W = 0;  // W = 0: no short convolution
  std::int64_t qk() const { return H * K; }
  std::int64_t channels() const { return 2 * H * K + HV * V; }  // the packed q, k, v convolution channels
};

template <class S>
Dims dims_of(const Weights<S>& w, const Options<S>& opt) {
  auto fail = [](const std::string& what) { throw InvalidArgument("layer::kda: " + what); };
  if (w.q_proj.rank() != 2 || w.k_proj.shape() != w.q_proj.shape() || w.v_proj.rank() != 2 ||
      w.v_proj.dim(1) != w.q_proj.dim(1))
    fail("arguments 'q_proj', 'k_proj', 'v_proj': expected [H * K, D], [H * K, D], [HV * V, D]");
  Dims d;
  d.D = w.q_proj.dim(1);
  d.H = opt.H;
  d.HV = opt.HV;
  if (d.H < 1 || d.HV < d.H || d.HV % d.H != 0) fail("options 'H', 'HV': HV must be a positive multiple of H");
  if (w.q_proj.dim(0) % d.H != 0 || w.v_proj.dim(0) % d.HV != 0) fail("projections do not split into heads");
  d.K = w.q_proj.dim(0) / d.H;
  d.V = w.v_proj.dim(0) / d.HV;
  const bool conv = w.q_conv.has_value();
  if (w.k_conv.has_value() != conv || w.v_conv.has_value() != conv) fail("the three conv weights come together");
  if (conv) {
    d.W = w.q_conv->dim(1);
    if (w.q_conv->shape() != Shape{d.qk(), d.W} || w.k_conv->shape() != Shape{d.qk(), d.W} ||
        w.v_conv->shape() != Shape{d.HV * d.V, d.W} || d.W < 1)
      fail("conv weights: expected [C, W]");
  }
  const std::int64_t r_f = w.f_a ? w.f_a->dim(0) : d.D;
  if ((w.f_a && w.f_a->shape() != Shape{r_f, d.D}) || w.f_b.shape() != Shape{d.HV * d.K, r_f})
    fail("arguments 'f_a', 'f_b': expected [R, D], [HV * K, R]");
  if (w.b_proj.shape() != Shape{d.HV, d.D}) fail("argument 'b_proj': expected [HV, D]");
  if (w.dt_bias && w.dt_bias->shape() != Shape{d.HV * d.K}) fail("argument 'dt_bias': expected [HV * K]");
  if (w.g_b) {
    const std::int64_t r_g = w.g_a ? w.g_a->dim(0) : d.D;
    if ((w.g_a && w.g_a->shape() != Shape{r_g, d.D}) || w.g_b->shape() != Shape{d.HV * d.V, r_g})
      fail("arguments 'g_a', 'g_b': expected [R, D], [HV * V, R]");
    if (!opt.output_norm) fail("the output gate acts inside the output norm: 'output_norm' is off");
  } else if (w.g_a || w.g_bias) {
    fail("'g_a' and 'g_bias' need 'g_b'");
  }
  if (w.g_bias && w.g_bias->shape() != Shape{d.HV * d.V}) fail("argument 'g_bias': expected [HV * V]");
  if (w.norm_weight && (w.norm_weight->shape() != Shape{d.V} || !opt.output_norm))
    fail("argument 'norm_weight': expected [V], with 'output_norm'");
  if (w.o_proj.shape() != Shape{d.D, d.HV * d.V}) fail("argument 'o_proj': expected [D, HV * V]");
  return d;
}

// x [rows, in] times weight^T [in, out] (+ bias), summed over `in` in order.
template <class S>
Tensor<S> linear(const Tensor<S>& x, const Tensor<S>& weight, const std::optional<Tensor<S>>& bias = std::nullopt) {
  const std::int64_t rows = x.dim(0), in = x.dim(1), out = weight.dim(0);
  Tensor<S> y({rows, out});
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t o = 0; o < out; ++o) {
      S acc = bias ? (*bias)(o) : S(0);
      for (std::int64_t i = 0; i < in; ++i) acc += x(r, i) * weight(o, i);
      y(r, o) = acc;
    }
  return y;
}

// Columns [from, from + width) of a [rows, C] tensor.
template <class S>
Tensor<S> columns(const Tensor<S>& x, std::int64_t from, std::int64_t width) {
  Tensor<S> y({x.dim(0), width});
  for (std::int64_t r = 0; r < x.dim(0); ++r)
    for (std::int64_t c = 0; c < width; ++c) y(r, c) = x(r, from + c);
  return y;
}

// [rows, C] side by side.
template <class S>
Tensor<S> side_by_side(const std::vector<const Tensor<S>*>& parts) {
  std::int64_t width = 0;
  for (const Tensor<S>* p : parts) width += p->dim(1);
  Tensor<S> y({parts.at(0)->dim(0), width});
  std::int64_t at = 0;
  for (const Tensor<S>* p : parts) {
    for (std::int64_t r = 0; r < p->dim(0); ++r)
      for (std::int64_t c = 0; c < p->dim(1); ++c) y(r, at + c) = (*p)(r, c);
    at += p->dim(1);
  }
  return y;
}

// The gated RMSNorm of the output (FLA's FusedRMSNormGated, activation sigmoid), per row of
// V values: o * (mean(o^2) + eps)^-1/2 * weight * sigmoid(gate). The norm first, then the gate.
template <class S>
Tensor<S> gated_rms_norm(const Tensor<S>& o, const std::optional<Tensor<S>>& gate, const std::optional<Tensor<S>>& weight,
                         const S& eps, std::int64_t V) {
  if constexpr (!num::scalar_traits<S>::has_transcendentals) {
    throw InvalidArgument("layer::kda: the output norm needs sqrt; turn 'output_norm' off in exact arithmetic");
  } else {
    using std::sqrt;
    Tensor<S> y(o.shape());
    for (std::int64_t row = 0; row < o.numel() / V; ++row) {
      const S* x = o.data() + row * V;
      S sum_sq(0);
      for (std::int64_t j = 0; j < V; ++j) sum_sq += x[j] * x[j];
      const S inv = S(1) / sqrt(sum_sq / S(V) + eps);
      for (std::int64_t j = 0; j < V; ++j) {
        S z = x[j] * inv;
        if (weight) z = z * (*weight)(j);
        if (gate) z = z * kda::sigmoid(gate->data()[row * V + j]);
        y.data()[row * V + j] = z;
      }
    }
    return y;
  }
}

// The convolution states of a batch of documents: q, k and v channels packed in that order,
// [N, 2 H K + HV V, W - 1], oldest input first (kcp/short_conv.h).
template <class S>
using ConvStates = Tensor<S>;

// What one call carries in and out besides the tokens: per document its recurrent state
// [N, HV, K, V] (K-first) and its convolution states.
template <class S>
struct LayerState {
  Tensor<S> recurrent;  // [N, HV, K, V]
  ConvStates<S> conv;   // [N, C, W - 1]; [N, C, 0] without a short convolution
};

// The projected and convolved inputs of the recurrence, and what the output stage needs.
template <class S>
struct Mixed {
  kda::Inputs<S> kda;                  // [1, tokens, ...] packed, with cu_seqlens
  kda::Options<S> kda_options;
  std::optional<Tensor<S>> out_gate;   // [tokens, HV * V] output-gate logits
  Tensor<S> conv_in;                   // [1, tokens, C] the convolution's inputs (projections)
  Tensor<S> conv_final;                // [N, C, W - 1]
};

// Documents of a packed call: cu_seqlens [N + 1] from 0 to tokens.
inline std::vector<std::int64_t> whole_batch(std::int64_t tokens) { return {0, tokens}; }

// Projections, short convolution from `conv_initial` (zero when absent), and the KDA inputs
// with the layer's gate and beta; x is [tokens, D], documents at cu_seqlens.
template <class S>
Mixed<S> mix_inputs(const Tensor<S>& x, const Weights<S>& w, const Options<S>& opt, const Dims& d,
                    const std::vector<std::int64_t>& cu, const std::optional<ConvStates<S>>& conv_initial) {
  if (x.rank() != 2 || x.dim(1) != d.D) throw InvalidArgument("layer::kda: argument 'x': expected [tokens, D]");
  const std::int64_t T = x.dim(0), N = static_cast<std::int64_t>(cu.size()) - 1, C = d.channels();
  Mixed<S> m;
  const Tensor<S> q = linear(x, w.q_proj), k = linear(x, w.k_proj), v = linear(x, w.v_proj);
  m.conv_in = Tensor<S>({1, T, C}, side_by_side<S>({&q, &k, &v}).values());
  Tensor<S> mixed;  // [1, T, C] after the convolution and activation
  if (d.W > 0) {
    kcp::ShortConvInputs<S> ci;
    ci.x = m.conv_in;
    const Tensor<S> weight = Tensor<S>({C, d.W}, [&] {
      std::vector<S> all = w.q_conv->values();
      all.insert(all.end(), w.k_conv->values().begin(), w.k_conv->values().end());
      all.insert(all.end(), w.v_conv->values().begin(), w.v_conv->values().end());
      return all;
    }());
    ci.weight = weight;
    if (w.q_conv_bias || w.k_conv_bias || w.v_conv_bias) {
      Tensor<S> bias({C});
      const std::int64_t at[3] = {0, d.qk(), 2 * d.qk()};
      const std::optional<Tensor<S>>* b[3] = {&w.q_conv_bias, &w.k_conv_bias, &w.v_conv_bias};
      for (int part = 0; part < 3; ++part)
        if (*b[part])
          for (std::int64_t c = 0; c < (*b[part])->numel(); ++c) bias(at[part] + c) = (**b[part])(c);
      ci.bias = bias;
    }
    if (conv_initial) {
      if (conv_initial->shape() != Shape{N, C, d.W - 1})
        throw InvalidArgument("layer::kda: argument 'conv_state': expected [N, C, W - 1] = " +
                              shape_to_string({N, C, d.W - 1}));
      ci.initial_state = *conv_initial;
    }
    ci.cu_seqlens = cu;
    auto co = kcp::short_conv_forward(ci, opt.activation);
    mixed = std::move(co.y);
    m.conv_final = std::move(co.final_state);
  } else {
    mixed = m.conv_in.template map<S>([&](const S& s) { return kcp::conv_activate(s, opt.activation); });
    m.conv_final = Tensor<S>({N, C, 0});
  }
  const Tensor<S> flat({T, C}, mixed.values());
  m.kda.q = Tensor<S>({1, T, d.H, d.K}, columns(flat, 0, d.qk()).values());
  m.kda.k = Tensor<S>({1, T, d.H, d.K}, columns(flat, d.qk(), d.qk()).values());
  m.kda.v = Tensor<S>({1, T, d.HV, d.V}, columns(flat, 2 * d.qk(), d.HV * d.V).values());
  const Tensor<S> g = w.f_a ? linear(linear(x, *w.f_a), w.f_b) : linear(x, w.f_b);
  m.kda.g = Tensor<S>({1, T, d.HV, d.K}, g.values());
  m.kda.beta = Tensor<S>({1, T, d.HV}, linear(x, w.b_proj).values());
  m.kda.A_log = w.A_log;
  if (w.dt_bias) m.kda.dt_bias = Tensor<S>({d.HV, d.K}, w.dt_bias->values());
  m.kda.cu_seqlens = cu;
  if (w.g_b) m.out_gate = w.g_a ? linear(linear(x, *w.g_a), *w.g_b, w.g_bias) : linear(x, *w.g_b, w.g_bias);
  kda::Options<S>& ko = m.kda_options;
  ko.scale = opt.scale;
  ko.qk_l2norm = opt.qk_l2norm;
  ko.gate = opt.gate;
  ko.lower_bound = opt.lower_bound;
  ko.beta = opt.beta;
  ko.num_threads = opt.num_threads;
  return m;
}

// The output stage: the gated RMSNorm (if on) and the output projection; o [1, tokens, HV, V].
template <class S>
Tensor<S> output_stage(const Tensor<S>& o, const Mixed<S>& m, const Weights<S>& w, const Options<S>& opt, const Dims& d) {
  const std::int64_t T = o.dim(1);
  Tensor<S> flat({T, d.HV * d.V}, o.values());
  if (opt.output_norm) flat = gated_rms_norm(flat, m.out_gate, w.norm_weight, opt.norm_eps, d.V);
  return linear(flat, w.o_proj);
}

// ---- Prefill ------------------------------------------------------------------------------

template <class S>
struct ForwardOutputs {
  Tensor<S> y;            // [B, T, D]; zero at the positions the attention mask drops
  LayerState<S> final;    // per document
};

// How the tokens of x [B, T, D] form documents: explicit cu_seqlens (B == 1) take precedence
// over an attention mask [B, T] (1: a token, 0: padding), which FLA reads only without them;
// with neither, each row is a document. Returns the kept flat rows (b * T + t) and the
// documents over them.
struct Packing {
  std::vector<std::int64_t> rows;
  std::vector<std::int64_t> cu_seqlens;
};
inline Packing pack_tokens(std::int64_t B, std::int64_t T, const std::optional<std::vector<std::int64_t>>& cu_seqlens,
                           const std::optional<Tensor<std::int64_t>>& attention_mask) {
  Packing p;
  if (cu_seqlens) {
    if (B != 1) throw InvalidArgument("layer::kda: argument 'cu_seqlens': requires B == 1");
    for (std::int64_t t = 0; t < T; ++t) p.rows.push_back(t);
    p.cu_seqlens = *cu_seqlens;  // the mask, if any, is not read
    return p;
  }
  p.cu_seqlens.push_back(0);
  if (attention_mask && attention_mask->shape() != Shape{B, T})
    throw InvalidArgument("layer::kda: argument 'attention_mask': expected [B, T]");
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t t = 0; t < T; ++t)
      if (!attention_mask || (*attention_mask)(b, t) != 0) p.rows.push_back(b * T + t);
    p.cu_seqlens.push_back(static_cast<std::int64_t>(p.rows.size()));
  }
  return p;
}

// The whole layer over documents: x [B, T, D] (B == 1 with cu_seqlens), states entering each
// document (zero when absent), the states after each.
template <class S>
ForwardOutputs<S> kda_layer_forward(const Tensor<S>& x, const Weights<S>& w, const Options<S>& opt,
                                    const std::type_identity_t<std::optional<LayerState<S>>>& initial = std::nullopt,
                                    const std::optional<std::vector<std::int64_t>>& cu_seqlens = std::nullopt,
                                    const std::optional<Tensor<std::int64_t>>& attention_mask = std::nullopt) {
  const Dims d = dims_of(w, opt);
  if (x.rank() != 3 || x.dim(2) != d.D) throw InvalidArgument("layer::kda: argument 'x': expected [B, T, D]");
  const std::int64_t B = x.dim(0), T = x.dim(1);
  const Packing pk = pack_tokens(B, T, cu_seqlens, attention_mask);
  const std::int64_t kept = static_cast<std::int64_t>(pk.rows.size());
  Tensor<S> packed({kept, d.D});
  for (std::int64_t r = 0; r < kept; ++r)
    std::copy(x.data() + pk.rows[r] * d.D, x.data() + (pk.rows[r] + 1) * d.D, packed.data() + r * d.D);
  Mixed<S> m = mix_inputs(packed, w, opt, d, pk.cu_seqlens,
                          initial ? std::optional<ConvStates<S>>(initial->conv) : std::nullopt);
  if (initial) m.kda.initial_state = initial->recurrent;
  m.kda_options.output_final_state = true;
  kda::Outputs<S> ko = kda::recurrent_forward(m.kda, m.kda_options);
  const Tensor<S> y = output_stage(ko.o, m, w, opt, d);
  ForwardOutputs<S> out{Tensor<S>({B, T, d.D}), {std::move(*ko.final_state), std::move(m.conv_final)}};
  for (std::int64_t r = 0; r < kept; ++r) std::copy(y.data() + r * d.D, y.data() + (r + 1) * d.D, out.y.data() + pk.rows[r] * d.D);
  return out;
}

// ---- Serving: the fused decode and verify forms over a state pool and a conv pool ----------

// A pool of convolution states, one per slot, indexed like the state pool: slot s holds
// [C, W - 1] at conv_pool[s]. Engines keep the two pools side by side under one slot index.
template <class S>
using ConvPool = Tensor<S>;  // [slots, C, W - 1]

namespace detail {

template <class S>
ConvStates<S> gather_conv(const ConvPool<S>& pool, const std::vector<std::int64_t>& slots) {
  const std::int64_t C = pool.dim(1), M = pool.dim(2);
  ConvStates<S> out({static_cast<std::int64_t>(slots.size()), C, M});
  for (std::size_t n = 0; n < slots.size(); ++n)
    if (slots[n] != serving::pad_slot)
      std::copy(pool.data() + slots[n] * C * M, pool.data() + (slots[n] + 1) * C * M, out.data() + n * C * M);
  return out;
}

template <class S>
void put_conv(ConvPool<S>& pool, std::int64_t slot, const S* state) {
  const std::int64_t size = pool.dim(1) * pool.dim(2);
  std::copy(state, state + size, pool.data() + slot * size);
}

template <class S>
void check_conv_pool(const ConvPool<S>& pool, const serving::PoolLayout& states, const Dims& d) {
  if (pool.rank() != 3 || pool.dim(0) != states.slots || pool.dim(1) != d.channels() || pool.dim(2) != std::max<std::int64_t>(d.W - 1, 0))
    throw InvalidArgument("layer::kda: argument 'conv_pool': expected [slots, C, W - 1] = " +
                          shape_to_string({states.slots, d.channels(), std::max<std::int64_t>(d.W - 1, 0)}) +
                          " with the state pool's slots");
}

inline std::vector<std::int64_t> cu_of(const std::vector<std::int64_t>& cu, std::int64_t tokens) {
  if (cu.empty()) return whole_batch(tokens);
  return cu;
}

}  // namespace detail

// The convolution state after every token of every document: row r of [tokens, C, W - 1] is
// the state a document would carry on after its token r (the last W - 1 convolution inputs,
// reading the entering state before the document's start). The conv tape of verify.
template <class S>
Tensor<S> conv_tape(const Tensor<S>& conv_in, const ConvStates<S>& entering, const std::vector<std::int64_t>& cu) {
  const std::int64_t T = conv_in.dim(1), C = conv_in.dim(2), M = entering.dim(2);
  Tensor<S> tape({T, C, M});
  for (std::size_t n = 0; n + 1 < cu.size(); ++n)
    for (std::int64_t t = cu[n]; t < cu[n + 1]; ++t)
      for (std::int64_t c = 0; c < C; ++c)
        for (std::int64_t m = 0; m < M; ++m) {
          const std::int64_t tau = t + 1 - M + m;  // input position held in entry m
          tape(t, c, m) = tau >= cu[n] ? conv_in(0, tau, c) : entering(static_cast<std::int64_t>(n), c, M - (cu[n] - tau));
        }
  return tape;
}

// Continuous-batching decode of the whole layer: x [tokens, D], sequence n owns tokens
// [cu[n], cu[n+1]) (one in decode, more in a chunked prefill) and slot slot_of_sequence[n]
// of both pools; it enters with that slot's recurrent and conv states and leaves its final
// ones there. pad_slot (-1): nothing read or written, output zero; a sequence without
// tokens touches nothing. Returns y [tokens, D].
template <class S>
Tensor<S> kda_layer_decode(const Tensor<S>& x, const Weights<S>& w, const Options<S>& opt, serving::StatePool<S>& pool,
                           ConvPool<S>& conv_pool, const std::vector<std::int64_t>& cu_seqlens,
                           const std::vector<std::int64_t>& slot_of_sequence) {
  const Dims d = dims_of(w, opt);
  detail::check_conv_pool(conv_pool, pool.layout, d);
  const std::vector<std::int64_t> cu = detail::cu_of(cu_seqlens, x.dim(0));
  const std::int64_t N = static_cast<std::int64_t>(cu.size()) - 1;
  if (static_cast<std::int64_t>(slot_of_sequence.size()) != N)
    throw InvalidArgument("layer::kda_decode: argument 'slot_of_sequence': one slot per sequence");
  std::vector<std::int64_t> entering = slot_of_sequence;
  for (std::int64_t n = 0; n < N; ++n)
    if (cu[n + 1] == cu[n]) entering[n] = serving::pad_slot;
  for (std::int64_t s : entering)
    if (s != serving::pad_slot && (s < 0 || s >= pool.layout.slots))
      throw InvalidArgument("layer::kda_decode: argument 'slot_of_sequence': slot " + std::to_string(s) + " out of range");
  Mixed<S> m = mix_inputs(x, w, opt, d, cu, std::optional<ConvStates<S>>(detail::gather_conv(conv_pool, entering)));
  kda::Options<S> ko = m.kda_options;
  ko.state_layout = pool.layout.layout;
  // The recurrence over the state pool is serving's (its slot rules, its padding).
  const Tensor<S> o = serving::continuous_batching_decode(m.kda, ko, pool, slot_of_sequence);
  Tensor<S> y = output_stage(o, m, w, opt, d);
  const std::int64_t size = m.conv_final.numel() / std::max<std::int64_t>(N, 1);
  for (std::int64_t n = 0; n < N; ++n) {
    if (entering[n] == serving::pad_slot) {
      std::fill(y.data() + cu[n] * d.D, y.data() + cu[n + 1] * d.D, S(0));
      continue;
    }
    detail::put_conv(conv_pool, entering[n], m.conv_final.data() + n * size);
  }
  return y;
}

template <class S>
struct VerifyOutputs {
  Tensor<S> y;                            // [tokens, D]
  std::optional<Tensor<S>> token_states;  // per_token_output: [tokens, HV, K, V] (pool layout), row bos + t
  std::optional<Tensor<S>> conv_tape;     // per_token_output: [tokens, C, W - 1], row bos + t
};

// Target verify of the whole layer (serving::speculative_verify's contract, the conv pool
// beside the state pool under the same indices): sequence n enters with the states of slot
// state_indices[n, num_accepted[n] - 1] of both pools; the recurrent and conv states after
// its t-th token go to slot state_indices[n, t] of both (in_place; -1 stores nothing) or to
// row bos + t of the two tapes (per_token_output; the pools are then only read). A padded
// sequence (entering entry -1): nothing read or written, outputs zero.
template <class S>
VerifyOutputs<S> kda_layer_verify(const Tensor<S>& x, const Weights<S>& w, const Options<S>& opt, serving::StatePool<S>& pool,
                                  ConvPool<S>& conv_pool, const std::vector<std::int64_t>& cu_seqlens,
                                  const Tensor<std::int64_t>& state_indices, const std::vector<std::int64_t>& num_accepted,
                                  serving::StateWrites writes = serving::StateWrites::in_place) {
  const Dims d = dims_of(w, opt);
  detail::check_conv_pool(conv_pool, pool.layout, d);
  const std::vector<std::int64_t> cu = detail::cu_of(cu_seqlens, x.dim(0));
  const std::int64_t N = static_cast<std::int64_t>(cu.size()) - 1;
  serving::BatchShape batch;
  batch.N = N;
  batch.tokens = x.dim(0);
  for (std::int64_t n = 0; n < N; ++n) {
    batch.first_token.push_back(cu[n]);
    batch.length.push_back(cu[n + 1] - cu[n]);
  }
  const serving::VerifyPlan plan = serving::plan_verify(batch, pool.layout, state_indices, num_accepted, writes);
  Mixed<S> m = mix_inputs(x, w, opt, d, cu, std::optional<ConvStates<S>>(detail::gather_conv(conv_pool, plan.entering_slot)));
  const Tensor<S> tape = conv_tape(m.conv_in, detail::gather_conv(conv_pool, plan.entering_slot), cu);
  kda::Options<S> ko = m.kda_options;
  ko.state_layout = pool.layout.layout;
  auto sv = serving::speculative_verify(m.kda, ko, pool, state_indices, num_accepted, writes);
  VerifyOutputs<S> out{output_stage(sv.o, m, w, opt, d), std::move(sv.token_states), std::nullopt};
  if (writes == serving::StateWrites::per_token_output) out.conv_tape = Tensor<S>(tape.shape());
  const std::int64_t size = tape.numel() / std::max<std::int64_t>(batch.tokens, 1);
  for (std::int64_t n = 0; n < N; ++n) {
    if (plan.entering_slot[n] == serving::pad_slot) {
      std::fill(out.y.data() + cu[n] * d.D, out.y.data() + cu[n + 1] * d.D, S(0));
      continue;
    }
    for (std::int64_t t = 0; t < batch.length[n]; ++t) {
      const S* row = tape.data() + (cu[n] + t) * size;
      if (writes == serving::StateWrites::in_place) {
        if (state_indices(n, t) != serving::pad_slot) detail::put_conv(conv_pool, state_indices(n, t), row);
      } else {
        std::copy(row, row + size, out.conv_tape->data() + (cu[n] + t) * size);
      }
    }
  }
  return out;
}

// Rollback to the accepted prefix after a per-token verify: sequence n accepted the first
// accepted[n] tokens of its window (1 <= accepted[n] <= its length; 0 keeps the slot as
// it was), so slot slot_of_sequence[n] of both pools takes the tapes' rows bos + accepted - 1.
// Equal to decoding the accepted tokens one after another (tests/layer).
template <class S>
void accept_prefix(serving::StatePool<S>& pool, ConvPool<S>& conv_pool, const VerifyOutputs<S>& verified,
                   const std::vector<std::int64_t>& cu_seqlens, const std::vector<std::int64_t>& slot_of_sequence,
                   const std::vector<std::int64_t>& accepted) {
  if (!verified.token_states || !verified.conv_tape)
    throw InvalidArgument("layer::accept_prefix: needs the tapes of a per_token_output verify");
  const std::vector<std::int64_t> cu = detail::cu_of(cu_seqlens, verified.y.dim(0));
  const std::int64_t N = static_cast<std::int64_t>(cu.size()) - 1;
  if (static_cast<std::int64_t>(slot_of_sequence.size()) != N || static_cast<std::int64_t>(accepted.size()) != N)
    throw InvalidArgument("layer::accept_prefix: one slot and one accepted count per sequence");
  const std::int64_t conv_size = verified.conv_tape->numel() / std::max<std::int64_t>(verified.y.dim(0), 1);
  for (std::int64_t n = 0; n < N; ++n) {
    const std::int64_t a = accepted[n], slot = slot_of_sequence[n];
    if (a < 0 || a > cu[n + 1] - cu[n])
      throw InvalidArgument("layer::accept_prefix: argument 'accepted': sequence " + std::to_string(n) + " has " +
                            std::to_string(cu[n + 1] - cu[n]) + " tokens, accepted " + std::to_string(a));
    if (a == 0 || slot == serving::pad_slot) continue;
    Tensor<S> state = serving::detail::state_at(*verified.token_states, cu[n] + a - 1);
    if (pool.layout.layout == kda::StateLayout::v_first) state = serving::transpose_state(state);
    serving::write_slot(pool, slot, state);
    detail::put_conv(conv_pool, slot, verified.conv_tape->data() + (cu[n] + a - 1) * conv_size);
  }
}

}  // namespace k3ref::layer
