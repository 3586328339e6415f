// The scalar-free rules of the serving references: pool layouts and slot tables.
#include <algorithm>
#include <map>
#include <string>

#include "k3ref/serving/checkpoint.h"
#include "k3ref/serving/decode.h"
#include "k3ref/serving/pool.h"

namespace k3ref::serving {
namespace {

std::string str(std::int64_t x) { return std::to_string(x); }

bool in_pool(const PoolLayout& pool, std::int64_t slot) { return slot >= 0 && slot < pool.slots; }

}  // namespace

PoolLayout dense_pool_layout(std::int64_t slots, std::int64_t HV, std::int64_t K, std::int64_t V, StateLayout layout) {
  return PoolLayout{slots, HV, K, V, HV * K * V, 0, layout};
}

void validate_pool(const PoolLayout& L, std::int64_t buffer_size, const std::string& what) {
  const std::string p = what + ": argument 'pool': ";
  if (L.slots < 0) throw InvalidArgument(p + "negative slot count " + str(L.slots));
  if (L.HV <= 0 || L.K <= 0 || L.V <= 0)
    throw InvalidArgument(p + "HV, K and V must be positive, got " + shape_to_string({L.HV, L.K, L.V}));
  checked_numel({L.HV, L.K, L.V}, p + "state");
  if (L.slot_stride < L.state_elements())
    throw InvalidArgument(p + "slot stride " + str(L.slot_stride) + " is smaller than a state (HV * K * V = " +
                          str(L.state_elements()) + ")");
  if (L.offset < 0) throw InvalidArgument(p + "negative offset " + str(L.offset));
  checked_numel({L.slots, L.slot_stride}, p + "extent");
  if (buffer_size < L.extent())
    throw InvalidArgument(p + "buffer has " + str(buffer_size) + " elements, the layout addresses " + str(L.extent()));
}

bool inside_a_slot(const PoolLayout& L, std::int64_t p) {
  if (p < L.offset || L.slots == 0) return false;
  const std::int64_t slot = (p - L.offset) / L.slot_stride, within = (p - L.offset) % L.slot_stride;
  return slot < L.slots && within < L.state_elements();
}

BatchShape validate_serving_inputs(const kda::InputShapes& shapes, const PoolLayout& pool, std::int64_t buffer_size,
                                   const std::string& what) {
  if (shapes.initial_state)
    throw InvalidArgument(what + ": argument 'initial_state': must be absent (the entering states come from the pool)");
  const kda::Dims d = kda::validate(shapes);
  validate_pool(pool, buffer_size, what);
  if (pool.HV != d.HV || pool.K != d.K || pool.V != d.V)
    throw InvalidArgument(what + ": argument 'pool': slots hold [HV, K, V] = " + shape_to_string({pool.HV, pool.K, pool.V}) +
                          ", the inputs need " + shape_to_string({d.HV, d.K, d.V}));
  if (pool.layout != shapes.state_layout)
    throw InvalidArgument(what + ": argument 'options': state_layout " + std::string(kda::to_string(shapes.state_layout)) +
                          " differs from the pool's layout " + std::string(kda::to_string(pool.layout)));
  BatchShape b;
  b.N = d.N;
  b.tokens = d.B * d.T;
  for (std::int64_t n = 0; n < d.N; ++n) {
    b.first_token.push_back(d.seq_batch[n] * d.T + d.seq_begin[n]);
    b.length.push_back(d.seq_end[n] - d.seq_begin[n]);
  }
  return b;
}

void validate_decode_slots(const BatchShape& batch, const PoolLayout& pool, const std::vector<std::int64_t>& slot_of_sequence) {
  const std::string p = "serving::continuous_batching_decode: argument 'slot_of_sequence': ";
  if (static_cast<std::int64_t>(slot_of_sequence.size()) != batch.N)
    throw InvalidArgument(p + "has " + str(static_cast<std::int64_t>(slot_of_sequence.size())) + " entries for " +
                          str(batch.N) + " sequences");
  std::map<std::int64_t, std::int64_t> owner;
  for (std::int64_t n = 0; n < batch.N; ++n) {
    const std::int64_t s = slot_of_sequence[static_cast<std::size_t>(n)];
    if (s != pad_slot && !in_pool(pool, s))
      throw InvalidArgument(p + "entry " + str(n) + " = " + str(s) + " is neither a slot in [0, " + str(pool.slots) +
                            ") nor pad_slot (-1)");
    if (s == pad_slot || batch.length[n] == 0) continue;
    const auto [it, fresh] = owner.emplace(s, n);
    if (!fresh)
      throw InvalidArgument(p + "slot " + str(s) + " is named by sequences " + str(it->second) + " and " + str(n) +
                            ", which both have tokens");
  }
}

VerifyPlan plan_verify(const BatchShape& batch, const PoolLayout& pool, const Tensor<std::int64_t>& idx,
                       const std::vector<std::int64_t>& num_accepted, StateWrites writes) {
  const std::string w = "serving::speculative_verify: ";
  if (idx.rank() != 2 || idx.dim(0) != batch.N || idx.dim(1) < 1)
    throw InvalidArgument(w + "argument 'state_indices': expected [N, W] with N = " + str(batch.N) + " and W >= 1, got " +
                          shape_to_string(idx.shape()));
  const std::int64_t W = idx.dim(1);
  if (static_cast<std::int64_t>(num_accepted.size()) != batch.N)
    throw InvalidArgument(w + "argument 'num_accepted': has " + str(static_cast<std::int64_t>(num_accepted.size())) +
                          " entries for " + str(batch.N) + " sequences");
  for (std::int64_t n = 0; n < batch.N; ++n)
    for (std::int64_t c = 0; c < W; ++c) {
      const std::int64_t s = idx(n, c);
      if (s != pad_slot && !in_pool(pool, s))
        throw InvalidArgument(w + "argument 'state_indices': entry [" + str(n) + ", " + str(c) + "] = " + str(s) +
                              " is neither a slot in [0, " + str(pool.slots) + ") nor pad_slot (-1)");
    }
  VerifyPlan plan;
  plan.entering_slot.assign(static_cast<std::size_t>(batch.N), pad_slot);
  for (std::int64_t n = 0; n < batch.N; ++n) {
    if (batch.length[n] == 0) continue;  // nothing read: the accepted count is not looked at
    const std::int64_t a = num_accepted[static_cast<std::size_t>(n)];
    if (a == 0)
      throw InvalidArgument(w + "argument 'num_accepted': entry " + str(n) +
                            " is 0, which names no entering state (column a - 1 = -1; FLA reads the previous row's "
                            "last entry there); the accepted count includes the always-accepted first token, so it is "
                            "in [1, W]");
    if (a < 0 || a > W)
      throw InvalidArgument(w + "argument 'num_accepted': entry " + str(n) + " = " + str(a) + " is outside [1, W = " +
                            str(W) + "]");
    if (writes == StateWrites::in_place && batch.length[n] > W)
      throw InvalidArgument(w + "sequence " + str(n) + " has " + str(batch.length[n]) + " tokens but its row of " +
                            "'state_indices' has W = " + str(W) + " columns, one per token's state");
    plan.entering_slot[static_cast<std::size_t>(n)] = idx(n, a - 1);
  }
  if (writes != StateWrites::in_place) return plan;
  std::map<std::int64_t, std::pair<std::int64_t, std::int64_t>> writer;  // slot -> (sequence, token)
  for (std::int64_t n = 0; n < batch.N; ++n) {
    if (plan.entering_slot[static_cast<std::size_t>(n)] == pad_slot) continue;
    for (std::int64_t t = 0; t < batch.length[n]; ++t) {
      const std::int64_t s = idx(n, t);
      if (s == pad_slot) continue;
      const auto [it, fresh] = writer.emplace(s, std::pair{n, t});
      if (!fresh)
        throw InvalidArgument(w + "argument 'state_indices': slot " + str(s) + " is written twice (sequence " +
                              str(it->second.first) + " token " + str(it->second.second) + ", sequence " + str(n) +
                              " token " + str(t) + ")");
    }
  }
  for (std::int64_t n = 0; n < batch.N; ++n) {
    const std::int64_t e = plan.entering_slot[static_cast<std::size_t>(n)];
    if (e == pad_slot) continue;
    const auto it = writer.find(e);
    if (it != writer.end() && it->second.first != n)
      throw InvalidArgument(w + "argument 'state_indices': sequence " + str(n) + " enters from slot " + str(e) +
                            ", which sequence " + str(it->second.first) + " writes (the result would depend on the order)");
  }
  return plan;
}

std::vector<std::int64_t> block_boundaries(std::int64_t T, std::int64_t block) {
  if (block <= 0) throw InvalidArgument("serving::block_boundaries: argument 'block': must be positive, got " + str(block));
  if (T < 0) throw InvalidArgument("serving::block_boundaries: argument 'T': negative, got " + str(T));
  std::vector<std::int64_t> b;
  for (std::int64_t x = block; x <= T; x += block) b.push_back(x);
  return b;
}

std::vector<std::int64_t> with_neighbours(const std::vector<std::int64_t>& boundaries, std::int64_t T) {
  std::vector<std::int64_t> out;
  for (std::int64_t b : boundaries)
    for (std::int64_t x : {b - 1, b, b + 1})
      if (x >= 0 && x <= T) out.push_back(x);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

}  // namespace k3ref::serving
