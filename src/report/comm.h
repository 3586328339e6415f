// Byte counts of KDA context parallelism and of speculative-decoding rollback, at a
// layer's sizes (scalar-free; src/kcp/comm.cc). "MB" in the K3 report is MiB (2^20 bytes);
// ring attention's figure is decimal GB.
#pragma once

#include <cstdint>

namespace k3ref::kcp {

struct KdaLayerSizes {
  std::int64_t heads = 96;        // q/k heads (K3: linear_attn_config.num_heads = 96)
  std::int64_t value_heads = 96;  // HV (K3 has no grouping: HV = H)
  std::int64_t d_k = 128, d_v = 128;
  std::int64_t conv_width = 4;    // short convolution kernel
};

inline constexpr KdaLayerSizes k3_kda_layer{};

// One rank's fragments of one layer: per value head M (d_k x d_k) and S~ (d_k x d_v),
// H * d_k * (d_k + d_v) * bytes_per_element.
std::int64_t fragment_bytes_per_rank(const KdaLayerSizes&, std::int64_t bytes_per_element);
// All-gathered in total per layer, FLA's formula P * H * d_k * (d_k + d_v) * bytes.
std::int64_t cp_all_gather_bytes(const KdaLayerSizes&, std::int64_t ranks, std::int64_t bytes_per_element);
// Received by each rank per layer: the other P - 1 ranks' fragments. Independent of the
// sequence length.
std::int64_t cp_bytes_received_per_rank(const KdaLayerSizes&, std::int64_t ranks, std::int64_t bytes_per_element);
// Ring attention per layer and rank, forward: about 4 b S d bytes (K and V blocks, 2
// bytes each in bf16, b sequences of S tokens of model width d pass every rank).
double ring_attention_bytes_per_layer(std::int64_t batch, std::int64_t seq_len, std::int64_t d_model);

// Speculative decoding, per layer and per sequence.
struct RollbackBytes {
  std::int64_t state_bytes;        // KDA state HV * d_k * d_v * state_bytes_per_element
  std::int64_t conv_state_bytes;   // (2 H d_k + HV d_v) * (W - 1) * input bytes
  std::int64_t token_input_bytes;  // projected inputs of one token: q, k, v, g, beta
  std::int64_t snapshot_window;    // snapshot: one copy of both states per draft position, written
  std::int64_t replay_window;      // replay: the draft tokens' inputs written, the accepted ones read back
};
// `draft` tokens per window of which `accepted` are accepted; both methods also read the
// state they start from and write the state they end with, which is not counted (equal).
RollbackBytes rollback_bytes(const KdaLayerSizes&, std::int64_t draft, std::int64_t accepted,
                             std::int64_t state_bytes_per_element = 4, std::int64_t input_bytes_per_element = 2);

}  // namespace k3ref::kcp
