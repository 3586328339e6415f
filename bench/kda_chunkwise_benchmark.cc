// Chunkwise KDA in double against the recurrence in double on the same inputs, K = V = 128,
// T = 4096 and 16384, two heads on two threads. Reports GFLOP/s (the flops of the
// algorithm's own products, counted below) and the fraction of the 2-core double FMA peak:
// 2 cores x 16 flops/cycle (two 256-bit FMA pipes) x the clock, read from /proc/cpuinfo
// or given as K3REF_PEAK_GFLOPS. Built with -march=native so Eigen uses AVX2/FMA.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "k3ref/kda/chunkwise.h"
#include "k3ref/num/random.h"

namespace {

using namespace k3ref;

double peak_gflops() {
  if (const char* env = std::getenv("K3REF_PEAK_GFLOPS")) return std::atof(env);
  std::ifstream cpuinfo("/proc/cpuinfo");
  double mhz = 0;
  for (std::string line; std::getline(cpuinfo, line);)
    if (line.rfind("cpu MHz", 0) == 0) mhz = std::max(mhz, std::atof(line.substr(line.find(':') + 1).c_str()));
  return 2 * 16 * mhz * 1e-3;
}

kda::Inputs<double> make_inputs(std::int64_t T, std::int64_t H, std::int64_t K, std::int64_t V) {
  num::Random rng(2026);
  auto draw = [&](const Shape& shape, double lo, double hi) {
    Tensor<double> t(shape);
    for (double& x : t.values()) x = rng.dyadic(lo, hi, 16);
    return t;
  };
  kda::Inputs<double> in;
  in.q = draw({1, T, H, K}, -1, 1);
  in.k = draw({1, T, H, K}, -1, 1);
  in.v = draw({1, T, H, V}, -1, 1);
  in.g = draw({1, T, H, K}, -1, 0);
  in.beta = draw({1, T, H}, 0, 1);
  in.initial_state = draw({1, H, K, V}, -1, 1);
  return in;
}

// Flops of one chunk of c tokens (a multiply-add is 2), the products of chunkwise_core.
double chunk_flops(kda::ChunkForm form, double c, double sub, double K, double V, int factors) {
  const double state_part = 2 * c * K * V * 3 + K * V;  // K_decay S (or W S), Q_decay S, K_restore^T U; decay of S
  if (form == kda::ChunkForm::flashkda)
    return 2 * 2 * c * c * K                        // K_decay K_inv^T and Q_decay K_inv^T
           + 2.0 * (factors - 1) * 2 * c * c * c    // Neumann squarings and products
           + 2 * c * c * V * 2                      // INV B, M_qk U
           + state_part;
  const double intra = 2 * 2 * (c * c / 2) * K;     // L and M_qk, diagonal and off-diagonal blocks
  (void)sub;
  return intra + c * c * c / 3                      // forward substitution
         + 2 * c * c * (K + V)                      // W and U'
         + 2 * c * c * V                            // M_qk U
         + state_part;
}

// Threads (default 2, one per head); K3REF_BENCH_THREADS=1 measures one core, whose CPU
// time stays meaningful on a loaded machine.
int bench_threads() {
  const char* env = std::getenv("K3REF_BENCH_THREADS");
  return env ? std::max(1, std::atoi(env)) : 2;
}

void report(benchmark::State& state, double flops) {
  state.counters["GFLOP_per_s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["peak_GFLOP_per_s"] = peak_gflops();
}

void BM_Recurrent(benchmark::State& state) {
  const std::int64_t T = state.range(0), H = 2, K = 128, V = 128;
  const auto in = make_inputs(T, H, K, V);
  kda::Options<double> opt;
  opt.num_threads = bench_threads();
  for (auto _ : state) {
    auto out = kda::recurrent_forward(in, opt);
    benchmark::DoNotOptimize(out.o.data());
  }
  report(state, 7.0 * K * V * T * H);  // decay, S^T k, rank-1 update, read
}

void BM_Chunkwise(benchmark::State& state, kda::ChunkForm form) {
  const std::int64_t T = state.range(0), H = 2, K = 128, V = 128;
  const auto in = make_inputs(T, H, K, V);
  kda::Options<double> opt;
  opt.num_threads = bench_threads();
  kda::ChunkwiseOptions copt;
  copt.form = form;
  const std::int64_t C = kda::effective_chunk_size(copt);
  for (auto _ : state) {
    auto out = kda::chunkwise_forward(in, opt, copt);
    benchmark::DoNotOptimize(out.out.o.data());
  }
  double flops = 0;
  for (std::int64_t t0 = 0; t0 < T; t0 += C)
    flops += chunk_flops(form, std::min(C, T - t0), 16, K, V, kda::neumann_factor_count(C));
  report(state, flops * H);
}

BENCHMARK(BM_Recurrent)->Arg(4096)->Arg(16384)->ArgName("T")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_Chunkwise, flashkda_c16, kda::ChunkForm::flashkda)
    ->Arg(4096)->Arg(16384)->ArgName("T")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_Chunkwise, fla_c64, kda::ChunkForm::fla)
    ->Arg(4096)->Arg(16384)->ArgName("T")->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
