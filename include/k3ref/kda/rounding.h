// The rounding vocabulary of the chunkwise KDA forms: the sites where a kernel may round,
// the precisions it rounds to, and the policy type the chunk algorithm (kda/chunkwise.h)
// calls at every site. One vocabulary serves the exact forms and every kernel contract
// (kda/kernel_contracts.h): a contract is a policy of the one chunk algorithm.
//
// A policy is any type with
//
//   static constexpr bool is_identity;          // true: never rounds (the exact chunk form)
//   template <class S> S round(Site, const S&) const;
//
// `Exact` rounds nowhere: the algorithm is then the mathematical chunk form (and in double
// it may use Eigen's blocked products). `RoundingPolicy` rounds each site to a declared
// precision, round to nearest even from the value the evaluation scalar holds (evaluate it in
// double or higher for precisions no wider than fp32), the decays optionally flushed to zero
// below fp32's smallest normal (as `ex2.approx.ftz.f32` does).
#pragma once

#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string_view>
#include <type_traits>

#include "k3ref/num/float_format.h"
#include "k3ref/num/scalar.h"
#include "k3ref/vocabulary.h"

namespace k3ref::kda::contract {

// The rounding sites, in the order a chunk meets them; what each is, the table `sites` says.
// Both chunk forms meet most of them; some belong to one form (named in their meaning).
enum class Site {
  input, scale, decay, decay_operand, intra_operand, intra_accumulate, aqk, akk, beta_l, L, inv_accumulate,
  inv, inv_operand, inv_store, k_beta, w_operand, w, u_pre, q_decay, k_decay, k_inv, k_restore,
  state_operand, state_product, u_input, beta_u, u, chunk_accumulate, output, state,
};
inline constexpr std::size_t site_count = static_cast<std::size_t>(Site::state) + 1;
inline constexpr Choices<Site, site_count> sites{"sites", {{
     {Site::input, "input", "q, k (after the L2 norm), v as the kernel holds them"},
     {Site::scale, "scale", "the scale factor itself (FlashKDA: bf16)"},
     {Site::decay, "decay", "cumulative decays, their inverses and decay ratios (FlashKDA flushes subnormals)"},
     {Site::decay_operand, "decay_operand", "FlashKDA form: the decays rounded again to be multiplied into k and q"},
     {Site::intra_operand, "intra_operand", "FLA form: operands of the intra-chunk products (k, q times a decay ratio)"},
     {Site::intra_accumulate, "intra_accumulate", "partial sums of the intra-chunk products (M_qk, and K_decay K_inv^T or its ratio form)"},
     {Site::aqk, "aqk", "M_qk = tril(Q_decay K_inv^T) as stored (FLA Aqk)"},
     {Site::akk, "akk", "the k-k products as stored (FlashKDA: before beta; FLA: with beta)"},
     {Site::beta_l, "beta_l", "FlashKDA form: beta as it multiplies the k-k products"},
     {Site::L, "L", "L = StrictTril(Diag(beta) K_decay K_inv^T)"},
     {Site::inv_accumulate, "inv_accumulate", "partial sums inside the inversion's products"},
     {Site::inv, "inv", "every intermediate of the inversion"},
     {Site::inv_operand, "inv_operand", "FLA form: operands of the products that merge the sub-chunks' inverses"},
     {Site::inv_store, "inv_store", "INV = (I + L)^-1 as stored for the later products"},
     {Site::k_beta, "k_beta", "FLA form: k * beta and v * beta"},
     {Site::w_operand, "w_operand", "FLA form: (k beta) * decay, the operand of W"},
     {Site::w, "w", "FLA form: W = INV Diag(beta) K_decay, stored"},
     {Site::u_pre, "u_pre", "FLA form: U' = INV Diag(beta) V, stored"},
     {Site::q_decay, "q_decay", "Q_decay = q * decay (FlashKDA form: also its product with the scale)"},
     {Site::k_decay, "k_decay", "K_decay = k * decay"},
     {Site::k_inv, "k_inv", "FlashKDA form: K_inv = k / decay"},
     {Site::k_restore, "k_restore", "K_restore = k * (a_last / a_t)"},
     {Site::state_operand, "state_operand", "FLA form: the state where it is an operand of a product"},
     {Site::state_product, "state_product", "FlashKDA form: K_decay S and Q_decay S as stored"},
     {Site::u_input, "u_input", "FlashKDA form: v - K_decay S, and its product with beta"},
     {Site::beta_u, "beta_u", "FlashKDA form: beta as it multiplies v - K_decay S"},
     {Site::u, "u", "the pseudo-values U (FLA v_new)"},
     {Site::chunk_accumulate, "chunk_accumulate", "partial sums of the per-chunk products (U, O, state update)"},
     {Site::output, "output", "o (and FlashKDA's two partial outputs)"},
     {Site::state, "state", "the state held between chunks"}}}};
inline std::string_view to_string(Site s) { return sites.name(s); }
inline std::optional<Site> site_from_string(std::string_view name) { return sites.find(name); }

// What a value is rounded to at a site. tf32: fp32's range, 10 stored mantissa bits, to
// nearest (tf32_rz: toward zero, the 13 low bits of an fp32 operand dropped).
enum class Precision { exact, fp32, tf32, tf32_rz, fp16, bf16 };
inline constexpr Choices<Precision, 6> precisions{"sites",
                                                  {{{Precision::exact, "exact", "not rounded"},
                                                    {Precision::fp32, "fp32", ""},
                                                    {Precision::tf32, "tf32", ""},
                                                    {Precision::tf32_rz, "tf32_rz", "tf32 toward zero"},
                                                    {Precision::fp16, "fp16", ""},
                                                    {Precision::bf16, "bf16", ""}}}};
inline std::string_view to_string(Precision p) { return precisions.name(p); }

// RNE of a double into `format`, fast where the result is a normal number of the format
// (bit arithmetic on the double), and through num::round_to elsewhere (subnormals). Same
// result as num::round_to everywhere (tests/kda/rounding_test.cpp checks it).
double round_double(num::Format format, double x);

// RNE of a double to tf32 (fp32's exponent range, 10 mantissa bits) through fp32;
// `toward_zero`: the 13 low bits of the fp32 value dropped instead.
double round_tf32(double x, bool toward_zero = false);

// Smallest positive normal number of a format.
inline double min_normal(num::Format format) { return std::ldexp(1.0, 1 - num::format_info(format).bias); }

// x rounded to `p` in the scalar S.
template <class S>
S round_to(Precision p, const S& x) {
  if (p == Precision::exact) return x;
  if constexpr (std::is_same_v<S, double>) {
    switch (p) {
      case Precision::fp32: return static_cast<double>(static_cast<float>(x));  // IEEE conversion is RNE
      case Precision::tf32: return round_tf32(x);
      case Precision::tf32_rz: return round_tf32(x, true);
      case Precision::fp16: return round_double(num::Format::fp16, x);
      default: return round_double(num::Format::bf16, x);
    }
  } else {
    switch (p) {
      case Precision::fp32: return num::round_to(num::Format::fp32, x);
      case Precision::tf32: return S(round_tf32(num::to_double_rne(x)));  // exact: a tf32 value is a double
      case Precision::tf32_rz: return S(round_tf32(num::to_double_rne(x), true));
      case Precision::fp16: return num::round_to(num::Format::fp16, x);
      default: return num::round_to(num::Format::bf16, x);
    }
  }
}

// The policy that rounds nowhere.
struct Exact {
  static constexpr bool is_identity = true;
  template <class S>
  S round(Site, const S& x) const {
    return x;
  }
};

// A precision per site (default: exact everywhere) and whether the decays flush subnormal
// results to zero.
struct RoundingPolicy {
  static constexpr bool is_identity = false;
  std::array<Precision, site_count> at{};
  bool flush_decay_subnormals = false;

  RoundingPolicy& set(Site s, Precision p) {
    at[static_cast<std::size_t>(s)] = p;
    return *this;
  }
  Precision operator[](Site s) const { return at[static_cast<std::size_t>(s)]; }

  template <class S>
  S round(Site s, const S& x) const {
    S r = round_to(at[static_cast<std::size_t>(s)], x);
    if (s == Site::decay && flush_decay_subnormals) {
      using std::abs;
      if (abs(r) < S(min_normal(num::Format::fp32))) r = S(0);
    }
    return r;
  }
};

}  // namespace k3ref::kda::contract
