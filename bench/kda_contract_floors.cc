// The error floors of the kernels' chunk contracts (kda/kernel_contracts.h): each
// contract evaluated in emulation on bf16 inputs, K = V = 128, T = 4096, two heads, against
// the recurrence in double, for decays near 0, near -5 and mixed. Prints the relative RMS
// error of o, its ratio to the bf16 output-rounding floor, and the max ulp distance in bf16.
// A kernel with that contract should meet these figures. Takes some seconds; not a unit test.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "k3ref/check/metrics.h"
#include "k3ref/kda/kernel_contracts.h"
#include "k3ref/num/random.h"

using namespace k3ref;

namespace {

kda::Inputs<double> make_inputs(std::uint64_t seed, std::int64_t T, double g_lo, double g_hi) {
  const std::int64_t H = 2, K = 128, V = 128;
  num::Random rng(seed);
  auto draw = [&](const Shape& shape, double lo, double hi) {
    Tensor<double> t(shape);
    for (double& x : t.values()) x = num::round_to(num::Format::bf16, rng.dyadic(lo, hi, 24));
    return t;
  };
  kda::Inputs<double> in;
  in.q = draw({1, T, H, K}, -1, 1);
  in.k = draw({1, T, H, K}, -1, 1);
  in.v = draw({1, T, H, V}, -1, 1);
  in.g = draw({1, T, H, K}, g_lo, g_hi);  // natural-log decays
  in.beta = draw({1, T, H}, -4, 4);        // raw, through sigmoid
  in.initial_state = draw({1, H, K, V}, -1, 1);
  return in;
}

}  // namespace

int main(int argc, char** argv) {
  const std::int64_t T = argc > 1 ? std::atoll(argv[1]) : 4096;
  struct Regime {
    const char* name;
    double lo, hi;
  };
  const Regime regimes[] = {{"near 0 (g in [-0.05, 0])", -0.05, 0}, {"near -5 (g in [-5, -4.9])", -5, -4.9},
                            {"mixed (g in [-5, 0])", -5, 0}};
  std::printf("T = %lld, K = V = 128, 2 heads, bf16 inputs, q/k L2-normalised, beta = sigmoid\n",
              static_cast<long long>(T));
  std::printf("%-10s %-28s %12s %12s %10s %14s\n", "contract", "decays", "rel RMS", "bf16 floor", "x floor",
              "max ulp(bf16)");
  for (const Regime& r : regimes) {
    const auto in = make_inputs(4096, T, r.lo, r.hi);
    kda::Options<double> opt;
    opt.qk_l2norm = true;
    opt.beta = kda::BetaForm::sigmoid;
    opt.num_threads = 2;
    const auto ref = kda::recurrent_forward(in, opt);
    for (const auto kernel : {kda::contract::Kernel::flashkda, kda::contract::Kernel::fla_chunk}) {
      const auto got = kda::contract::evaluate_contract(kda::contract::kernel_contract(kernel), in, opt);
      const auto m = check::compare(got.o.values(), ref.o.values(), num::Format::bf16);
      std::printf("%-10s %-28s %12.3e %12.3e %10.2f %14.1f\n", std::string(kda::contract::to_string(kernel)).c_str(),
                  r.name, m.rel_rms, m.floor_rel_rms, m.rel_rms / m.floor_rel_rms, m.max_ulp);
    }
  }
  return 0;
}
