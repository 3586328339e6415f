// A pool of KDA state slots, as an inference engine holds it: one flat buffer, slot s
// starting `offset + s * slot_stride` elements in. Inside a slot the HV value heads follow
// each other, each a K x V (K-first) or V x K (V-first) row-major block, contiguous: that is
// the inner layout FLA's fused_recurrent_kda addresses (`slot * stride(0) + hv * K * V +
// ...`), so only the slot stride and the start are free. A slot stride above HV * K * V is a
// padded pool; a non-zero offset a misaligned one (a pool that is a view into a larger buffer).
//
// The references read a slot into the K-first [HV, K, V] form the recurrence runs on and write
// it back through the same addressing, so the layout is pure addressing and the arithmetic is
// the recurrence's, whatever the layout.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "k3ref/kda/options.h"
#include "k3ref/tensor/tensor.h"

namespace k3ref::serving {

using kda::StateLayout;

// The slot index that names no slot: the sequence (or the token) is padding. vLLM's
// PAD_SLOT_ID has the same value.
inline constexpr std::int64_t pad_slot = -1;

struct PoolLayout {
  std::int64_t slots = 0, HV = 1, K = 1, V = 1;
  std::int64_t slot_stride = 0;  // elements from one slot to the next, >= HV * K * V
  std::int64_t offset = 0;       // elements before slot 0
  StateLayout layout = StateLayout::k_first;

  std::int64_t state_elements() const { return HV * K * V; }
  // Buffer elements the layout addresses (the buffer may be longer).
  std::int64_t extent() const { return slots == 0 ? offset : offset + (slots - 1) * slot_stride + state_elements(); }
  // Buffer position of element (i, j) (i < K, j < V) of value head hv of a slot.
  std::int64_t element(std::int64_t slot, std::int64_t hv, std::int64_t i, std::int64_t j) const {
    const std::int64_t inner = layout == StateLayout::k_first ? i * V + j : j * K + i;
    return offset + slot * slot_stride + hv * K * V + inner;
  }
};

// A dense pool: slot stride HV * K * V, no offset.
PoolLayout dense_pool_layout(std::int64_t slots, std::int64_t HV, std::int64_t K, std::int64_t V,
                             StateLayout layout = StateLayout::k_first);

// Throws InvalidArgument (naming `what`) unless the sizes are positive, the slot stride holds
// a state, the offset is non-negative and a buffer of `buffer_size` elements holds every slot.
void validate_pool(const PoolLayout& layout, std::int64_t buffer_size, const std::string& what);

// Whether buffer position p belongs to some slot's state (false: padding between slots or
// before slot 0 or after the last slot).
bool inside_a_slot(const PoolLayout& layout, std::int64_t p);

template <class S>
struct StatePool {
  PoolLayout layout;
  std::vector<S> buffer;  // at least layout.extent() elements

  // A pool whose padding holds `padding` (tests poison it) and whose slots hold zero.
  static StatePool zeros(const PoolLayout& layout, const S& padding = S(0)) {
    StatePool pool{layout, std::vector<S>(static_cast<std::size_t>(layout.extent()), padding)};
    for (std::int64_t s = 0; s < layout.slots; ++s)
      for (std::int64_t e = 0; e < layout.state_elements(); ++e)
        pool.buffer[static_cast<std::size_t>(layout.offset + s * layout.slot_stride + e)] = S(0);
    return pool;
  }
};

// Slot s as a K-first [HV, K, V] tensor.
template <class S>
Tensor<S> read_slot(const StatePool<S>& pool, std::int64_t s) {
  const PoolLayout& L = pool.layout;
  Tensor<S> t({L.HV, L.K, L.V});
  for (std::int64_t hv = 0; hv < L.HV; ++hv)
    for (std::int64_t i = 0; i < L.K; ++i)
      for (std::int64_t j = 0; j < L.V; ++j) t(hv, i, j) = pool.buffer[static_cast<std::size_t>(L.element(s, hv, i, j))];
  return t;
}

// Writes a K-first [HV, K, V] tensor into slot s; nothing else of the buffer changes.
template <class S>
void write_slot(StatePool<S>& pool, std::int64_t s, const Tensor<S>& state) {
  const PoolLayout& L = pool.layout;
  if (state.shape() != Shape{L.HV, L.K, L.V})
    throw InvalidArgument("serving::write_slot: argument 'state': expected [HV, K, V] = " +
                          shape_to_string({L.HV, L.K, L.V}) + ", got " + shape_to_string(state.shape()));
  for (std::int64_t hv = 0; hv < L.HV; ++hv)
    for (std::int64_t i = 0; i < L.K; ++i)
      for (std::int64_t j = 0; j < L.V; ++j) pool.buffer[static_cast<std::size_t>(L.element(s, hv, i, j))] = state(hv, i, j);
}

// [HV, K, V] <-> [HV, V, K]: a state in the other layout (the same state).
template <class S>
Tensor<S> transpose_state(const Tensor<S>& t) {
  const std::int64_t HV = t.dim(0), A = t.dim(1), B = t.dim(2);
  Tensor<S> out({HV, B, A});
  for (std::int64_t hv = 0; hv < HV; ++hv)
    for (std::int64_t a = 0; a < A; ++a)
      for (std::int64_t b = 0; b < B; ++b) out(hv, b, a) = t(hv, a, b);
  return out;
}

}  // namespace k3ref::serving
