// State checkpoints of one sequence: the KDA state after the first b tokens, at chunk, page
// or hash-block boundaries (and their off-by-one neighbours, which a correct checkpoint must
// differ from); resuming from a checkpoint; a prefill split at any point followed by
// token-by-token decode through a pool. All of it is kda::recurrent_forward over slices of
// the sequence, so "resume == single shot" and "split prefill + decode == single shot" are
// exact statements in rational arithmetic (tests/serving/serving_test.cpp).
#pragma once

#include <type_traits>
#include <vector>

#include "k3ref/kda/recurrent.h"
#include "k3ref/serving/decode.h"

namespace k3ref::serving {

// b = block, 2 block, ... <= T: the boundaries a cache with that block size checkpoints.
std::vector<std::int64_t> block_boundaries(std::int64_t T, std::int64_t block);
// Every boundary with its neighbours b - 1 and b + 1 inside [0, T], sorted, without repeats.
std::vector<std::int64_t> with_neighbours(const std::vector<std::int64_t>& boundaries, std::int64_t T);

namespace detail {

inline void require_one_sequence(const kda::Dims& d, bool varlen, const char* what) {
  if (d.N != 1 || d.B != 1 || varlen)
    throw InvalidArgument(std::string(what) + ": argument 'in': expected one sequence (B = 1, no cu_seqlens), got " +
                          std::to_string(d.N) + " sequences");
}

// Tokens [from, to) of a [1, T, ...] tensor.
template <class S>
Tensor<S> token_slice(const Tensor<S>& t, std::int64_t from, std::int64_t to) {
  Shape shape = t.shape();
  const std::int64_t row = t.numel() / (shape[1] == 0 ? 1 : shape[1]);
  shape[1] = to - from;
  if (t.numel() == 0) return Tensor<S>(shape);
  return Tensor<S>(shape, std::vector<S>(t.data() + from * row, t.data() + to * row));
}

}  // namespace detail

// The inputs of tokens [from, to) of one sequence, entering with `state` ([1, HV, K, V] in
// the options' layout; absent: zero).
template <class S>
kda::Inputs<S> token_range(const kda::Inputs<S>& in, std::int64_t from, std::int64_t to,
                            std::type_identity_t<std::optional<Tensor<S>>> state) {
  kda::Inputs<S> r = in;
  r.q = detail::token_slice(in.q, from, to);
  r.k = detail::token_slice(in.k, from, to);
  r.v = detail::token_slice(in.v, from, to);
  r.g = detail::token_slice(in.g, from, to);
  r.beta = detail::token_slice(in.beta, from, to);
  r.initial_state = std::move(state);
  return r;
}

// The state after the first b tokens for each b in `boundaries` (each in [0, T]), as
// [HV, K, V] in the options' layout; b = 0 is the initial state (zero when absent).
template <class S>
std::vector<Tensor<S>> checkpoints(const kda::Inputs<S>& in, const kda::Options<S>& opt,
                                   const std::vector<std::int64_t>& boundaries) {
  const kda::Dims d = kda::validate(kda::shapes_of(in, opt));
  detail::require_one_sequence(d, in.cu_seqlens.has_value(), "serving::checkpoints");
  kda::Options<S> all = opt;
  all.output_all_states = true;
  all.output_final_state = false;
  const kda::Outputs<S> out = kda::recurrent_forward(in, all);
  const bool v_first = opt.state_layout == StateLayout::v_first;
  const Shape state_shape = v_first ? Shape{d.HV, d.V, d.K} : Shape{d.HV, d.K, d.V};
  std::vector<Tensor<S>> states;
  for (std::int64_t b : boundaries) {
    if (b < 0 || b > d.T)
      throw InvalidArgument("serving::checkpoints: argument 'boundaries': " + std::to_string(b) + " is outside [0, T = " +
                            std::to_string(d.T) + "]");
    if (b == 0) {
      states.push_back(in.initial_state ? Tensor<S>(state_shape, in.initial_state->values()) : Tensor<S>(state_shape));
      continue;
    }
    const std::int64_t size = d.HV * d.K * d.V;
    const S* first = out.all_states->data() + (b - 1) * size;
    states.emplace_back(state_shape, std::vector<S>(first, first + size));
  }
  return states;
}

// Tokens [b, T) run from `checkpoint` (the state after b tokens, [HV, K, V] in the options'
// layout): outputs [1, T - b, HV, V] and the final state.
template <class S>
kda::Outputs<S> resume(const kda::Inputs<S>& in, const kda::Options<S>& opt, std::int64_t b, const Tensor<S>& checkpoint) {
  const kda::Dims d = kda::validate(kda::shapes_of(in, opt));
  detail::require_one_sequence(d, in.cu_seqlens.has_value(), "serving::resume");
  if (b < 0 || b > d.T)
    throw InvalidArgument("serving::resume: argument 'b': " + std::to_string(b) + " is outside [0, T = " + std::to_string(d.T) + "]");
  Shape shape{1};
  shape.insert(shape.end(), checkpoint.shape().begin(), checkpoint.shape().end());
  kda::Options<S> run = opt;
  run.output_final_state = true;
  return kda::recurrent_forward(token_range(in, b, d.T, Tensor<S>(shape, checkpoint.values())), run);
}

// Tokens [0, split) prefilled in one call, the state parked in slot 0 of a one-slot pool in
// the options' layout, then tokens [split, T) decoded one at a time by
// continuous_batching_decode. Outputs [1, T, HV, V] and the final state, as one call gives.
template <class S>
kda::Outputs<S> prefill_then_decode(const kda::Inputs<S>& in, const kda::Options<S>& opt, std::int64_t split) {
  const kda::Dims d = kda::validate(kda::shapes_of(in, opt));
  detail::require_one_sequence(d, in.cu_seqlens.has_value(), "serving::prefill_then_decode");
  if (split < 0 || split > d.T)
    throw InvalidArgument("serving::prefill_then_decode: argument 'split': " + std::to_string(split) +
                          " is outside [0, T = " + std::to_string(d.T) + "]");
  kda::Options<S> run = opt;
  run.output_final_state = true;
  run.output_all_states = false;
  const kda::Outputs<S> pre = kda::recurrent_forward(token_range(in, 0, split, in.initial_state), run);
  StatePool<S> pool{dense_pool_layout(1, d.HV, d.K, d.V, opt.state_layout), pre.final_state->values()};
  kda::Outputs<S> out;
  out.o = Tensor<S>({1, d.T, d.HV, d.V});
  std::copy(pre.o.values().begin(), pre.o.values().end(), out.o.data());
  for (std::int64_t t = split; t < d.T; ++t) {
    const Tensor<S> o = continuous_batching_decode(token_range(in, t, t + 1, std::nullopt), opt, pool, {0});
    std::copy(o.values().begin(), o.values().end(), out.o.data() + out.o.offset(0, t, 0, 0));
  }
  const bool v_first = opt.state_layout == StateLayout::v_first;
  out.final_state = Tensor<S>(v_first ? Shape{1, d.HV, d.V, d.K} : Shape{1, d.HV, d.K, d.V}, pool.buffer);
  return out;
}

}  // namespace k3ref::serving
