// The K3 cost models as calculators (docs/cost-models.md): KDA decode and FlashKDA prefill
// per head, and the MoE communication-to-computation ratio of expert parallelism.
//
//   decode, per head and token:        7 D^2 FLOP, 8 D^2 bytes (the fp32 state read and written)
//   FlashKDA prefill, per chunk of C:  12 C^3 + 8 C^2 D + 6 C D^2 FLOP, 8 C^2 + 22 C D bytes,
//                                      plus 8 D^2 bytes of state per kernel; linear in T
//   MoE, uniform routing:              T_comm / T_comp = (P F) / (6 m B) (1 - 1/E)
//
// Every formula is a template over the scalar, so that the tests compare it with == in
// num::rational against what the references count while they run (cost/counting.h) and
// against a direct simulation of the dispatch (moe_dispatch below).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "k3ref/error.h"
#include "k3ref/tensor/tensor.h"

namespace k3ref::cost {

template <class S>
struct Work {
  S flops = S(0);
  S bytes = S(0);
  S intensity() const { return flops / bytes; }  // FLOP per byte
};

// One decode step of one head (state D x D): decay 1, S^T k 2, rank-one update 2, read 2
// (multiply-adds count 2).
template <class S>
Work<S> decode_per_head(std::int64_t D) {
  const S d(D);
  return {S(7) * d * d, S(8) * d * d};
}

// One chunk of C tokens of FlashKDA's prefill, one head: the Neumann inverse (three doubling
// steps at C = 16, two C x C products each: 12 C^3), the chunk products L, M_qk, INV (V - K_decay
// S), M_qk U (8 C^2 D) and the state products K_decay S, Q_decay S, K_restore^T U (6 C D^2).
// Bytes: the 2-byte tensors the two kernels exchange (22 C D: q, k, g read and q_decay,
// k_decay, k_restore written by the first; those three, v read and o written by the second)
// and INV and M_qk written and read (8 C^2).
template <class S>
Work<S> flashkda_chunk_per_head(std::int64_t C, std::int64_t D) {
  const S c(C), d(D);
  return {S(12) * c * c * c + S(8) * c * c * d + S(6) * c * d * d, S(8) * c * c + S(22) * c * d};
}

// A prefill of T tokens, one head: ceil(T / C) chunks and the state (D x D fp32, read and
// written: 8 D^2) once per kernel.
template <class S>
Work<S> flashkda_prefill_per_head(std::int64_t T, std::int64_t C, std::int64_t D, std::int64_t kernels = 2) {
  if (T < 0 || C < 1 || D < 1 || kernels < 0) throw InvalidArgument("cost::flashkda_prefill_per_head: T >= 0, C >= 1, D >= 1");
  const S chunks((T + C - 1) / C), d(D);
  const Work<S> one = flashkda_chunk_per_head<S>(C, D);
  return {chunks * one.flops, chunks * one.bytes + S(8) * S(kernels) * d * d};
}

// Expert parallelism over E GPUs, m the expert intermediate size, P bytes per element, F
// FLOP/s and B bytes/s of a GPU. Under uniform routing a GPU receives t K / E routes of
// width d, a share 1 / E of them from itself, and computes 6 d m FLOP per route (SwiGLU's
// three products), so d and t cancel.
template <class S>
S moe_comm_comp_ratio_uniform(const S& P, const S& F, const S& m, const S& B, const S& E) {
  return P * F / (S(6) * m * B) * (S(1) - S(1) / E);
}

// A dispatch, counted: token i sits on GPU source_gpu[i], expert j on GPU j / (n / E).
struct DispatchCounts {
  std::vector<std::int64_t> routes_in;   // [E] routes each GPU computes
  std::vector<std::int64_t> remote_in;   // [E] of them, those from another GPU
  std::vector<std::int64_t> remote_out;  // [E] routes each GPU sends to another GPU
};

inline DispatchCounts moe_dispatch(const Tensor<std::int32_t>& selection, std::int64_t experts, std::int64_t gpus,
                                   const std::vector<std::int64_t>& source_gpu) {
  if (gpus < 1 || experts % gpus != 0) throw InvalidArgument("cost::moe_dispatch: the GPUs must divide the experts");
  if (selection.rank() != 2 || static_cast<std::int64_t>(source_gpu.size()) != selection.dim(0))
    throw InvalidArgument("cost::moe_dispatch: selection must be [tokens, k] with one source GPU per token");
  DispatchCounts c{std::vector<std::int64_t>(gpus, 0), std::vector<std::int64_t>(gpus, 0), std::vector<std::int64_t>(gpus, 0)};
  const std::int64_t per_gpu = experts / gpus;
  for (std::int64_t i = 0; i < selection.dim(0); ++i)
    for (std::int64_t r = 0; r < selection.dim(1); ++r) {
      const std::int64_t j = selection(i, r);
      if (j < 0 || j >= experts) throw InvalidArgument("cost::moe_dispatch: expert index " + std::to_string(j) + " out of range");
      const std::int64_t dst = j / per_gpu, src = source_gpu[i];
      ++c.routes_in[dst];
      if (dst != src) {
        ++c.remote_in[dst];
        ++c.remote_out[src];
      }
    }
  return c;
}

// T_comm / T_comp of a counted dispatch, at the busiest GPU of each: (max remote routes
// received) d P / B over (max routes computed) 6 d m / F. Equals the uniform formula when
// every GPU computes t K / E routes of which a share 1 / E is local.
template <class S>
S moe_comm_comp_ratio(const DispatchCounts& c, const S& P, const S& F, const S& m, const S& B) {
  const S remote(*std::max_element(c.remote_in.begin(), c.remote_in.end()));
  const S routes(*std::max_element(c.routes_in.begin(), c.routes_in.end()));
  if (routes == S(0)) throw InvalidArgument("cost::moe_comm_comp_ratio: no route computed");
  return (remote * P / B) / (routes * S(6) * m / F);
}

// A uniform routing, exactly: t = E n c tokens, token i on GPU i mod E with experts
// (floor(i / E) K + r) mod n, r < K. Each GPU then sends every expert c K routes: every
// GPU computes t K / E routes and a share 1 / E of them is its own.
inline Tensor<std::int32_t> uniform_selection(std::int64_t experts, std::int64_t gpus, std::int64_t k, std::int64_t repeats,
                                              std::vector<std::int64_t>& source_gpu) {
  const std::int64_t t = gpus * experts * repeats;
  Tensor<std::int32_t> sel({t, k});
  source_gpu.assign(static_cast<std::size_t>(t), 0);
  for (std::int64_t i = 0; i < t; ++i) {
    source_gpu[i] = i % gpus;
    for (std::int64_t r = 0; r < k; ++r) sel(i, r) = static_cast<std::int32_t>(((i / gpus) * k + r) % experts);
  }
  return sel;
}

// Tokens spread over the GPUs in contiguous blocks, as a data-parallel batch is.
inline std::vector<std::int64_t> block_sources(std::int64_t tokens, std::int64_t gpus) {
  std::vector<std::int64_t> src(static_cast<std::size_t>(tokens));
  for (std::int64_t i = 0; i < tokens; ++i) src[i] = i * gpus / tokens;
  return src;
}

}  // namespace k3ref::cost
