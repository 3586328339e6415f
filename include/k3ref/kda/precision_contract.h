// Precision contracts of the chunkwise KDA forms: where a kernel rounds, and to what.
//
// The chunk algorithm (kda/chunkwise.h) calls `policy.round(point, x)` at every point
// where a kernel may round: each stage tensor when it is stored, each partial sum of a
// product when the kernel accumulates in a narrow type. A policy is any type with
//
//   static constexpr bool is_identity;          // true: never rounds (the exact contract)
//   template <class S> S round(Point, const S&) const;
//
// `Exact` rounds nowhere: the algorithm is then the mathematical chunk form (and in
// double it may use Eigen's blocked products). `RoundingTable` rounds each point to a
// declared format, optionally flushing subnormal results to zero; `flashkda_contract()`
// and `fla_like_contract()` are two such tables. docs/chunkwise.md says how to declare
// a new contract. These tables round the library's own chunk algorithm; the contracts of
// the real kernels, in each kernel's own operation order and checked against kernel data,
// are kda/kernel_contracts.h (docs/contracts.md): GPU verdicts use those.
#pragma once

#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string_view>

#include "k3ref/num/float_format.h"

namespace k3ref::kda::contract {

// The declared rounding points, in the order the chunk algorithm meets them.
enum class Point {
  decay,               // cumulative decays a, their inverses 1/a, and pairwise ratios a_t / a_s
  q_decay,             // Q_decay = a ⊙ (scale q)
  k_decay,             // K_decay = a ⊙ k (FLA form: also the row operand k_t ⊙ a_t / a_anchor)
  k_inv,               // K_inv = k / a (FLA form: the column operand k_s ⊙ a_anchor / a_s)
  k_restore,           // K_restore = a_last ⊙ K_inv (FLA form: k_s ⊙ a_last / a_s)
  intra_accumulate,    // partial sums of L and M_qk (dot products over K)
  L,                   // L = StrictTril(Diag(beta) K_decay K_inv^T)
  inv_accumulate,      // partial sums inside the products of the inversion
  inv,                 // INV = (I + L)^-1, and every intermediate of the Neumann doubling
  m_qk,                // M_qk = tril(Q_decay K_inv^T)
  wu_pre,              // FLA form: W = INV Diag(beta) K_decay and U' = INV Diag(beta) V
  chunk_accumulate,    // partial sums of the per-chunk products (U, O, state update)
  u,                   // U, the pseudo-values of the chunk
  output,              // o
  state,               // the state held between chunks
};
inline constexpr std::size_t point_count = static_cast<std::size_t>(Point::state) + 1;

// RNE of a double into `format`, fast where the result is a normal number of the format
// (bit arithmetic on the double), and through num::round_to elsewhere (subnormals). Same
// result as num::round_to everywhere (tests/kda/chunkwise_test.cpp checks it).
inline double round_double(num::Format format, double x) {
  switch (format) {
    case num::Format::fp64: return x;
    case num::Format::fp32: return static_cast<double>(static_cast<float>(x));  // IEEE conversion is RNE
    default: break;
  }
  const num::FormatInfo info = num::format_info(format);
  if (x == 0 || !std::isfinite(x)) return num::round_to(format, x);
  int e = 0;
  (void)std::frexp(x, &e);                   // |x| in [2^(e-1), 2^e)
  const int min_normal_exponent = 1 - info.bias;  // exponent of the smallest normal binade
  if (e - 1 < min_normal_exponent) return num::round_to(format, x);
  const int drop = 52 - info.mantissa_bits;
  std::uint64_t bits = std::bit_cast<std::uint64_t>(x);
  const std::uint64_t half_minus_one = (std::uint64_t{1} << (drop - 1)) - 1;
  bits += half_minus_one + ((bits >> drop) & 1);  // ties to even; a carry moves into the exponent
  bits &= ~((std::uint64_t{1} << drop) - 1);
  const double r = std::bit_cast<double>(bits);
  if (std::fabs(r) > info.max_finite) return num::round_to(format, x);  // overflow rule of the format
  return r;
}

// Smallest positive normal number of a format.
inline double min_normal(num::Format format) {
  const num::FormatInfo info = num::format_info(format);
  return std::ldexp(1.0, 1 - info.bias);
}

// The contract that rounds nowhere.
struct Exact {
  static constexpr bool is_identity = true;
  template <class S>
  S round(Point, const S& x) const {
    return x;
  }
};

// A contract given as a table: for each point, the format its values are rounded to
// (none: kept in the evaluation scalar) and whether subnormal results are flushed to zero
// (as `ex2.approx.ftz.f32` does). Rounding is RNE from the value the evaluation scalar
// holds, so evaluate it in double (or higher) for a contract of formats no wider than fp32.
struct RoundingTable {
  static constexpr bool is_identity = false;
  std::array<std::optional<num::Format>, point_count> format{};
  std::array<bool, point_count> flush_subnormals{};
  const char* name = "custom";

  RoundingTable& set(Point p, num::Format f, bool ftz = false) {
    format[static_cast<std::size_t>(p)] = f;
    flush_subnormals[static_cast<std::size_t>(p)] = ftz;
    return *this;
  }

  template <class S>
  S round(Point p, const S& x) const {
    const auto& f = format[static_cast<std::size_t>(p)];
    if (!f) return x;
    S r;
    if constexpr (std::is_same_v<S, double>) {
      r = round_double(*f, x);
    } else {
      r = num::round_to(*f, x);
    }
    if (flush_subnormals[static_cast<std::size_t>(p)]) {
      using std::abs;
      if (abs(r) < S(min_normal(*f))) r = S(0);
    }
    return r;
  }
};

// FlashKDA (MoonshotAI/FlashKDA, C = 16): fp32 decays from exp2 with flush to zero;
// bf16 Q_decay, K_decay, K_restore (K_inv too: it is an MMA operand); fp16 L and INV with
// fp16 accumulation inside the Neumann products; fp32 accumulation of the chunk
// products; U a bf16 MMA operand; state bf16 between chunks, updated by an fp32 FMA; o bf16.
RoundingTable flashkda_contract();

// An FLA-like contract (chunk_kda, C = 64): fp32 decays and accumulation everywhere, bf16
// operands of the matrix products (decayed keys and queries, W, U', U), fp32 L, INV and
// state, o bf16.
RoundingTable fla_like_contract();

}  // namespace k3ref::kda::contract
