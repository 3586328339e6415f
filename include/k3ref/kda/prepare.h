// The entry of every KDA form: the one validation of inputs and options, and the optional
// stages (L2 norm, gate, beta activation, default scale) that turn the inputs as given
// into what the recurrence consumes.
#pragma once

#include <algorithm>
#include <optional>
#include <string>

#include "k3ref/exec/parallel.h"
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

// The one entry validation of every KDA form (recurrence, chunkwise, backward, context
// parallel): shapes and options (kda::validate), then the scalar-valued options. `who`
// prefixes the messages ("kda", "kcp::context_parallel_forward", ...).
template <class S>
Dims validated_dims(const Inputs<S>& in, const Options<S>& opt, const std::string& who = "kda") {
  const Dims d = validate(shapes_of(in, opt));
  if (opt.lower_bound && !(*opt.lower_bound < S(0)))
    throw InvalidArgument(who + ": argument 'lower_bound': must be negative");
  if (opt.num_threads < 1) throw InvalidArgument(who + ": argument 'num_threads': must be at least 1");
  return d;
}

// The state layout (Options::state_layout) is an I/O convention: every algorithm works on
// K-first states [..., K, V]. The public forms convert the states they are given on entry
// and the states they return on exit with these two, and nowhere else.
template <class S>
Tensor<S> transpose_last_two(const Tensor<S>& t) {
  const std::size_t r = t.rank();
  const std::int64_t A = t.dim(r - 2), B = t.dim(r - 1), outer = A * B == 0 ? 0 : t.numel() / (A * B);
  Shape shape = t.shape();
  std::swap(shape[r - 2], shape[r - 1]);
  Tensor<S> out(shape);
  for (std::int64_t o = 0; o < outer; ++o)
    for (std::int64_t i = 0; i < A; ++i)
      for (std::int64_t j = 0; j < B; ++j) out.data()[(o * B + j) * A + i] = t.data()[(o * A + i) * B + j];
  return out;
}

// A state (or state gradient) as given, in `layout`, to the K-first layout of the algorithms.
template <class S>
Tensor<S> to_k_first(Tensor<S> state, StateLayout layout) {
  if (layout == StateLayout::k_first) return state;
  return transpose_last_two(state);
}
template <class S>
std::optional<Tensor<S>> to_k_first(std::optional<Tensor<S>> state, StateLayout layout) {
  if (state) state = to_k_first(std::move(*state), layout);
  return state;
}

// A K-first state computed by an algorithm, to the `layout` the caller asked for.
template <class S>
Tensor<S> from_k_first(Tensor<S> state, StateLayout layout) {
  if (layout == StateLayout::k_first) return state;
  return transpose_last_two(state);
}
template <class S>
std::optional<Tensor<S>> from_k_first(std::optional<Tensor<S>> state, StateLayout layout) {
  if (state) state = from_k_first(std::move(*state), layout);
  return state;
}

// Runs the optional stages (L2 norm, gate, beta activation, default scale).
template <class S>
PreparedInputs<S> prepare(const Inputs<S>& in, const Options<S>& opt, const Dims& d) {
  PreparedInputs<S> p;
  // Four independent stages (q, k, decays, beta), run side by side. Each writes its own
  // tensor, so the result does not depend on the thread count; exec::parallel_for rethrows
  // the error of the first stage in stage order, so neither does the message.
  exec::parallel_for(4, opt.num_threads, [&](std::int64_t stage) {
    switch (stage) {
      case 0:
      case 1: {
        const Tensor<S>& x = stage == 0 ? in.q : in.k;
        Tensor<S>& y = stage == 0 ? p.q : p.k;
        if (!opt.qk_l2norm) {
          y = x;
        } else if constexpr (num::scalar_traits<S>::has_transcendentals) {
          y = l2_normalize(x);
        } else {
          throw InvalidArgument("kda: option 'qk_l2norm' needs sqrt; normalise inputs beforehand in exact arithmetic");
        }
        break;
      }
      case 2:
        switch (opt.gate) {
          case GateForm::decay_factor: p.decay = in.g; break;
          case GateForm::log_decay: p.decay = decay_factors(in.g, opt.gate_base); break;
          case GateForm::softplus:
          case GateForm::lower_bound:
            p.decay =
                decay_factors(gate_log_decay(in.g, opt.gate, in.A_log, in.dt_bias, opt.lower_bound), opt.gate_base);
            break;
        }
        break;
      default:
        p.v = in.v;
        p.beta = activate_beta(in.beta, opt.beta);
    }
  });
  p.scale = opt.scale ? *opt.scale : default_scale<S>(d.K);
  return p;
}

}  // namespace k3ref::kda
