// Block AttnRes in double: direct form against two-phase form, K3-like shape (sublayers in
// blocks of 12, d = 1024). Measures the reference as built (no -march=native).
#include <benchmark/benchmark.h>

#include "k3ref/attnres/attnres.h"
#include "k3ref/num/random.h"

namespace {

using namespace k3ref;

struct Problem {
  attnres::Weights<double> w;
  Tensor<double> values;
};

Problem make(std::int64_t L, std::int64_t T, std::int64_t d) {
  num::Random rng(1);
  Problem p{attnres::Weights<double>{Tensor<double>({L + 1, d}), Tensor<double>({L + 1, d}), 1e-6},
            Tensor<double>({L + 1, T, d})};
  for (double& x : p.w.queries.values()) x = rng.dyadic(-0.125, 0.125, 8);
  for (double& x : p.w.norm_weights.values()) x = rng.dyadic(0.5, 1.5, 8);
  for (double& x : p.values.values()) x = rng.dyadic(-1, 1, 8);
  return p;
}

void BM_block(benchmark::State& state, attnres::BlockForm form) {
  const std::int64_t L = state.range(0), T = state.range(1), d = 1024;
  const Problem p = make(L, T, d);
  for (auto _ : state) benchmark::DoNotOptimize(attnres::block_forward(p.w, p.values, 12, form).h.data());
  state.SetItemsProcessed(state.iterations() * T);  // tokens
}

void BM_full(benchmark::State& state) {
  const std::int64_t L = state.range(0), T = state.range(1), d = 1024;
  const Problem p = make(L, T, d);
  for (auto _ : state) benchmark::DoNotOptimize(attnres::full_forward(p.w, p.values).h.data());
  state.SetItemsProcessed(state.iterations() * T);
}

BENCHMARK_CAPTURE(BM_block, direct, attnres::BlockForm::direct)->Args({96, 16})->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_block, two_phase, attnres::BlockForm::two_phase)->Args({96, 16})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_full)->Args({96, 16})->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
