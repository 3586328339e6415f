// Chunkwise KDA in double against the recurrence in double on the same inputs, K = V = 128,
// T = 4096 and 16384, two heads on two threads (one head per thread). Reports GFLOP/s (the
// flops of the algorithm as written, counted below) and that figure as a fraction of the
// 2-core double FMA peak. The peak is measured, not read off a data sheet: one thread runs
// 12 independent chains of 256-bit FMAs (enough to keep both FMA pipes of a Zen 3 core
// busy through the 4-cycle latency), which gives 16 flops x the clock the core actually
// runs at; twice that is `peak_GFLOP_per_s`, and `clock_GHz` the clock it implies.
// K3REF_PEAK_GFLOPS overrides it; without FMA in the build it falls back to 2 x 16 x the
// "cpu MHz" of /proc/cpuinfo (the nominal clock, below the boost clock).
// Built with -march=native (the flags of -Dnative=true) so Eigen's products use AVX2/FMA;
// the recurrence in this program is compiled with the same flags.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <string>

#if defined(__AVX__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "k3ref/kda/chunkwise.h"
#include "k3ref/num/random.h"

namespace {

using namespace k3ref;

constexpr int kPeakCores = 2;

#if defined(__AVX__) && defined(__FMA__)
// 12 independent chains of 4-wide FMAs: 96 flops per iteration.
double fma_chains(std::int64_t iterations) {
  __m256d acc[12];
  const __m256d mul = _mm256_set1_pd(0.999999), add = _mm256_set1_pd(1e-9);
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_pd(i);
  for (std::int64_t n = 0; n < iterations; ++n)
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_pd(acc[i], mul, add);
  double sum = 0;
  for (int i = 0; i < 12; ++i) sum += acc[i][0];
  return sum;
}

// One core's FMA rate, the best of 10 short runs (a run that another process interrupts
// only comes out lower), times the cores. One thread rather than two, because on a shared
// machine a second busy core is rarely all ours; if the all-core clock is lower than the
// one-core clock this overstates the peak, which only lowers the reported fraction.
double measure_peak_gflops() {
  const std::int64_t iterations = 2'000'000;  // about 4 ms at 3 GHz
  double best = 0;
  for (int rep = 0; rep < 10; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    const double sink = fma_chains(iterations);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    benchmark::DoNotOptimize(sink);
    best = std::max(best, 96.0 * iterations / seconds * 1e-9);
  }
  return kPeakCores * best;
}
#endif

double peak_gflops() {
  static const double peak = [] {
    if (const char* env = std::getenv("K3REF_PEAK_GFLOPS")) return std::atof(env);
#if defined(__AVX__) && defined(__FMA__)
    return measure_peak_gflops();
#else
    std::ifstream cpuinfo("/proc/cpuinfo");
    double mhz = 0;
    for (std::string line; std::getline(cpuinfo, line);)
      if (line.rfind("cpu MHz", 0) == 0) mhz = std::max(mhz, std::atof(line.substr(line.find(':') + 1).c_str()));
    return kPeakCores * 16 * mhz * 1e-3;
#endif
  }();
  return peak;
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

// Flops of one chunk of c tokens as chunkwise_core executes them (a multiply-add is 2;
// Eigen multiplies the triangular INV and M_qk as dense matrices, and so are they counted).
double chunk_flops(kda::ChunkForm form, double c, double sub, double K, double V, int factors) {
  // [K_decay; Q_decay] S_in (or [W; Q_decay] S_in), K_restore^T U, and Diag(a_last) S_in.
  const double state_part = 2 * (2 * c) * K * V + 2 * K * c * V + K * V;
  const double m_qk_u = 2 * c * c * V;  // O += M_qk U
  if (form == kda::ChunkForm::flashkda)
    return 6 * c * K                                // a, Q_decay, K_decay, 1/a, K_inv, K_restore
           + 2 * (2 * c) * c * K                    // [G; M] = [K_decay; Q_decay] K_inv^T
           + c * c                                  // L = beta G
           + 2.0 * (factors - 1) * 2 * c * c * c    // Neumann doubling: a squaring and a product per step
           + 2 * c * V + 2 * c * c * V              // B = beta (V - K_decay S_in), U = INV B
           + m_qk_u + state_part;
  // FLA form, sub-chunks of `sub` rows.
  double intra = 0;
  for (double f = 0; f < c; f += sub) {
    const double r = std::min(sub, c - f);
    intra += r * (r + 1) / 2 * 5 * K   // each pair s <= t: k_s ratio (1), G and M sums (2 + 2)
             + r * (r - 1) / 2 * K;    // each pair s < t: one more decay in the ratio
    if (f > 0)
      intra += (r - 1) * K + 2 * r * K    // row ratios, row_op and qrow_op
               + f * K + f * K            // column ratios, col_op
               + 2 * (2 * r) * f * K;     // [row_op; qrow_op] col_op^T
  }
  double substitution = 0;  // forward substitution: row t needs sum_{r < t} (r + 1) multiply-adds
  for (double t = 0; t < c; ++t) substitution += t * (t + 1);
  return 5 * c * K                                  // a, Q_decay, K_decay, K_restore (ratio and product)
         + intra + c * c + substitution
         + c * K + c * V + 2 * c * c * (K + V)      // beta K_decay, beta V; W and U'
         + c * V                                    // U = U' - W S_in
         + m_qk_u + state_part;
}

// Threads (default 2, one per head); K3REF_BENCH_THREADS=1 measures one core, whose CPU
// time stays meaningful on a loaded machine.
int bench_threads() {
  const char* env = std::getenv("K3REF_BENCH_THREADS");
  return env ? std::max(1, std::atoi(env)) : 2;
}

void report(benchmark::State& state, double flops) {
  state.counters["GFLOP_per_s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  // The same rate divided by the peak: a fraction of the 2-core FMA peak.
  state.counters["fraction_of_peak"] =
      benchmark::Counter(flops * 1e-9 / peak_gflops(), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["peak_GFLOP_per_s"] = peak_gflops();
  state.counters["clock_GHz"] = peak_gflops() / (kPeakCores * 16);
}

// Both algorithms are timed on the same prepared inputs (kda::prepare: the q/k L2 norm, the
// gates' exp and the default scale, common to both and not part of either algorithm, run once outside the
// timed loop), so the time and the flops are those of the algorithm alone.
struct Prepared {
  kda::Inputs<double> in;
  kda::Options<double> opt;
  kda::Dims dims;
  kda::PreparedInputs<double> p;
  explicit Prepared(std::int64_t T) : in(make_inputs(T, 2, 128, 128)) {
    opt.num_threads = bench_threads();
    // Normalised q and k, as models run KDA: without it ||k||^2 ~ K/3 makes the delta rule
    // expand the state until it overflows within a few thousand tokens.
    opt.qk_l2norm = true;
    dims = kda::validate(kda::shapes_of(in, opt));
    p = kda::prepare(in, opt, dims);
  }
};

void BM_Recurrent(benchmark::State& state) {
  const std::int64_t T = state.range(0), H = 2, K = 128, V = 128;
  const Prepared x(T);
  for (auto _ : state) {
    auto out = kda::recurrent_core(x.p, x.in.initial_state, x.opt, x.dims);
    benchmark::DoNotOptimize(out.o.data());
  }
  report(state, 7.0 * K * V * T * H);  // per token and head: decay (1), S^T k (2), rank-1 update (2), read (2)
}

void BM_Chunkwise(benchmark::State& state, kda::ChunkForm form) {
  const std::int64_t T = state.range(0), H = 2, K = 128, V = 128;
  const Prepared x(T);
  kda::ChunkwiseOptions copt;
  copt.form = form;
  const std::int64_t C = kda::effective_chunk_size(copt);
  for (auto _ : state) {
    auto out = kda::chunkwise_core(x.p, x.in.initial_state, x.opt, x.dims, copt);
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
