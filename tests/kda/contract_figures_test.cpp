// The contract figures the GPU harness judges by, held fixed across changes of the contract
// code: for every kernel contract, the relative RMS error of its o and final state against
// the recurrence in double (what the harness computes as "the contract's own error") on the
// inputs of every KDA recurrence golden and on 200 random bf16 problems per contract.
//
// tests/kda/contract_figures.json holds the figures the contracts gave when they were
// recorded (K3REF_WRITE_CONTRACT_FIGURES=<file> rewrites it; the record is only rewritten
// when a contract's model changes on purpose, with the reason in docs/contracts.md). A
// figure must agree to six significant digits; a case a contract refuses must still be
// refused.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "golden/kda_family.h"
#include "k3ref/check/metrics.h"
#include "k3ref/kda/kernel_contracts.h"
#include "k3ref/num/random.h"
#include "test_support.h"

namespace k3ref::kda {
namespace {

using contract::Kernel;

struct Problem {
  std::string name;
  Inputs<double> in;
  Options<double> opt;
};

// A random bf16 problem of the kind the harness's prop draws: small heads, one or several
// chunks, varlen sometimes, the lower-bound gate for FlashKDA (its domain), log decays else.
Problem random_problem(Kernel kernel, int index) {
  num::Random rng(0x6b337265660000ull + static_cast<std::uint64_t>(kernel) * 1000 + index);
  const std::int64_t T = rng.between(1, 96), H = rng.between(1, 2), HV = H * rng.between(1, 2);
  const std::int64_t K = 8 * rng.between(1, 4), V = 8 * rng.between(1, 4);
  auto draw = [&](const Shape& shape, double lo, double hi) { return test::bf16_tensor(rng, shape, lo, hi); };
  Problem p;
  p.name = std::string(contract::to_string(kernel)) + "/random_" + std::to_string(index);
  p.in.q = draw({1, T, H, K}, -1, 1);
  p.in.k = draw({1, T, H, K}, -1, 1);
  p.in.v = draw({1, T, HV, V}, -1, 1);
  p.in.beta = draw({1, T, HV}, -4, 4);
  p.opt.qk_l2norm = rng.between(0, 3) != 0;
  p.opt.beta = BetaForm::sigmoid;
  std::int64_t N = 1;
  if (T >= 8 && rng.between(0, 2) == 0) {
    const std::int64_t cut = rng.between(1, T - 1);
    p.in.cu_seqlens = std::vector<std::int64_t>{0, cut, T};
    N = 2;
  }
  if (kernel == Kernel::flashkda) {
    test::draw_lower_bound_gate(rng, p.in, p.opt, T, HV, K);
  } else {
    p.in.g = draw({1, T, HV, K}, -0.5, 0);
  }
  if (rng.between(0, 1) == 0) p.in.initial_state = draw({N, HV, K, V}, -1, 1);
  return p;
}

// FNV-1a over the bits of every value: tells a bitwise-identical evaluation from one that
// only agrees in its figures (printed, not required).
std::string bits_of(const Outputs<double>& out) {
  std::uint64_t h = 1469598103934665603ull;
  auto eat = [&](const Tensor<double>& t) {
    for (double x : t.values()) {
      std::uint64_t b;
      std::memcpy(&b, &x, sizeof b);
      for (int i = 0; i < 8; ++i) h = (h ^ ((b >> (8 * i)) & 0xff)) * 1099511628211ull;
    }
  };
  eat(out.o);
  if (out.final_state) eat(*out.final_state);
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(h));
  return text;
}

// {"<contract>|<problem>": {"o": e, "final_state": e} or {"refused": message}}
nlohmann::json figures() {
  std::vector<Problem> problems;
  for (const golden::Case& c : golden::suite("default"))
    if (c.op == "kda.recurrent" && !c.params.value("all_states", false))
      problems.push_back({c.name, golden::recurrence_inputs(c), golden::kda_double_options(c.params)});
  nlohmann::json out = nlohmann::json::object();
  for (const auto& k : contract::kernels.values) {
    std::vector<Problem> mine = problems;
    for (int i = 0; i < 200; ++i) mine.push_back(random_problem(k.value, i));
    const contract::KernelContract con = contract::kernel_contract(k.value);
    for (Problem& p : mine) {
      p.opt.num_threads = 1;
      nlohmann::json f;
      try {
        const Outputs<double> got = contract::evaluate_contract(con, p.in, p.opt);
        const Outputs<double> ref = recurrent_forward(p.in, p.opt);
        f["o"] = test::rel_rms(got.o, ref.o);
        if (ref.final_state) f["final_state"] = test::rel_rms(*got.final_state, *ref.final_state);
        f["bits"] = bits_of(got);
      } catch (const std::exception& e) {
        f["refused"] = e.what();
      }
      out[std::string(k.name) + "|" + p.name] = f;
    }
  }
  return out;
}

std::string record_path() {
  const char* root = std::getenv("K3REF_SOURCE_ROOT");
  return std::string(root ? root : ".") + "/tests/kda/contract_figures.json";
}

TEST(KdaContractFigures, EveryFigureIsTheRecordedOneToSixDigits) {
  const nlohmann::json now = figures();
  if (const char* out = std::getenv("K3REF_WRITE_CONTRACT_FIGURES")) {
    std::ofstream(out) << now.dump(1) << "\n";
    GTEST_SKIP() << "wrote " << now.size() << " figures to " << out;
  }
  std::ifstream in(record_path());
  ASSERT_TRUE(in) << "cannot read " << record_path();
  const nlohmann::json recorded = nlohmann::json::parse(in);
  ASSERT_EQ(recorded.size(), now.size());
  int compared = 0, refused = 0, bitwise = 0;
  double worst = 0;
  for (const auto& [key, r] : recorded.items()) {
    ASSERT_TRUE(now.contains(key)) << key;
    const nlohmann::json& n = now[key];
    if (r.contains("refused")) {
      EXPECT_TRUE(n.contains("refused")) << key << ": was refused (" << r["refused"] << "), now evaluates";
      ++refused;
      continue;
    }
    ASSERT_FALSE(n.contains("refused")) << key << ": now refused: " << n["refused"];
    bitwise += r.at("bits") == n.at("bits");
    for (const char* t : {"o", "final_state"}) {
      if (!r.contains(t)) continue;
      const double a = r[t].get<double>(), b = n.at(t).get<double>();
      const double d = a == b ? 0 : std::fabs(a - b) / std::fabs(a);
      worst = std::max(worst, d);
      EXPECT_LE(d, 5e-7) << key << " " << t << ": recorded " << a << ", now " << b;
      ++compared;
    }
  }
  std::printf("%d figures compared (%d cases refused as recorded), worst relative change %.3g; %d of %zu evaluations "
              "bit for bit the recorded ones\n",
              compared, refused, worst, bitwise, recorded.size() - refused);
}

}  // namespace
}  // namespace k3ref::kda
