// One convention for the expert bias in every QB golden (docs/qb.md, "Goldens"): `beta`,
// SUBTRACTED from the scores before the top-k (selection = top-k of s - beta), stored as the
// algorithm's own state: the solver's iterates `beta`, online QB's `qb_beta` (mean-centred by
// the algorithm when center_bias is set), the sign update's `sign_beta` (= -b of DeepSeek's
// added bias). No storage-side re-centring: a mean over n experts is not exact in binary for
// n not a power of two, and the solver's stored (alpha, beta) must stay an exact dual point.
//
// The Quantile Balancing goldens: the alternating solver's iterates ("qb.solver") with,
// on small sizes, the exact balanced optimum and its dual; and the online form against the
// sign-update baseline ("qb.online"). Scores are exact in BF16 (dyadic with <= 8
// significant bits). References are exact: num::rational, or double where the run is
// proven exact (scores on a grid 2^-g, every iterate below 2^(52-g) in magnitude, checked
// at run time), which the K3-shaped case needs for its size.
#include <cmath>
#include <cstdint>
#include <string>

#include "golden/catalogue.h"
#include "k3ref/num/float_format.h"
#include "k3ref/num/random.h"
#include "k3ref/num/scalar.h"
#include "k3ref/num/tier.h"
#include "k3ref/qb/online.h"
#include "k3ref/qb/optimum.h"
#include "k3ref/qb/solver.h"

