// Throughput of the double KDA recurrence in token-heads per second, at
// K = V = 128, T = 4096, H = 4. bench/compare_with_torch.py runs it
// beside a plain PyTorch float64 loop of the same recurrence and prints the ratio.
#include <benchmark/benchmark.h>

#include "k3ref/kda/recurrent.h"
#include "k3ref/num/random.h"

namespace {

using namespace k3ref;

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
  return in;
}

// One iteration: the whole forward (T tokens x H heads), gates and beta as given,
// L2 norm of q and k included (as FLA's kernel does with use_qk_l2norm_in_kernel).
void BM_KdaRecurrentDouble(benchmark::State& state) {
  const std::int64_t T = state.range(0), H = state.range(1), K = 128, V = 128;
  const kda::Inputs<double> in = make_inputs(T, H, K, V);
  kda::Options<double> opt;
  opt.qk_l2norm = true;
  opt.num_threads = static_cast<int>(state.range(2));
  for (auto _ : state) {
    auto out = kda::recurrent_forward(in, opt);
    benchmark::DoNotOptimize(out.o.data());
  }
  state.counters["token_heads_per_s"] =
      benchmark::Counter(static_cast<double>(T * H), benchmark::Counter::kIsIterationInvariantRate);
  // 7 K V flops per token and head: decay (1), S^T k (2), rank-1 update (2), read (2).
  state.counters["GFLOP_per_s"] = benchmark::Counter(7.0 * K * V * T * H * 1e-9,
                                                     benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_KdaRecurrentDouble)
    ->Args({4096, 4, 1})
    ->Args({4096, 4, 2})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->ArgNames({"T", "H", "threads"});

}  // namespace

BENCHMARK_MAIN();
