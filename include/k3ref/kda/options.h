// Options of the KDA references. They follow FLA's `chunk_kda` / `fused_recurrent_kda`
// (docs/conventions.md): only options that change the mathematics appear here.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string_view>
#include <vector>

#include "k3ref/tensor/tensor.h"
#include "k3ref/vocabulary.h"

namespace k3ref::kda {

enum class StateLayout {
  k_first,  // [N, HV, K, V], FLA's default
  v_first,  // [N, HV, V, K], FLA's state_v_first=True and FlashKDA
};
inline constexpr Choices<StateLayout, 2> state_layouts{
    "state_layout", {{{StateLayout::k_first, "k_first", "[N,HV,K,V]"}, {StateLayout::v_first, "v_first", "[N,HV,V,K]"}}}};

// How the tensor `g` is turned into per-channel multiplicative decays.
enum class GateForm {
  log_decay,     // g is already the natural-log decay (FLA without the gate in the kernel)
  decay_factor,  // g holds exp(g) itself: lets exact arithmetic give decays as rationals
  softplus,      // g raw: g <- -exp(A_log[h]) * softplus(g + dt_bias[h, :])
  lower_bound,   // g raw: g <- lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h, :])),
                 //        or lower_bound * sigmoid(g + dt_bias[h, :]) without A_log
};
inline constexpr Choices<GateForm, 4> gate_forms{
    "gate",
    {{{GateForm::log_decay, "log_decay", ""},
      {GateForm::decay_factor, "decay_factor", "g is the decay itself"},
      {GateForm::softplus, "softplus", "raw g, A_log, dt_bias"},
      {GateForm::lower_bound, "lower_bound", "raw g, lower_bound"}}}};

// The base the kernel exponentiates in. FLA's API and the recurrence use exp(g);
// FlashKDA multiplies the gate by log2(e) and uses exp2. Mathematically equal
// (proofs/gate_base.md); both are modelled so the equality is tested.
enum class GateBase { e, two };
inline constexpr Choices<GateBase, 2> gate_bases{
    "gate_base", {{{GateBase::e, "e", ""}, {GateBase::two, "2", "FlashKDA's exp2 convention"}}}};

enum class BetaForm {
  as_given,     // beta used as is
  sigmoid,      // sigmoid(beta)  (FLA use_beta_sigmoid_in_kernel, FlashKDA)
  two_sigmoid,  // 2 * sigmoid(beta): allows negative eigenvalues of I - beta k k^T
};
inline constexpr Choices<BetaForm, 3> beta_forms{"beta",
                                                 {{{BetaForm::as_given, "as_given", ""},
                                                   {BetaForm::sigmoid, "sigmoid", ""},
                                                   {BetaForm::two_sigmoid, "two_sigmoid", "2 sigmoid(beta)"}}}};

// How the gradients are computed: the adjoint recurrence (kda/backward.h) or the chunkwise
// backward (kda/chunkwise_backward.h); the Python module's kda_backward(method=).
enum class BackwardMethod { adjoint, chunkwise };
inline constexpr Choices<BackwardMethod, 2> backward_methods{
    "method", {{{BackwardMethod::adjoint, "adjoint", ""}, {BackwardMethod::chunkwise, "chunkwise", ""}}}};

inline std::string_view to_string(StateLayout x) { return state_layouts.name(x); }
inline std::string_view to_string(GateForm x) { return gate_forms.name(x); }
inline std::string_view to_string(GateBase x) { return gate_bases.name(x); }
inline std::string_view to_string(BetaForm x) { return beta_forms.name(x); }

template <class S>
struct Options {
  std::optional<S> scale;  // default K^-1/2 (exact types need a perfect-square K or an explicit scale)
  bool qk_l2norm = false;  // x / sqrt(sum(x^2) + 1e-6) on q and k before use
  GateForm gate = GateForm::log_decay;
  GateBase gate_base = GateBase::e;
  std::optional<S> lower_bound;  // required by GateForm::lower_bound, must be negative
  BetaForm beta = BetaForm::as_given;
  StateLayout state_layout = StateLayout::k_first;  // of initial_state, final_state and all_states
  bool output_final_state = true;
  bool output_all_states = false;  // per-token states [B, T, HV, K, V] (or V-first)
  int num_threads = 1;             // parallel over (sequence, value head); never changes a result
  // Called (from any thread) with the token-heads just done, for progress lines
  // (exec/progress.h); empty: not called. Read by the recurrence.
  std::function<void(std::int64_t)> progress;
};

// The same options for another scalar (the two numeric fields converted, the rest copied).
template <class To, class From>
Options<To> convert_options(const Options<From>& o) {
  Options<To> r;
  if (o.scale) r.scale = static_cast<To>(*o.scale);
  r.qk_l2norm = o.qk_l2norm;
  r.gate = o.gate;
  r.gate_base = o.gate_base;
  if (o.lower_bound) r.lower_bound = static_cast<To>(*o.lower_bound);
  r.beta = o.beta;
  r.state_layout = o.state_layout;
  r.output_final_state = o.output_final_state;
  r.output_all_states = o.output_all_states;
  r.num_threads = o.num_threads;
  r.progress = o.progress;
  return r;
}

template <class S>
struct Inputs {
  Tensor<S> q;     // [B, T, H, K]
  Tensor<S> k;     // [B, T, H, K]
  Tensor<S> v;     // [B, T, HV, V]
  Tensor<S> g;     // [B, T, HV, K], meaning set by Options::gate
  Tensor<S> beta;  // [B, T, HV]
  std::optional<Tensor<S>> initial_state;  // [N, HV, K, V] (or V-first); zero when absent
  std::optional<Tensor<S>> A_log;          // [HV]
  std::optional<Tensor<S>> dt_bias;        // [HV, K]
  std::optional<std::vector<std::int64_t>> cu_seqlens;  // [N + 1], requires B == 1
};

template <class S>
struct Outputs {
  Tensor<S> o;                            // [B, T, HV, V]
  std::optional<Tensor<S>> final_state;   // [N, HV, K, V] (or V-first)
  std::optional<Tensor<S>> all_states;    // [B, T, HV, K, V] (or V-first), state after each token
};

// Sizes read off validated inputs.
struct Dims {
  std::int64_t B = 0, T = 0, H = 0, HV = 0, K = 0, V = 0;
  std::int64_t N = 0;                    // number of sequences (B, or cu_seqlens.size() - 1)
  std::vector<std::int64_t> seq_begin;   // per sequence: [batch row, first token, end token)
  std::vector<std::int64_t> seq_batch;
  std::vector<std::int64_t> seq_end;
};

// Shapes of the inputs, scalar-free, so validation lives in one compiled place.
struct InputShapes {
  Shape q, k, v, g, beta;
  std::optional<Shape> initial_state, A_log, dt_bias;
  const std::vector<std::int64_t>* cu_seqlens = nullptr;
  GateForm gate = GateForm::log_decay;
  bool has_lower_bound = false;
  StateLayout state_layout = StateLayout::k_first;
};

// Checks every shape and option; throws InvalidArgument naming the argument.
Dims validate(const InputShapes& shapes);

}  // namespace k3ref::kda
