// The serving paths of KDA over a state pool (docs/serving.md):
//
//   continuous_batching_decode  each sequence names one slot; it enters with that slot's
//                               state, runs its tokens, and its final state is written back
//                               into the same slot. No other slot changes.
//   speculative_verify          each sequence has a row of slot indices; the accepted count
//                               of the previous step picks the entering slot (column a - 1),
//                               and the state after its t-th token is written to column t
//                               (in place) or to row bos + t of a per-token output. This is
//                               FLA fused_recurrent_kda's ssm_state_indices /
//                               num_accepted_tokens / inplace_final_state contract, with
//                               every edge FLA leaves open defined here.
//
// Both gather the entering states, run kda::recurrent_forward over the packed batch (the
// recurrence itself, not a copy of it), and scatter the results into the named slots. The
// rules on the slot tables (what is rejected, what padding means) are scalar-free and live
// in src/serving/serving.cc.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "k3ref/kda/recurrent.h"
#include "k3ref/serving/pool.h"

namespace k3ref::serving {

// Where speculative_verify stores the state after each token.
enum class StateWrites {
  in_place,          // into the pool, slot state_indices[n, t] (FLA: inplace_final_state=True)
  per_token_output,  // into row bos + t of a fresh [tokens, HV, K, V] tensor; the pool is only read
};

// Sizes of a serving call read off the inputs (scalar-free, for the validators).
struct BatchShape {
  std::int64_t N = 0;                                  // sequences
  std::vector<std::int64_t> first_token, length;       // per sequence, in flat token rows (b * T + t)
  std::int64_t tokens = 0;                             // B * T
};

// Checks the inputs and the pool of a serving call: no `initial_state` (the pool holds the
// states), the pool's HV, K, V and layout those of the inputs and options. Returns the
// sequences' token ranges.
BatchShape validate_serving_inputs(const kda::InputShapes& shapes, const PoolLayout& pool, std::int64_t buffer_size,
                                   const std::string& what);

// The decode rule: slot_of_sequence[n] is pad_slot or a slot of the pool; two sequences with
// tokens may not name the same slot (the result would depend on which one wrote last).
void validate_decode_slots(const BatchShape& batch, const PoolLayout& pool,
                           const std::vector<std::int64_t>& slot_of_sequence);

// What speculative_verify does per sequence, after the checks.
struct VerifyPlan {
  std::vector<std::int64_t> entering_slot;  // pad_slot: padded sequence (or no tokens)
};

// The verify rules (docs/serving.md, "Speculative-decoding verify"): state_indices is [N, W]
// with W >= 1, every entry pad_slot or a slot; for a sequence with tokens the accepted count
// is in [1, W] (0 names no state: FLA reads index -1 there, the last entry of the previous
// row), and in place it has at most W tokens; in place, no slot is written twice and no
// sequence writes a slot another one enters from.
VerifyPlan plan_verify(const BatchShape& batch, const PoolLayout& pool, const Tensor<std::int64_t>& state_indices,
                       const std::vector<std::int64_t>& num_accepted, StateWrites writes);

namespace detail {

template <class S>
kda::Options<S> k_first_options(const kda::Options<S>& opt) {
  kda::Options<S> o = opt;
  o.state_layout = StateLayout::k_first;
  return o;
}

// Entering states [N, HV, K, V] (K-first) from the named slots; zero for pad_slot.
template <class S>
Tensor<S> gather_states(const StatePool<S>& pool, const std::vector<std::int64_t>& slots) {
  const PoolLayout& L = pool.layout;
  Tensor<S> states({static_cast<std::int64_t>(slots.size()), L.HV, L.K, L.V});
  for (std::size_t n = 0; n < slots.size(); ++n) {
    if (slots[n] == pad_slot) continue;
    const Tensor<S> s = read_slot(pool, slots[n]);
    std::copy(s.values().begin(), s.values().end(), states.data() + states.offset(static_cast<std::int64_t>(n), 0, 0, 0));
  }
  return states;
}

template <class S>
Tensor<S> state_at(const Tensor<S>& stacked, std::int64_t row) {
  const std::int64_t size = stacked.numel() / stacked.dim(0);
  const S* first = stacked.data() + row * size;
  Shape shape(stacked.shape().begin() + 1, stacked.shape().end());
  return Tensor<S>(shape, std::vector<S>(first, first + size));
}

// The packed inputs with the gathered entering states.
template <class S>
kda::Inputs<S> with_entering_states(const kda::Inputs<S>& in, Tensor<S> states) {
  kda::Inputs<S> run = in;
  run.initial_state = std::move(states);
  return run;
}

// Zeroes the outputs of padded sequences.
template <class S>
void zero_padded_outputs(Tensor<S>& o, const BatchShape& batch, const std::vector<std::int64_t>& slots) {
  const std::int64_t row = o.dim(2) * o.dim(3);
  for (std::int64_t n = 0; n < batch.N; ++n)
    if (slots[static_cast<std::size_t>(n)] == pad_slot)
      std::fill(o.data() + batch.first_token[n] * row, o.data() + (batch.first_token[n] + batch.length[n]) * row, S(0));
}

}  // namespace detail

// Continuous-batching decode over a pool. Sequence n enters with slot slot_of_sequence[n],
// runs its tokens (one in decode, any number in a chunked prefill) and its final state is
// written back into that slot. A sequence without tokens reads and writes nothing; a padded
// sequence (pad_slot) reads and writes nothing and its outputs are zero. Returns o
// [B, T, HV, V]. `opt.state_layout` must be the pool's layout.
template <class S>
Tensor<S> continuous_batching_decode(const kda::Inputs<S>& in, const kda::Options<S>& opt, StatePool<S>& pool,
                                     const std::vector<std::int64_t>& slot_of_sequence) {
  const auto shapes = kda::shapes_of(in, opt);
  const BatchShape batch = validate_serving_inputs(shapes, pool.layout, static_cast<std::int64_t>(pool.buffer.size()),
                                                   "serving::continuous_batching_decode");
  validate_decode_slots(batch, pool.layout, slot_of_sequence);
  std::vector<std::int64_t> entering = slot_of_sequence;
  for (std::int64_t n = 0; n < batch.N; ++n)
    if (batch.length[n] == 0) entering[n] = pad_slot;  // not read
  kda::Options<S> run_opt = detail::k_first_options(opt);
  run_opt.output_final_state = true;
  run_opt.output_all_states = false;
  kda::Outputs<S> out = kda::recurrent_forward(detail::with_entering_states(in, detail::gather_states(pool, entering)), run_opt);
  detail::zero_padded_outputs(out.o, batch, entering);
  for (std::int64_t n = 0; n < batch.N; ++n)
    if (entering[n] != pad_slot) write_slot(pool, entering[n], detail::state_at(*out.final_state, n));
  return out.o;
}

template <class S>
struct VerifyOutputs {
  Tensor<S> o;                          // [B, T, HV, V]
  std::optional<Tensor<S>> token_states;  // per_token_output: [B * T, HV, K, V] (or V-first), row bos + t
};

// Speculative-decoding verify over a pool (FLA fused_recurrent_kda with ssm_state_indices and
// num_accepted_tokens). Sequence n enters with slot state_indices[n, num_accepted[n] - 1]
// and runs its tokens (the draft window); the state after its t-th token goes to slot
// state_indices[n, t] (in_place; a pad_slot entry there stores nothing) or to row bos + t
// of token_states (per_token_output; the pool is then only read). A sequence whose entering
// entry is pad_slot is padding: nothing read or written, outputs zero (and zero rows in
// token_states). A sequence without tokens reads and writes nothing; its accepted count is
// not read. `opt.state_layout` must be the pool's layout.
template <class S>
VerifyOutputs<S> speculative_verify(const kda::Inputs<S>& in, const kda::Options<S>& opt, StatePool<S>& pool,
                                    const Tensor<std::int64_t>& state_indices, const std::vector<std::int64_t>& num_accepted,
                                    StateWrites writes = StateWrites::in_place) {
  const auto shapes = kda::shapes_of(in, opt);
  const BatchShape batch = validate_serving_inputs(shapes, pool.layout, static_cast<std::int64_t>(pool.buffer.size()),
                                                   "serving::speculative_verify");
  const VerifyPlan plan = plan_verify(batch, pool.layout, state_indices, num_accepted, writes);
  kda::Options<S> run_opt = detail::k_first_options(opt);
  run_opt.output_final_state = false;
  run_opt.output_all_states = true;
  kda::Outputs<S> out =
      kda::recurrent_forward(detail::with_entering_states(in, detail::gather_states(pool, plan.entering_slot)), run_opt);
  detail::zero_padded_outputs(out.o, batch, plan.entering_slot);
  const PoolLayout& L = pool.layout;
  // all_states is [B, T, HV, K, V]: flat token row r is state_at(all_states viewed as [B*T, ...], r).
  const Tensor<S> per_token({batch.tokens, L.HV, L.K, L.V}, std::move(out.all_states->values()));
  VerifyOutputs<S> result{std::move(out.o), std::nullopt};
  if (writes == StateWrites::per_token_output) {
    Shape shape{batch.tokens, L.HV, L.K, L.V};
    if (L.layout == StateLayout::v_first) shape = {batch.tokens, L.HV, L.V, L.K};
    result.token_states = Tensor<S>(shape);
  }
  for (std::int64_t n = 0; n < batch.N; ++n) {
    if (plan.entering_slot[n] == pad_slot) continue;
    for (std::int64_t t = 0; t < batch.length[n]; ++t) {
      const std::int64_t row = batch.first_token[n] + t;
      const Tensor<S> state = detail::state_at(per_token, row);
      if (writes == StateWrites::in_place) {
        const std::int64_t slot = state_indices(n, t);
        if (slot != pad_slot) write_slot(pool, slot, state);
      } else {
        const Tensor<S> stored = L.layout == StateLayout::v_first ? transpose_state(state) : state;
        std::copy(stored.values().begin(), stored.values().end(),
                  result.token_states->data() + result.token_states->offset(row, 0, 0, 0));
      }
    }
  }
  return result;
}

}  // namespace k3ref::serving
