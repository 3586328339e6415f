// The optional pre-processing stages of KDA, each a pure function on tensors so each can
// be golden-tested alone (docs/conventions.md). All are templates over the scalar.
#pragma once

#include <cmath>
#include <optional>
#include <string>

#include "k3ref/error.h"
#include "k3ref/kda/options.h"
#include "k3ref/num/scalar.h"
#include "k3ref/tensor/tensor.h"

namespace k3ref::kda {

// ln 2 in the scalar's own precision (log2(e) = 1 / ln 2).
template <class S>
S ln2() {
  using std::log;
  return log(S(2));
}

// The epsilon of the q/k L2 norm, 1e-6, as an exact value of the scalar's tier where the
// tier allows (FLA's kernels hold it as an fp32 constant; the difference is below 1e-13
// relative to the norm and is documented in docs/conventions.md).
template <class S>
S l2norm_eps() {
  return S(1) / S(1000000);
}

// x / sqrt(sum(x^2) + 1e-6) along the last dimension.
template <class S>
Tensor<S> l2_normalize(const Tensor<S>& x) {
  static_assert(num::scalar_traits<S>::has_transcendentals, "l2_normalize needs sqrt");
  using std::sqrt;
  Tensor<S> out = x;
  const std::int64_t width = x.rank() == 0 ? 1 : x.dim(x.rank() - 1);
  if (width == 0) return out;
  for (std::int64_t row = 0; row < x.numel() / width; ++row) {
    S sum_sq(0);
    for (std::int64_t i = 0; i < width; ++i) sum_sq += x.data()[row * width + i] * x.data()[row * width + i];
    const S inv = S(1) / sqrt(sum_sq + l2norm_eps<S>());
    for (std::int64_t i = 0; i < width; ++i) out.data()[row * width + i] = x.data()[row * width + i] * inv;
  }
  return out;
}

template <class S>
S sigmoid(const S& x) {
  using std::exp;
  return S(1) / (S(1) + exp(-x));
}

// softplus(x) = log(1 + exp(x)), written to stay finite for large |x|.
template <class S>
S softplus(const S& x) {
  using std::exp;
  using std::log;
  if (x > S(0)) return x + log(S(1) + exp(-x));
  return log(S(1) + exp(x));
}

// The gate stage: raw g [B, T, HV, K] to the natural-log decay, for the softplus and
// lower-bound forms. A_log [HV] and dt_bias [HV, K] as in FLA's gate.
template <class S>
Tensor<S> gate_log_decay(const Tensor<S>& g_raw, GateForm form, const std::optional<Tensor<S>>& A_log,
                         const std::optional<Tensor<S>>& dt_bias, const std::optional<S>& lower_bound) {
  if (form != GateForm::softplus && form != GateForm::lower_bound)
    throw InvalidArgument("kda::gate_log_decay: argument 'form': only softplus and lower_bound take a raw gate");
  if constexpr (!num::scalar_traits<S>::has_transcendentals) {
    throw InvalidArgument("kda::gate_log_decay: the " + std::string(to_string(form)) +
                          " gate needs exp; in exact arithmetic give decays with GateForm::decay_factor");
  } else {
    using std::exp;
    if (g_raw.rank() != 4) throw InvalidArgument("kda::gate_log_decay: argument 'g': expected [B, T, HV, K]");
    if (form == GateForm::lower_bound && (!lower_bound || !(*lower_bound < S(0))))
      throw InvalidArgument("kda::gate_log_decay: argument 'lower_bound': must be given and negative");
    if (form == GateForm::softplus && !A_log)
      throw InvalidArgument("kda::gate_log_decay: argument 'A_log': required by the softplus gate");
    const std::int64_t HV = g_raw.dim(2), K = g_raw.dim(3);
    Tensor<S> g(g_raw.shape());
    if (HV * K == 0) return g;
    for (std::int64_t row = 0; row < g_raw.numel() / (HV * K); ++row)
      for (std::int64_t h = 0; h < HV; ++h) {
        const S a = A_log ? exp((*A_log)(h)) : S(1);  // without A_log the lower-bound gate has no factor
        for (std::int64_t c = 0; c < K; ++c) {
          const std::size_t at = static_cast<std::size_t>((row * HV + h) * K + c);
          const S x = g_raw.data()[at] + (dt_bias ? (*dt_bias)(h, c) : S(0));
          g.data()[at] = form == GateForm::softplus ? -a * softplus(x) : *lower_bound * sigmoid(A_log ? a * x : x);
        }
      }
    return g;
  }
}

// Multiplicative decay exp(g) in the chosen base: base e computes exp(g); base 2 first
// converts to g2 = g * log2(e) (as FlashKDA does) and computes 2^g2.
template <class S>
Tensor<S> decay_factors(const Tensor<S>& g_log, GateBase base) {
  if constexpr (!num::scalar_traits<S>::has_transcendentals) {
    throw InvalidArgument("kda::decay_factors: needs exp; in exact arithmetic use GateForm::decay_factor");
  } else {
    using std::exp;
    using std::pow;
    const S log2e = S(1) / ln2<S>();
    return g_log.template map<S>([&](const S& x) { return base == GateBase::e ? exp(x) : pow(S(2), x * log2e); });
  }
}

template <class S>
Tensor<S> activate_beta(const Tensor<S>& beta, BetaForm form) {
  if (form == BetaForm::as_given) return beta;
  if constexpr (!num::scalar_traits<S>::has_transcendentals) {
    throw InvalidArgument("kda::activate_beta: sigmoid needs exp; give beta as_given in exact arithmetic");
  } else {
    const S factor = form == BetaForm::two_sigmoid ? S(2) : S(1);
    return beta.template map<S>([&](const S& x) { return factor * sigmoid(x); });
  }
}

// K^-1/2. Exact types get it exactly when K is a perfect square and refuse otherwise.
template <class S>
S default_scale(std::int64_t K) {
  if constexpr (num::scalar_traits<S>::is_exact) {
    std::int64_t r = 0;
    while ((r + 1) * (r + 1) <= K) ++r;
    if (r * r != K)
      throw InvalidArgument("kda: argument 'scale': K = " + std::to_string(K) +
                            " is not a perfect square, so K^-1/2 is irrational; pass scale explicitly");
    return S(1) / S(r);
  } else {
    using std::sqrt;
    return S(1) / sqrt(S(K));
  }
}

}  // namespace k3ref::kda
