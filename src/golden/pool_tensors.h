// How the pool-based golden families (serving, gdn) store a state pool: the whole buffer as
// `pool` (F32, padding included) and its geometry as `pool_geometry`; what the padding holds.
#pragma once

#include <vector>

#include "k3ref/io/safetensors.h"
#include "k3ref/serving/pool.h"

namespace k3ref::golden {

// What a golden pool's padding (between and around slots) holds: a kernel that reads it
// produces outputs no tolerance accepts.
inline constexpr double pool_padding = 0x1p100;

inline void add_pool_tensors(io::SafetensorsFile& f, const serving::StatePool<double>& pool) {
  const auto& L = pool.layout;
  const auto size = static_cast<std::int64_t>(pool.buffer.size());
  f.tensors.emplace_back("pool", io::from_f64(Tensor<double>({size}, pool.buffer), DType::F32));
  // [slots, slot stride, offset, 1 if V-first]: the geometry for readers without the params.
  const std::vector<std::int64_t> geometry{L.slots, L.slot_stride, L.offset, L.layout == kda::StateLayout::v_first ? 1 : 0};
  f.tensors.emplace_back("pool_geometry", io::from_i64(Tensor<std::int64_t>({4}, geometry), DType::I64));
}

}  // namespace k3ref::golden
