// Quantile Balancing report: prints
//   1. the MaxVio table, per batch, of QB online (bias of batch t routes batch t+1) against
//      DeepSeek's auxiliary-loss-free sign update on the same batches, at the K3 shape;
//   2. MaxVio per iteration of the offline alternating solver on one K3-shaped batch;
//   3. iterations to the optimal assignment, fixed points and cycles on random instances,
//      in exact rationals, against the exact LP optimum (min-cost flow).
// Everything is deterministic (num::Random, fixed seeds). Usage: qb_report [batches] [instances]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "k3ref/num/random.h"
#include "k3ref/num/scalar.h"
#include "k3ref/qb/online.h"
#include "k3ref/qb/optimum.h"
#include "k3ref/qb/solver.h"

using namespace k3ref;
using Q = num::rational;

namespace {

double uniform(num::Random& rng, double lo, double hi) {
  return lo + (hi - lo) * std::ldexp(static_cast<double>(rng.next_u64() >> 11), -53);
}

// Router-like affinities: sigmoid(x_i . w_j / sqrt(d) + u_j), token features x fresh per
// batch, expert embeddings w and a per-expert popularity offset u fixed: a stationary but
// imbalanced stream.
struct Router {
  std::int64_t n, d;
  std::vector<double> w, u;
  Router(std::int64_t n_, std::int64_t d_, num::Random& rng) : n(n_), d(d_), w(n_ * d_), u(n_) {
    for (double& v : w) v = uniform(rng, -1, 1);
    for (double& v : u) v = uniform(rng, -1.5, 1.5);
  }
  Tensor<double> batch(std::int64_t m, num::Random& rng) const {
    std::vector<double> x(static_cast<std::size_t>(m * d));
    for (double& v : x) v = uniform(rng, -1, 1);
    Tensor<double> s({m, n});
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t j = 0; j < n; ++j) {
        double logit = u[j];
        for (std::int64_t r = 0; r < d; ++r) logit += scale * x[i * d + r] * w[j * d + r];
        s(i, j) = qb::sigmoid(logit);
      }
    return s;
  }
};

void online_table(int batches) {
  const std::int64_t n = 896, k = 16, m = 4480;
  num::Random rng(20260801);
  const Router router(n, 32, rng);
  std::vector<Tensor<double>> stream;
  for (int b = 0; b < batches; ++b) stream.push_back(router.batch(m, rng));
  qb::OnlineOptions<double> opt;
  opt.k = k;
  const auto qb1 = qb::route_online_qb(stream, opt);
  opt.iterations_per_batch = 4;
  const auto qb4 = qb::route_online_qb(stream, opt);
  const auto sign3 = qb::route_online_sign_update(stream, k, 1e-3, 1.0);
  const auto sign2 = qb::route_online_sign_update(stream, k, 1e-2, 1.0);
  std::printf("## 1. Online MaxVio per batch (n = %lld experts, k = %lld, m = %lld tokens per batch, q = %lld)\n\n",
              static_cast<long long>(n), static_cast<long long>(k), static_cast<long long>(m),
              static_cast<long long>(m * k / n));
  std::printf("Bias from batch t routes batch t+1 (batch 0: no bias). QB: warm-started solver, 1 or 4 iterations\n"
              "per batch, mean-centred bias. Sign update: b_j += gamma * sign(mean load - load_j).\n\n");
  std::printf("| batch | QB (1 it/batch) | QB (4 it/batch) | sign, gamma=1e-3 | sign, gamma=1e-2 |\n");
  std::printf("| ---: | ---: | ---: | ---: | ---: |\n");
  for (int b = 0; b < batches; ++b)
    std::printf("| %d | %.4f | %.4f | %.4f | %.4f |\n", b, qb1[b].max_vio, qb4[b].max_vio, sign3[b].max_vio,
                sign2[b].max_vio);
  std::printf("\n");
}

void offline_table(int iterations) {
  const std::int64_t n = 896, k = 16, m = 4480;
  num::Random rng(20260801);
  const Router router(n, 32, rng);
  const Tensor<double> s = router.batch(m, rng);
  const auto trace = qb::alternating_solver(s, k, iterations);
  std::printf("## 2. Offline solver on one batch of section 1's stream (double), per iteration\n\n");
  std::printf("| iteration | MaxVio | min load | max load | dual objective |\n| ---: | ---: | ---: | ---: | ---: |\n");
  const auto unbiased = qb::expert_loads(qb::route(s, std::vector<double>(n, 0.0), k), n);
  std::printf("| 0 (no bias) | %.4f | %lld | %lld | |\n", qb::max_vio<double>(unbiased),
              static_cast<long long>(*std::ranges::min_element(unbiased)),
              static_cast<long long>(*std::ranges::max_element(unbiased)));
  for (std::size_t t = 0; t < trace.size(); ++t)
    std::printf("| %zu | %.4f | %lld | %lld | %.6f |\n", t + 1, qb::max_vio<double>(trace[t].loads),
                static_cast<long long>(*std::ranges::min_element(trace[t].loads)),
                static_cast<long long>(*std::ranges::max_element(trace[t].loads)),
                qb::dual_objective(s, trace[t].alpha, trace[t].beta, k));
  std::printf("\n");
}

