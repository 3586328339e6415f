#include "report/comm.h"

#include "k3ref/error.h"

namespace k3ref::kcp {
namespace {

void check(const KdaLayerSizes& s, std::int64_t bytes, const char* who) {
  if (s.heads < 1 || s.value_heads < 1 || s.d_k < 1 || s.d_v < 1 || s.conv_width < 1 || s.value_heads % s.heads != 0)
    throw InvalidArgument(std::string(who) + ": argument 'sizes': positive sizes with value_heads a multiple of heads");
  if (bytes < 1) throw InvalidArgument(std::string(who) + ": argument 'bytes_per_element': must be positive");
}

}  // namespace

std::int64_t fragment_bytes_per_rank(const KdaLayerSizes& s, std::int64_t bytes) {
  check(s, bytes, "kcp::fragment_bytes_per_rank");
  // Fragments are per value head (gates and beta are per value head).
  return s.value_heads * s.d_k * (s.d_k + s.d_v) * bytes;
}

std::int64_t cp_all_gather_bytes(const KdaLayerSizes& s, std::int64_t ranks, std::int64_t bytes) {
  if (ranks < 1) throw InvalidArgument("kcp::cp_all_gather_bytes: argument 'ranks': must be at least 1");
  return ranks * fragment_bytes_per_rank(s, bytes);
}

std::int64_t cp_bytes_received_per_rank(const KdaLayerSizes& s, std::int64_t ranks, std::int64_t bytes) {
  if (ranks < 1) throw InvalidArgument("kcp::cp_bytes_received_per_rank: argument 'ranks': must be at least 1");
  return (ranks - 1) * fragment_bytes_per_rank(s, bytes);
}

double ring_attention_bytes_per_layer(std::int64_t batch, std::int64_t seq_len, std::int64_t d_model) {
  if (batch < 1 || seq_len < 0 || d_model < 1)
    throw InvalidArgument("kcp::ring_attention_bytes_per_layer: arguments must be positive");
  return 4.0 * static_cast<double>(batch) * static_cast<double>(seq_len) * static_cast<double>(d_model);
}

RollbackBytes rollback_bytes(const KdaLayerSizes& s, std::int64_t draft, std::int64_t accepted,
                             std::int64_t state_bytes, std::int64_t input_bytes) {
  check(s, state_bytes, "kcp::rollback_bytes");
  check(s, input_bytes, "kcp::rollback_bytes");
  if (draft < 0 || accepted < 0 || accepted > draft)
    throw InvalidArgument("kcp::rollback_bytes: arguments 'draft', 'accepted': need 0 <= accepted <= draft");
  RollbackBytes b{};
  b.state_bytes = s.value_heads * s.d_k * s.d_v * state_bytes;
  b.conv_state_bytes = (2 * s.heads * s.d_k + s.value_heads * s.d_v) * (s.conv_width - 1) * input_bytes;
  // q, k (H d_k each), v (HV d_v), g (HV d_k) before the convolution and gate, beta (HV).
  b.token_input_bytes = (2 * s.heads * s.d_k + s.value_heads * s.d_v + s.value_heads * s.d_k + s.value_heads) * input_bytes;
  b.snapshot_window = draft * (b.state_bytes + b.conv_state_bytes);
  b.replay_window = (draft + accepted) * b.token_input_bytes;
  return b;
}

}  // namespace k3ref::kcp