namespace k3ref::golden {
namespace {

using nlohmann::json;
using Q = num::rational;

// Scores of a solver case, generated from the seed.
//   "dyadic":   uniform on {lo + (hi - lo) i / 2^bits}, stored as "scores" (BF16)
//   "levels":   i / levels, i uniform in [0, levels), stored as "scores" (BF16)
//   "low_rank": s = x w^T + u with x [m, d], w [n, d] on the grid 2^-6 in [-1, 1) and
//               u [n] on 2^-5 in [-2, 2), all stored (BF16) instead of the m x n matrix;
//               every s_ij is a multiple of 2^-12 below d + 2 in magnitude, exact in double
//               whatever the order of summation.
struct ScoreInputs {
  Tensor<double> scores;
  std::vector<std::pair<std::string, Tensor<double>>> stored;  // what the file holds
  int grid_bits = 0;                                           // scores are multiples of 2^-grid_bits
};

ScoreInputs make_scores(const json& spec, std::int64_t m, std::int64_t n, num::Random& rng) {
  const std::string kind = spec.at("kind");
  ScoreInputs out;
  out.scores = Tensor<double>({m, n});
  if (kind == "dyadic") {
    const double lo = spec.at("lo"), hi = spec.at("hi");
    const int bits = spec.at("bits");
    for (double& x : out.scores.values()) x = rng.dyadic(lo, hi, bits);
    out.stored.emplace_back("scores", out.scores);
    out.grid_bits = bits + 2;  // (hi - lo) <= 4 in every case
  } else if (kind == "levels") {
    const std::int64_t levels = spec.at("levels");
    for (double& x : out.scores.values())
      x = static_cast<double>(rng.below(static_cast<std::uint64_t>(levels))) / static_cast<double>(levels);
    out.stored.emplace_back("scores", out.scores);
    out.grid_bits = 8;
  } else if (kind == "low_rank") {
    const std::int64_t d = spec.at("d");
    Tensor<double> x({m, d}), w({n, d}), u({n});
    for (double& v : x.values()) v = rng.dyadic(-1, 1, 7);
    for (double& v : w.values()) v = rng.dyadic(-1, 1, 7);
    for (double& v : u.values()) v = rng.dyadic(-2, 2, 7);
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t j = 0; j < n; ++j) {
        double s = u(j);
        for (std::int64_t r = 0; r < d; ++r) s += x(i, r) * w(j, r);
        out.scores(i, j) = s;
      }
    out.stored.emplace_back("x", x);
    out.stored.emplace_back("w", w);
    out.stored.emplace_back("u", u);
    out.grid_bits = 12;
  } else {
    throw InvalidArgument("qb golden: unknown score kind '" + kind + "'");
  }
  return out;
}

// Throws unless every value is below 2^(52 - grid_bits): then every difference the solver
// forms of such values (and of scores) is exact in double.
void require_exact(const std::vector<double>& values, int grid_bits, const std::string& what) {
  const double limit = std::ldexp(1.0, 52 - grid_bits);
  for (double v : values)
    if (!(std::fabs(v) < limit)) throw InvalidArgument("qb golden: " + what + " leaves the exact range of double");
}

template <class S>
double to_f64(const S& x) {
  return num::to_double_rne(x);
}

Tensor<double> stack(const std::vector<std::vector<double>>& rows) {
  const std::int64_t t = static_cast<std::int64_t>(rows.size()), w = rows.empty() ? 0 : rows[0].size();
  Tensor<double> out({t, w});
  for (std::int64_t a = 0; a < t; ++a) std::copy(rows[a].begin(), rows[a].end(), out.data() + a * w);
  return out;
}

io::RawTensor i32(const Tensor<std::int64_t>& t) { return io::from_i64(t, DType::I32); }

Tensor<std::int64_t> stack_i64(const std::vector<std::vector<std::int64_t>>& rows) {
  const std::int64_t t = static_cast<std::int64_t>(rows.size()), w = rows.empty() ? 0 : rows[0].size();
  Tensor<std::int64_t> out({t, w});
  for (std::int64_t a = 0; a < t; ++a) std::copy(rows[a].begin(), rows[a].end(), out.data() + a * w);
  return out;
}

template <class S>
std::vector<double> as_f64(const std::vector<S>& v) {
  std::vector<double> out;
  out.reserve(v.size());
  for (const S& x : v) out.push_back(to_f64(x));
  return out;
}

// The solver trace in S, written as F64 / I32 tensors.
template <class S>
void add_solver_outputs(io::SafetensorsFile& file, const Tensor<S>& scores, const json& p,
                        const std::vector<qb::Iterate<S>>& trace, const std::optional<S>& optimum) {
  const std::int64_t k = p.at("k"), m = scores.dim(0);
  std::vector<std::vector<double>> alpha, beta;
  std::vector<std::vector<std::int64_t>> loads;
  std::vector<double> vio, dual, gap;
  for (const auto& it : trace) {
    alpha.push_back(as_f64(it.alpha));
    beta.push_back(as_f64(it.beta));
    loads.push_back(it.loads);
    vio.push_back(to_f64(qb::max_vio<Q>(it.loads)));  // exact, rounded once, whatever S is
    const S d = qb::dual_objective(scores, it.alpha, it.beta, k);
    dual.push_back(to_f64(d));
    if (optimum) gap.push_back(to_f64(S(d - *optimum)));
  }
  const std::vector<int> keep = p.at("selection_iterations").get<std::vector<int>>();
  Tensor<std::int64_t> selection({static_cast<std::int64_t>(keep.size()), m, k});
  for (std::size_t a = 0; a < keep.size(); ++a) {
    const auto& sel = trace.at(static_cast<std::size_t>(keep[a] - 1)).selection;
    for (std::int64_t e = 0; e < m * k; ++e) selection.data()[a * m * k + e] = sel.data()[e];
  }
  Tensor<std::int64_t> kept({static_cast<std::int64_t>(keep.size())});
  for (std::size_t a = 0; a < keep.size(); ++a) kept.data()[a] = keep[a];
  file.tensors.emplace_back("alpha", io::from_f64(stack(alpha), DType::F64));
  file.tensors.emplace_back("beta", io::from_f64(stack(beta), DType::F64));
  file.tensors.emplace_back("loads", i32(stack_i64(loads)));
  file.tensors.emplace_back("max_vio", io::from_f64(Tensor<double>({static_cast<std::int64_t>(vio.size())}, vio), DType::F64));
  file.tensors.emplace_back("dual_objective",
                            io::from_f64(Tensor<double>({static_cast<std::int64_t>(dual.size())}, dual), DType::F64));
  file.tensors.emplace_back("selection", i32(selection));
  file.tensors.emplace_back("selection_iterations", i32(kept));
  if (optimum)
    file.tensors.emplace_back("duality_gap",
                              io::from_f64(Tensor<double>({static_cast<std::int64_t>(gap.size())}, gap), DType::F64));
}

Case solver_case(const std::string& name, std::int64_t m, std::int64_t n, std::int64_t k,
                 int iterations, json scores, bool exact_rational, bool optimum, std::vector<int> selection_iterations) {
  if (selection_iterations.empty())
    for (int t = 1; t <= iterations; ++t) selection_iterations.push_back(t);
  json p = {{"m", m},
            {"n", n},
            {"k", k},
            {"q", m * k / n},
            {"iterations", iterations},
            {"scores", std::move(scores)},
            {"reference", exact_rational ? std::string(num::to_string(num::Tier::rational)) : "double_exact"},
            {"optimum", optimum},
            {"selection_iterations", selection_iterations},
            {"tie_rule", "biased desc, raw desc, expert index asc"}};
  return make_case(name, "qb.solver", p);
}

io::SafetensorsFile generate_qb_solver(const Case& c) {
  const json& p = c.params;
  const std::int64_t m = p.at("m"), n = p.at("n"), k = p.at("k");
  const int iterations = p.at("iterations");
  qb::routing_shape(m, n, k, "qb golden '" + c.name + "'");
  num::Random rng(c.seed);
  const ScoreInputs in = make_scores(p.at("scores"), m, n, rng);

  io::SafetensorsFile file;
  for (const auto& [name, t] : in.stored) file.tensors.emplace_back(name, io::from_f64(t, DType::BF16));
  std::string outputs = "alpha,beta,loads,max_vio,dual_objective,selection";
  std::string precision;
  if (p.at("reference") == std::string(num::to_string(num::Tier::rational))) {
    precision = num::description(num::Tier::rational);
    const Tensor<Q> scores = in.scores.map<Q>([](double x) { return Q(x); });
    const auto trace = qb::alternating_solver(scores, k, iterations);
    std::optional<Q> optimum;
    if (p.at("optimum")) {
      const auto flow = qb::optimum_by_min_cost_flow(scores, k);
      const auto simplex = qb::optimum_by_simplex(scores, k);
      if (flow.value != simplex.value) throw InvalidArgument("qb golden: the two exact optimum methods disagree");
      optimum = flow.value;
      file.tensors.emplace_back("lp_optimum", io::from_f64(Tensor<double>({1}, std::vector<double>{to_f64(flow.value)}), DType::F64));
      Tensor<std::int64_t> chosen({m, n});
      for (std::int64_t e = 0; e < m * n; ++e) chosen.data()[e] = flow.chosen.data()[e];
      file.tensors.emplace_back("optimal_assignment", io::from_i64(chosen, DType::U8));
      file.tensors.emplace_back("optimal_alpha", io::from_f64(Tensor<double>({m}, as_f64(flow.alpha)), DType::F64));
      file.tensors.emplace_back("optimal_beta", io::from_f64(Tensor<double>({n}, as_f64(flow.beta)), DType::F64));
      outputs += ",duality_gap,lp_optimum,optimal_assignment,optimal_alpha,optimal_beta";
    }
    add_solver_outputs(file, scores, p, trace, optimum);
  } else {
    precision = "double, exact (dyadic scores, range checked)";
    if (p.at("optimum")) throw InvalidArgument("qb golden: the optimum is computed in rationals only");
    require_exact(in.scores.values(), in.grid_bits, "scores");
    const auto trace = qb::alternating_solver(in.scores, k, iterations);
    for (const auto& it : trace) {
      require_exact(it.alpha, in.grid_bits, "alpha");
      require_exact(it.beta, in.grid_bits, "beta");
    }
    add_solver_outputs(file, in.scores, p, trace, std::optional<double>{});
  }
  file.metadata = metadata_of(c, precision, file, outputs, "selection_iterations");
  return file;
}

io::SafetensorsFile generate_qb_online(const Case& c) {
  const json& p = c.params;
  const std::int64_t batches = p.at("batches"), m = p.at("m"), n = p.at("n"), k = p.at("k");
  qb::routing_shape(m, n, k, "qb golden '" + c.name + "'");
  num::Random rng(c.seed);
  // Affinities (sigmoid-like scores in (0, 1)): i / 2^bits with 1 <= i < 2^bits, exact in BF16.
  const int bits = p.at("affinity_bits");
  Tensor<double> affinities({batches, m, n});
  for (double& x : affinities.values())
    x = std::ldexp(static_cast<double>(1 + rng.below((std::uint64_t{1} << bits) - 1)), -bits);
  std::vector<Tensor<Q>> exact;
  for (std::int64_t b = 0; b < batches; ++b) {
    Tensor<Q> s({m, n});
    for (std::int64_t e = 0; e < m * n; ++e) s.data()[e] = Q(affinities.data()[b * m * n + e]);
    exact.push_back(std::move(s));
  }
  auto rational_of = [](const json& v) { return Q(v.at(0).get<std::int64_t>()) / Q(v.at(1).get<std::int64_t>()); };
  qb::OnlineOptions<Q> opt;
  opt.k = k;
  opt.routed_scaling_factor = rational_of(p.at("routed_scaling_factor"));
  opt.iterations_per_batch = p.at("iterations_per_batch");
  opt.warm_start = p.at("warm_start");
  opt.center_bias = p.at("center_bias");
  const Q gamma = rational_of(p.at("sign_gamma"));

  io::SafetensorsFile file;
  file.tensors.emplace_back("affinities", io::from_f64(affinities, DType::BF16));
  auto add = [&](const std::string& prefix, const std::vector<qb::RoutedBatch<Q>>& routed) {
    Tensor<double> beta({batches, n}), weights({batches, m, k}), vio({batches});
    Tensor<std::int64_t> selection({batches, m, k}), loads({batches, n});
    for (std::int64_t b = 0; b < batches; ++b) {
      const auto& r = routed[b];
      for (std::int64_t j = 0; j < n; ++j) {
        beta(b, j) = to_f64(r.bias[j]);
        loads(b, j) = r.loads[j];
      }
      for (std::int64_t e = 0; e < m * k; ++e) {
        selection.data()[b * m * k + e] = r.selection.data()[e];
        weights.data()[b * m * k + e] = to_f64(r.weights.data()[e]);
      }
      vio(b) = to_f64(r.max_vio);
    }
    file.tensors.emplace_back(prefix + "_beta", io::from_f64(beta, DType::F64));
    file.tensors.emplace_back(prefix + "_selection", i32(selection));
    file.tensors.emplace_back(prefix + "_weights", io::from_f64(weights, DType::F64));
    file.tensors.emplace_back(prefix + "_loads", i32(loads));
    file.tensors.emplace_back(prefix + "_max_vio", io::from_f64(vio, DType::F64));
  };
  add("qb", qb::route_online_qb(exact, opt));
  add("sign", qb::route_online_sign_update(exact, k, gamma, opt.routed_scaling_factor));
  file.metadata = metadata_of(c, std::string(num::description(num::Tier::rational)), file, "{qb,sign}_{beta,selection,weights,loads,max_vio}");
  return file;
}

std::vector<Case> qb_default_cases() {
  std::vector<Case> cases;
  auto dyadic = [](double lo, double hi, int bits) { return json{{"kind", "dyadic"}, {"lo", lo}, {"hi", hi}, {"bits", bits}}; };
  auto levels = [](int l) { return json{{"kind", "levels"}, {"levels", l}}; };
  // Small cases with the exact optimum, its dual, and the duality gap of every iterate.
  cases.push_back(solver_case("qb_solver_m16_n8_k2", 16, 8, 2, 6, dyadic(0, 1, 8), true, true, {}));
  cases.push_back(solver_case("qb_solver_m24_n6_k2_tie_heavy", 24, 6, 2, 6, levels(4), true, true, {}));
  cases.push_back(solver_case("qb_solver_m8_n4_k1_all_equal", 8, 4, 1, 3, levels(1), true, true, {}));
  cases.push_back(solver_case("qb_solver_m12_n4_k3", 12, 4, 3, 6, dyadic(-1, 1, 8), true, true, {}));
  // Medium, iterates only.
  cases.push_back(solver_case("qb_solver_m128_n32_k4", 128, 32, 4, 8, dyadic(0, 1, 8), true, false, {}));
  // The K3 shape: 896 experts, top-16, 4480 tokens (q = 80; 4096 tokens would give q = 73.14).
  cases.push_back(solver_case("qb_solver_k3_m4480_n896_k16", 4480, 896, 16, 6,
                              json{{"kind", "low_rank"}, {"d", 16}}, false, false, {1, 6}));
  // Online: QB (bias of batch t routes t+1) against the sign update on the same batches.
  auto online = [&](const std::string& name, std::int64_t batches, std::int64_t m, std::int64_t n, std::int64_t k,
                    int bits, int iterations_per_batch) {
    json p = {{"batches", batches},
              {"m", m},
              {"n", n},
              {"k", k},
              {"affinity_bits", bits},
              {"routed_scaling_factor", {5, 2}},
              {"iterations_per_batch", iterations_per_batch},
              {"warm_start", true},
              {"center_bias", true},
              {"sign_gamma", {1, 256}},
              {"tie_rule", "biased desc, raw desc, expert index asc"}};
    cases.push_back(make_case(name, "qb.online", p));
  };
  online("qb_online_m32_n8_k2", 6, 32, 8, 2, 8, 1);
  online("qb_online_m48_n16_k4_tie_heavy", 6, 48, 16, 4, 3, 2);
  return cases;
}

}  // namespace

Family family_qb() {
  return {"qb",
          {{"qb.solver", generate_qb_solver, "exact (rational, or double proven exact)", {"qb-exact"}},
           {"qb.online", generate_qb_online, std::string(num::description(num::Tier::rational)), {"qb-exact"}}},
          qb_default_cases};
}

}  // namespace k3ref::golden