struct Summary {
  int instances = 0, reached = 0, fixed = 0, drifting = 0, cycles = 0, unsettled = 0, dual_optimal = 0;
  std::vector<int> iterations_to_optimum, iterations_to_repeat;
  double final_vio = 0, final_gap_rel = 0;
};

void optimum_table(int instances) {
  struct Config {
    std::int64_t m, n, k;
    bool tie_heavy;
  };
  const Config configs[] = {{8, 4, 1, false},  {12, 6, 2, false}, {16, 8, 2, false}, {24, 6, 2, false},
                            {32, 8, 2, false}, {48, 8, 3, false}, {12, 6, 2, true},  {32, 8, 2, true}};
  std::printf("## 3. Iterations to the optimal assignment (exact rationals, %d random instances per row)\n\n", instances);
  std::printf("Scores: tie-free = distinct 40-bit numerators over 2^20; tie-heavy = {0, 1/4, 1/2, 3/4}.\n"
              "Start beta = 0; run until the state (beta modulo a constant) repeats, at most 200 iterations.\n"
              "'optimal' = the selection is balanced and its objective equals the LP optimum (min-cost flow,\n"
              "checked against the simplex). 'dual opt.' = final dual objective equals the LP optimum.\n\n");
  std::printf("| m | n | k | scores | optimal | its to optimal (median / max) | fixed pt | drift | cycle | "
              "its to repeat (median / max) | dual opt. | final MaxVio (mean) | final gap / LP (mean) |\n");
  std::printf("| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  for (const Config& cfg : configs) {
    num::Random rng(0x71620000 + cfg.m * 100 + cfg.n * 10 + cfg.k + (cfg.tie_heavy ? 7 : 0));
    Summary sum;
    const std::int64_t q = cfg.m * cfg.k / cfg.n;
    for (int trial = 0; trial < instances; ++trial) {
      Tensor<Q> s({cfg.m, cfg.n});
      for (Q& x : s.values())
        x = cfg.tie_heavy ? Q(static_cast<std::int64_t>(rng.below(4))) / Q(4)
                          : Q(static_cast<std::int64_t>(rng.below(std::uint64_t{1} << 40))) / Q(std::int64_t{1} << 20);
      const auto opt = qb::optimum_by_min_cost_flow(s, cfg.k);
      if (trial < 20 && qb::optimum_by_simplex(s, cfg.k).value != opt.value) {
        std::printf("ERROR: min-cost flow and simplex disagree\n");
        std::exit(1);
      }
      const auto run = qb::run_until_repeat(s, cfg.k, 200);
      ++sum.instances;
      for (std::size_t t = 0; t < run.trace.size(); ++t) {
        const auto mask = qb::selection_mask(run.trace[t].selection, cfg.n);
        if (qb::is_balanced(mask, cfg.k, q) && qb::mask_objective(s, mask) == opt.value) {
          ++sum.reached;
          sum.iterations_to_optimum.push_back(static_cast<int>(t + 1));
          break;
        }
      }
      if (!run.repeat_of) {
        ++sum.unsettled;
      } else {
        sum.iterations_to_repeat.push_back(static_cast<int>(run.trace.size()));
        if (run.period() > 1) ++sum.cycles;
        else if (run.drift() != Q(0)) ++sum.drifting;
        else ++sum.fixed;
      }
      const auto& last = run.trace.back();
      const Q gap = qb::dual_objective(s, last.alpha, last.beta, cfg.k) - opt.value;
      if (gap == Q(0)) ++sum.dual_optimal;
      sum.final_vio += qb::max_vio<double>(last.loads);
      if (opt.value != Q(0)) sum.final_gap_rel += static_cast<double>(gap / abs(opt.value));
    }
    auto median_max = [](std::vector<int> v) {
      if (v.empty()) return std::string("-");
      std::sort(v.begin(), v.end());
      return std::to_string(v[v.size() / 2]) + " / " + std::to_string(v.back());
    };
    std::printf("| %lld | %lld | %lld | %s | %d/%d | %s | %d | %d | %d | %s | %d | %.4f | %.2e |\n",
                static_cast<long long>(cfg.m), static_cast<long long>(cfg.n), static_cast<long long>(cfg.k),
                cfg.tie_heavy ? "tie-heavy" : "tie-free", sum.reached, sum.instances,
                median_max(sum.iterations_to_optimum).c_str(), sum.fixed, sum.drifting, sum.cycles,
                median_max(sum.iterations_to_repeat).c_str(), sum.dual_optimal, sum.final_vio / sum.instances,
                sum.final_gap_rel / sum.instances);
    std::fflush(stdout);
  }
  std::printf("\n");
}

}  // namespace

int main(int argc, char** argv) {
  const int batches = argc > 1 ? std::atoi(argv[1]) : 12;
  const int instances = argc > 2 ? std::atoi(argv[2]) : 200;
  const auto start = std::chrono::steady_clock::now();
  std::printf("# Quantile Balancing report (k3ref)\n\n");
  online_table(batches);
  offline_table(10);
  optimum_table(instances);
  std::printf("(%.1f s)\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return 0;
}
