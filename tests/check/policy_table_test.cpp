// Tests of the policy table (policy/policies.json) and of the fail-closed judgement, on
// hand-derived inputs; the committed goldens are checked to be covered by the table. The
// Python package judges through this code (k3ref._core), so it needs no parity test.
#include "test_support.h"

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>

#include "k3ref/check/judgement.h"
#include "k3ref/check/metrics.h"
#include "k3ref/check/policy_table.h"
#include "k3ref/error.h"
#include "k3ref/io/safetensors.h"
#include "k3ref/num/float_format.h"

namespace k3ref::check {
namespace {

namespace fs = std::filesystem;

using test::source_root;

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The message of the InvalidArgument `f` throws ("" if it throws nothing).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

TEST(PolicyTable, BuiltInCopyIsTheSourceFile) {
  // The library compiles policy/policies.json in; a stale copy would judge by old rules.
  EXPECT_EQ(PolicyTable::builtin_text(), read_text(source_root() / "policy" / "policies.json"));
  EXPECT_NO_THROW(PolicyTable::builtin());
}

TEST(PolicyTable, EveryCommittedGoldenIsCoveredByTheTable) {
  const PolicyTable& table = PolicyTable::builtin();
  int files = 0;
  for (const auto& entry : fs::directory_iterator(source_root() / "goldens")) {
    if (entry.path().extension() != ".safetensors") continue;
    ++files;
    const io::SafetensorsFile f = io::read_safetensors(entry.path());
    const std::string name = entry.path().filename().string();
    const std::string op = f.metadata.at("k3ref.op");
    const OperatorSpec* spec = table.find_operator(op);
    ASSERT_NE(spec, nullptr) << name << ": operator " << op;
    const auto outputs = expand_outputs(f.metadata.at("k3ref.outputs"));
    for (const auto& out : outputs) {
      const OutputSpec* o = spec->find(out);
      ASSERT_NE(o, nullptr) << name << ": output " << out;
      // An integer golden tensor is judged exactly, a float one by a floor or bound.
      EXPECT_EQ(!o->dtype.has_value(), !is_floating(f.at(out, name).dtype)) << name << ": " << out;
    }
    for (const auto& [tensor, raw] : f.tensors) {
      if (std::find(outputs.begin(), outputs.end(), tensor) != outputs.end()) continue;
      EXPECT_NE(std::find(spec->inputs.begin(), spec->inputs.end(), tensor), spec->inputs.end())
          << name << ": input " << tensor << " is not in the table's inputs of " << op;
    }
    for (const auto& policy : table.policy_names()) {
      const auto ops = table.operators_of(policy);
      if (std::find(ops.begin(), ops.end(), op) == ops.end()) continue;
      EXPECT_EQ(table.rules(policy, op).size(), spec->outputs.size()) << policy << " " << op;
    }
  }
  EXPECT_GE(files, 60);
}

TEST(PolicyTable, NumbersOfTodaysPoliciesAreKept) {
  const PolicyTable& t = PolicyTable::builtin();
  auto rule = [&](const char* p, const char* op, const char* tensor) { return t.rules(p, op).at(tensor); };
  EXPECT_EQ(rule("recurrent", "kda.recurrent", "o").multiple, 1.5);
  EXPECT_EQ(rule("chunk", "kda.recurrent", "o").multiple, 4);
  EXPECT_EQ(rule("flashkda", "kda.recurrent", "o").multiple, 5);
  EXPECT_EQ(rule("fla-test", "kda.recurrent", "o").bound, 0.005);
  // The state is judged at the bf16 floor (as the GPU harness does), whatever its storage.
  EXPECT_EQ(rule("recurrent", "kda.recurrent", "final_state").floor_format, num::Format::bf16);
  // FLA's gradient thresholds, next to the output ones in the same policy.
  for (const char* g : {"dq", "dk", "dv", "d_initial_state"}) EXPECT_EQ(rule("fla-test", "kda.backward", g).bound, 0.008) << g;
  for (const char* g : {"dg", "dbeta", "dA_log", "ddt_bias"}) EXPECT_EQ(rule("chunk", "kda.backward", g).bound, 0.02) << g;
  EXPECT_EQ(rule("qb-exact", "qb.solver", "beta").ulps, 64);
  EXPECT_EQ(rule("qb-exact", "qb.solver", "selection").metric, RuleMetric::exact);
}

TEST(PolicyTable, ParametricPolicies) {
  const PolicyTable& t = PolicyTable::builtin();
  const auto r = t.rules("floor:2.5", "kda.recurrent");
  EXPECT_EQ(r.at("o").metric, RuleMetric::floor_multiple);
  EXPECT_EQ(r.at("o").multiple, 2.5);
  EXPECT_EQ(r.at("o").floor_format, num::Format::bf16);
  EXPECT_EQ(t.rules("rel-rms:1e-12", "kda.recurrent").at("o").bound, 1e-12);
  // Integer outputs are exact under every parametric policy.
  EXPECT_EQ(t.rules("floor:2", "qb.solver").at("loads").metric, RuleMetric::exact);
  for (const char* bad : {"floor:", "floor:x", "floor:-1", "rel-rms:0", "floor:1e400", "floor:0x10", "floor: 2",
                          "floor:inf", "floor:1_0", "nearly"})
    EXPECT_FALSE(error_of([&] { t.rules(bad, "kda.recurrent"); }).empty()) << bad;
  EXPECT_NE(error_of([&] { t.rules("qb-exact", "kda.recurrent"); }).find("has no rules for operator 'kda.recurrent'"),
            std::string::npos);
  EXPECT_NE(error_of([&] { t.rules("recurrent", "kda.nothing"); }).find("operator 'kda.nothing' is not in the policy table"),
            std::string::npos);
}

TEST(PolicyTable, MalformedTablesAreRejectedNamingTheEntry) {
  const nlohmann::json good = nlohmann::json::parse(PolicyTable::builtin_text());
  auto with = [&](auto&& edit) {
    nlohmann::json t = good;
    edit(t);
    return error_of([&] { PolicyTable::parse(t.dump(), "t.json"); });
  };
  EXPECT_NE(with([](auto& t) { t["version"] = 2; }).find("version 2 is not supported"), std::string::npos);
  EXPECT_NE(with([](auto& t) { t["extra"] = 1; }).find("unknown key 'extra'"), std::string::npos);
  EXPECT_NE(with([](auto& t) { t["policies"]["chunk"]["rules"]["kda.backward"].erase("dq"); })
                .find("policies.chunk.rules.kda.backward: no rule for 'dq' (give one for the tensor or for its role 'gradient')"),
            std::string::npos);
  EXPECT_NE(with([](auto& t) { t["policies"]["recurrent"]["rules"]["kda.recurrent"].erase("output"); })
                .find("policies.recurrent.rules.kda.recurrent: no rule for"),
            std::string::npos);
  EXPECT_NE(with([](auto& t) { t["policies"]["qb-exact"]["rules"]["qb.solver"]["loads"] = {{"metric", "floor"}, {"multiple", 2}}; })
                .find("an integer tensor takes the 'exact' metric"),
            std::string::npos);
  EXPECT_NE(with([](auto& t) { t["policies"]["recurrent"]["rules"]["kda.recurrent"]["output"]["multiple"] = -1; })
                .find("policies.recurrent.rules.kda.recurrent.output.multiple: must be a positive number"),
            std::string::npos);
  EXPECT_NE(with([](auto& t) { t["policies"]["recurrent"]["rules"]["kda.recurrent"]["output"]["bound"] = 1; })
                .find("'bound' does not apply to metric 'floor'"),
            std::string::npos);
  EXPECT_NE(with([](auto& t) { t["policies"]["recurrent"]["rules"]["kda.recurrent"]["output"]["metric"] = "close"; })
                .find("metric must be one of"),
            std::string::npos);
  EXPECT_NE(with([](auto& t) { t["policies"]["floor:3"] = {{"rules", nlohmann::json::object()}}; }).find("reserved"),
            std::string::npos);
  EXPECT_NE(with([](auto& t) { t["policies"]["recurrent"]["rules"]["kda.nothing"] = nlohmann::json::object(); })
                .find("no such operator"),
            std::string::npos);
  EXPECT_NE(with([](auto& t) { t["operators"]["kda.recurrent"]["outputs"]["o"]["dtype"] = "fp8"; }).find("dtype must be"),
            std::string::npos);
  EXPECT_NE(error_of([] { PolicyTable::parse("{", "t.json"); }).find("t.json: not valid JSON"), std::string::npos);
}

TEST(PolicyTable, ExpandOutputs) {
  using V = std::vector<std::string>;
  EXPECT_EQ(expand_outputs("o,final_state"), (V{"o", "final_state"}));
  EXPECT_EQ(expand_outputs("{qb,sign}_{bias,loads}"), (V{"qb_bias", "qb_loads", "sign_bias", "sign_loads"}));
  EXPECT_EQ(expand_outputs("a,{b,c}d,,e"), (V{"a", "bd", "cd", "e"}));
  for (const char* bad : {"{a,{b}}", "{a", "a}"}) EXPECT_FALSE(error_of([&] { expand_outputs(bad); }).empty()) << bad;
  // Bounded in names and in bytes: 2^40 names, or 1,000 names of 100 KB each, are refused.
  std::string doubling;
  for (int i = 0; i < 40; ++i) doubling += "{a,b}";
  EXPECT_NE(error_of([&] { expand_outputs(doubling); }).find("names (the limit)"), std::string::npos);
  std::string wide = "{0";
  for (int i = 1; i < 1000; ++i) wide += "," + std::to_string(i);
  wide += "}" + std::string(100000, 'x');
  EXPECT_NE(error_of([&] { expand_outputs(wide); }).find("bytes of names (the limit)"), std::string::npos);
}

// ---- judgements on hand-made tensors ------------------------------------------------------

NamedValues values(Shape shape, std::vector<double> v, std::string dtype = "F64") {
  return NamedValues{std::move(shape), std::move(v), std::move(dtype), true};
}

struct Case {
  JudgeRequest q;
  std::vector<std::pair<std::string, NamedValues>> candidate;

  CaseJudgement judge() {
    q.candidate_names.clear();
    for (const auto& [n, v] : candidate) q.candidate_names.push_back(n);
    q.candidate = [this](const std::string& name) {
      for (const auto& [n, v] : candidate)
        if (n == name) return v;
      throw std::logic_error("not a candidate tensor: " + name);
    };
    return judge_case(PolicyTable::builtin(), q);
  }
  const TensorJudgement& at(const CaseJudgement& j, const std::string& name) {
    for (const auto& t : j.tensors)
      if (t.tensor == name) return t;
    throw std::logic_error("no judgement of " + name);
  }
};

// kda.recurrent with o = final_state = (1 + 2^-9, 1): in bf16 1 + 2^-9 rounds to 1 (below
// half its ulp 2^-7), so the bf16 floor is 2^-9 / ||(1 + 2^-9, 1)||; in fp32 it is exact (floor 0).
const double a = 1 + std::ldexp(1.0, -9);
const double bf16_floor = std::sqrt(std::ldexp(1.0, -18) / (a * a + 1.0));

Case recurrent_case(const std::string& policy) {
  Case c;
  c.q.op = "kda.recurrent";
  c.q.policy = policy;
  c.q.expected = {{"o", values({1, 1, 1, 2}, {a, 1})}, {"final_state", values({1, 1, 1, 2}, {a, 1})}};
  c.q.known = {"q", "k", "v", "g", "beta"};
  return c;
}

// A golden holding NaN or Inf cannot vouch for anything (exit 2 under every rule); a candidate
// whose pairs are all non-finite is not judged to pass; exact tells -0.0 from 0.0.
TEST(Judgement, NonFiniteGoldensAndEmptyFiguresNeverPass) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (const char* policy : {"recurrent", "floor:2", "rel-rms:1e-3", "exact"}) {
    Case c = recurrent_case(policy);
    c.q.expected = {{"o", values({1, 1, 1, 2}, {nan, nan})}, {"final_state", values({1, 1, 1, 2}, {a, 1})}};
    c.candidate = {{"o", values({1, 1, 1, 2}, {nan, nan})}, {"final_state", values({1, 1, 1, 2}, {a, 1})}};
    const CaseJudgement j = c.judge();
    EXPECT_EQ(j.exit_code, 2) << policy << ": " << j.reason;
    EXPECT_NE(j.reason.find("the golden holds a non-finite value (first at flat index 0)"), std::string::npos)
        << j.reason;
  }
  Case z = recurrent_case("exact");
  z.q.expected = {{"o", values({1, 1, 1, 2}, {0.0, 1})}, {"final_state", values({1, 1, 1, 2}, {a, 1})}};
  z.candidate = {{"o", values({1, 1, 1, 2}, {-0.0, 1})}, {"final_state", values({1, 1, 1, 2}, {a, 1})}};
  const CaseJudgement j = z.judge();
  EXPECT_EQ(j.exit_code, 1);
  EXPECT_NE(z.at(j, "o").reason.find("0.0 against -0.0 at flat index 0"), std::string::npos) << z.at(j, "o").reason;
}

// A negated or doubled candidate against a golden of 1e-170 or 1e160 fails every rule.
TEST(Judgement, TinyAndHugeGoldensAreJudgedLikeOrdinaryOnes) {
  for (double magnitude : {1e-170, 1e160})
    for (const char* policy : {"floor:2", "rel-rms:1e-3"})
      for (double factor : {-1.0, 2.0}) {
        Case c = recurrent_case(policy);
        c.q.expected = {{"o", values({1, 1, 1, 2}, {magnitude, magnitude / 3})},
                        {"final_state", values({1, 1, 1, 2}, {a, 1})}};
        c.candidate = {{"o", values({1, 1, 1, 2}, {factor * magnitude, factor * magnitude / 3})},
                       {"final_state", values({1, 1, 1, 2}, {a, 1})}};
        const CaseJudgement j = c.judge();
        EXPECT_EQ(j.exit_code, 1) << magnitude << " " << policy << " x" << factor << ": " << j.reason;
      }
}

TEST(Judgement, FloorComesFromTheTableNotTheCandidatesDtype) {
  // An fp32 final state off by 2^-12 in its first element: 1/8 of the bf16 floor. Judged at
  // the fp32 floor (the candidate's dtype, zero here) it would fail every multiple.
  Case c = recurrent_case("recurrent");
  c.candidate = {{"o", values({1, 1, 1, 2}, {1, 1}, "BF16")},
                 {"final_state", values({1, 1, 1, 2}, {a + std::ldexp(1.0, -12), 1}, "F32")}};
  const CaseJudgement j = c.judge();
  EXPECT_EQ(j.exit_code, 0) << j.reason;
  const TensorJudgement& f = c.at(j, "final_state");
  EXPECT_EQ(f.floor_dtype, "bf16");
  EXPECT_EQ(f.floor, bf16_floor);
  EXPECT_EQ(f.bound, 1.5 * bf16_floor);
  EXPECT_EQ(f.ratio, f.rel_rms / bf16_floor);
  EXPECT_EQ(f.ratio, 0.125);  // measured: exact (2026-12-01)
  EXPECT_EQ(f.candidate_dtype, "F32");
  EXPECT_EQ(f.rule, "policies.recurrent.kda.recurrent.output");
  // o rounded to bf16 is exactly at the floor: ratio 1.
  EXPECT_EQ(c.at(j, "o").ratio, 1.0);
  EXPECT_EQ(c.at(j, "o").worst_index, (std::vector<std::int64_t>{0, 0, 0, 0}));
}

// A contract rule: rel RMS <= m x max(floor, contract error). With the contract 2^-6 off in
// the first element of o (8 bf16 floors), fla-chunk-contract's m = 2 bounds the error at
// 2^-5 / ||golden||: a candidate 2^-5 off is exactly at the bound (ratio 2), 2^-4 off fails
// (ratio 4). Every figure is a power of two times the same square root, so `==` holds.
TEST(Judgement, ContractRuleBoundsByTheContractsOwnError) {
  for (const auto& [off, passes] : {std::pair{std::ldexp(1.0, -5), true}, {std::ldexp(1.0, -4), false}}) {
    Case c = recurrent_case("fla-chunk-contract");
    c.q.tensors = std::vector<std::string>{"o"};
    c.q.contract_values = [](const std::string& contract, const std::string& tensor) -> std::optional<NamedValues> {
      if (contract != "fla_chunk" || tensor != "o") return std::nullopt;
      return values({1, 1, 1, 2}, {a + std::ldexp(1.0, -6), 1});
    };
    c.candidate = {{"o", values({1, 1, 1, 2}, {a + off, 1})}};
    const CaseJudgement j = c.judge();
    EXPECT_EQ(j.exit_code, passes ? 0 : 1) << j.reason;
    const TensorJudgement& o = c.at(j, "o");
    EXPECT_EQ(o.metric, "contract");
    EXPECT_EQ(o.contract, "fla_chunk");
    EXPECT_EQ(o.contract_error, std::sqrt(std::ldexp(1.0, -12) / (a * a + 1.0)));
    EXPECT_EQ(o.floor, bf16_floor);
    EXPECT_EQ(o.bound, 2 * o.contract_error);
    EXPECT_EQ(o.ratio, off / std::ldexp(1.0, -6));
  }
  // Without the contract's values, or with a non-finite contract, no verdict: unusable.
  Case none = recurrent_case("fla-chunk-contract");
  none.q.tensors = std::vector<std::string>{"o"};
  none.candidate = {{"o", values({1, 1, 1, 2}, {a, 1})}};
  CaseJudgement j = none.judge();
  EXPECT_EQ(j.exit_code, 2);
  EXPECT_NE(j.reason.find("the tensor of contract fla_chunk is not available here"), std::string::npos) << j.reason;
  none.q.contract_values = [](const std::string&, const std::string&) -> std::optional<NamedValues> {
    return values({1, 1, 1, 2}, {std::numeric_limits<double>::infinity(), 1});
  };
  j = none.judge();
  EXPECT_EQ(j.exit_code, 2);
  EXPECT_NE(j.reason.find("is not finite on these inputs"), std::string::npos) << j.reason;
}

// The one axis-naming rule: the table's axes; a varlen token as (sequence, position) from
// cu_seqlens (kda_varlen's: token 40 lies in [18, 50), sequence 3, position 22; token 1 in
// [1, 18): the empty sequence 1 is skipped); a v_first state's last two axes swapped.
TEST(Judgement, IndicesAreNamedByTheTablesAxes) {
  const auto& o_axes = PolicyTable::builtin().find_operator("kda.recurrent")->find("o")->axes;
  const auto& state_axes = PolicyTable::builtin().find_operator("kda.recurrent")->find("final_state")->axes;
  EXPECT_EQ(describe_index(o_axes, {0, 40, 1, 5}), "(batch 0, token 40, head 1, channel 5)");
  const std::vector<std::int64_t> cu{0, 1, 1, 18, 50, 50, 83};
  EXPECT_EQ(describe_index(o_axes, {0, 40, 1, 5}, cu), "(batch 0, sequence 3, position 22, head 1, channel 5)");
  EXPECT_EQ(describe_index(o_axes, {0, 1, 0, 0}, cu), "(batch 0, sequence 2, position 0, head 0, channel 0)");
  EXPECT_EQ(describe_index(state_axes, {1, 0, 2, 3}), "(sequence 1, head 0, k 2, v 3)");
  EXPECT_EQ(describe_index(state_axes, {1, 0, 2, 3}, {}, true), "(sequence 1, head 0, v 2, k 3)");
  EXPECT_EQ(describe_index(o_axes, {1, 2}), "(dim0 1, dim1 2)");  // the table's axes do not fit
  // The judgement carries the named index of the worst element.
  Case c = recurrent_case("floor:2");
  c.candidate = {{"o", values({1, 1, 1, 2}, {a, 2})}, {"final_state", values({1, 1, 1, 2}, {a, 1})}};
  EXPECT_EQ(c.at(c.judge(), "o").worst_at, "(batch 0, token 0, head 0, channel 1)");
}

TEST(Judgement, MissingRequiredOutputFails) {
  Case c = recurrent_case("floor:2");
  c.candidate = {{"o", values({1, 1, 1, 2}, {a, 1})}};
  const CaseJudgement j = c.judge();
  EXPECT_EQ(j.exit_code, 1);
  EXPECT_EQ(j.reason, "final_state: missing from the candidate (a required output)");
  EXPECT_EQ(c.at(j, "final_state").status, "missing");
  EXPECT_EQ(c.at(j, "o").status, "pass");
}

TEST(Judgement, UnknownNamesAreUnusable) {
  Case c = recurrent_case("floor:2");
  c.candidate = {{"o", values({1, 1, 1, 2}, {a, 1})}, {"final_sate", values({1, 1, 1, 2}, {a, 1})}};
  CaseJudgement j = c.judge();
  EXPECT_EQ(j.exit_code, 2);
  EXPECT_EQ(j.reason, "candidate tensor 'final_sate' is neither an output nor an input of the golden (outputs: o, final_state)");
  // An input the golden has (or the operator takes) is no unknown: candidate files may echo them.
  c.candidate = {{"o", values({1, 1, 1, 2}, {a, 1})}, {"final_state", values({1, 1, 1, 2}, {a, 1})},
                 {"q", values({1}, {0})}, {"cu_seqlens", values({1}, {0})}};
  EXPECT_EQ(c.judge().exit_code, 0);
  c.q.tensors = std::vector<std::string>{"o", "all_states"};
  j = c.judge();
  EXPECT_EQ(j.exit_code, 2);
  EXPECT_EQ(j.reason, "no output 'all_states' in the golden (outputs: o, final_state)");
  c.q.tensors.reset();
  c.q.expected.emplace_back("h", values({1}, {1}));
  EXPECT_EQ(c.judge().reason, "golden output 'h' of operator 'kda.recurrent' is not in the policy table");
}

TEST(Judgement, ShapeMismatchIsUnusableAndNaNFailsEveryRule) {
  Case c = recurrent_case("floor:100");
  c.candidate = {{"o", values({1, 1, 2, 1}, {a, 1})}, {"final_state", values({1, 1, 1, 2}, {a, 1})}};
  CaseJudgement j = c.judge();
  EXPECT_EQ(j.exit_code, 2);
  EXPECT_EQ(j.reason, "o: shape [1, 1, 2, 1] differs from the golden's [1, 1, 1, 2]");
  c.candidate[0].second = values({1, 1, 1, 2}, {std::numeric_limits<double>::quiet_NaN(), 1});
  for (const char* p : {"exact", "floor:100", "rel-rms:1", "recurrent", "fla-test"}) {
    c.q.policy = p;
    j = c.judge();
    EXPECT_EQ(j.exit_code, 1) << p;
    EXPECT_EQ(j.reason, "o: NaN/Inf where the golden has none (or the reverse), first at flat index 0") << p;
  }
}

TEST(Judgement, StagesAreOptionalButNothingJudgedFails) {
  Case c;
  c.q.op = "kda.chunkwise_fla";
  c.q.policy = "chunk";
  c.q.expected = {{"o", values({1}, {1})}, {"final_state", values({1}, {1})}, {"L", values({1}, {1})}};
  c.candidate = {{"o", values({1}, {1})}, {"final_state", values({1}, {1})}};
  CaseJudgement j = c.judge();
  EXPECT_EQ(j.exit_code, 0) << j.reason;
  EXPECT_EQ(c.at(j, "L").status, "skipped");
  EXPECT_EQ(c.at(j, "L").reason, "not in the candidate (an optional stage tensor)");
  // Asked for by name, a stage is required.
  c.q.tensors = std::vector<std::string>{"L"};
  EXPECT_EQ(c.judge().reason, "L: missing from the candidate (a required stage)");
  c.q.tensors.reset();
  c.q.expected = {{"L", values({1}, {1})}};
  c.candidate.clear();
  j = c.judge();
  EXPECT_EQ(j.exit_code, 1);
  EXPECT_EQ(j.reason, "no tensor was judged: the candidate holds none of the golden's outputs");
}

TEST(Judgement, SeparateThresholdsForOutputsAndGradientsInOneCall) {
  // Every gradient off by 1%: over FLA's 0.008 for dq, dk, dv, under its 0.02 for dg, dbeta.
  Case c;
  c.q.op = "kda.backward";
  c.q.policy = "fla-test";
  for (const char* g : {"dq", "dk", "dv", "dg", "dbeta"}) {
    c.q.expected.emplace_back(g, values({2}, {1, 0}));
    c.candidate.emplace_back(g, values({2}, {1.01, 0}));
  }
  const CaseJudgement j = c.judge();
  EXPECT_EQ(j.exit_code, 1);
  // (1, 0) is exact in bf16: the floor is 0 and no ratio is printed.
  EXPECT_EQ(j.reason, "dq: rel RMS 1.000e-02 > 8.000e-03 (bf16 floor 0.000e+00)");
  for (const char* g : {"dq", "dk", "dv"}) EXPECT_EQ(c.at(j, g).status, "fail") << g;
  for (const char* g : {"dg", "dbeta"}) EXPECT_EQ(c.at(j, g).status, "pass") << g;
  EXPECT_EQ(c.at(j, "dq").bound, 0.008);
  EXPECT_EQ(c.at(j, "dg").bound, 0.02);
  // Without dg the backward candidate fails however good the rest is.
  c.candidate = {{"dq", values({2}, {1, 0})}, {"dk", values({2}, {1, 0})}, {"dv", values({2}, {1, 0})}};
  EXPECT_EQ(c.judge().reason, "dg: missing from the candidate (a required gradient)");
}

TEST(Judgement, QuantileBalancingRules) {
  // beta: 64 fp32 ulps at max(1, max |beta|) = 2 is 64 x 2^-23 x 2 = 2^-16.
  Case c;
  c.q.op = "qb.solver";
  c.q.policy = "qb-exact";
  c.q.expected = {{"beta", values({2}, {2, 0})}, {"selection", values({2}, {3, 1})}};
  c.candidate = {{"beta", values({2}, {2 + std::ldexp(1.0, -16), 0}, "F32")}, {"selection", values({2}, {3, 1}, "I32")}};
  CaseJudgement j = c.judge();
  EXPECT_EQ(j.exit_code, 0) << j.reason;
  EXPECT_EQ(c.at(j, "beta").bound, std::ldexp(1.0, -16));
  c.candidate[0].second.values[0] = 2 + std::ldexp(1.0, -15);
  c.candidate[1].second.values = {1, 3};
  j = c.judge();
  EXPECT_EQ(c.at(j, "beta").status, "fail");
  EXPECT_EQ(c.at(j, "selection").reason, "not equal: max abs error 2.000e+00 at flat index 0");
}

TEST(Judgement, ReportsCarryEveryTensor) {
  Case c = recurrent_case("floor:2");
  c.candidate = {{"o", values({1, 1, 1, 2}, {1.5, 1})}};
  const CaseJudgement j = c.judge();
  const auto doc = nlohmann::json::parse(judgement_json(j, "g.safetensors", "c.safetensors"));
  EXPECT_EQ(doc["verdict"], "fail");
  EXPECT_EQ(doc["exit_code"], 1);
  EXPECT_EQ(doc["policy_table_version"], policy_table_version);
  ASSERT_EQ(doc["tensors"].size(), 2u);
  EXPECT_EQ(doc["tensors"][0]["status"], "fail");
  EXPECT_EQ(doc["tensors"][0]["worst_index"], (std::vector<int>{0, 0, 0, 0}));
  EXPECT_EQ(doc["tensors"][1]["status"], "missing");
  const std::string xml = judgement_junit(j, "case<1>");
  EXPECT_NE(xml.find("tests=\"2\" failures=\"2\" errors=\"0\" skipped=\"0\""), std::string::npos) << xml;
  EXPECT_NE(xml.find("k3ref.compare.case&lt;1&gt;"), std::string::npos) << xml;
  // An unusable run is one erroring testcase, never an empty (green) suite.
  const std::string bad = judgement_junit(unusable("kda.recurrent", "floor:2", "x: cannot open"), "c");
  EXPECT_NE(bad.find("tests=\"1\" failures=\"0\" errors=\"1\""), std::string::npos) << bad;
  EXPECT_EQ(nlohmann::json::parse(judgement_json(unusable("", "p", "why"), "g", "c"))["verdict"], "unusable");
}

RC_GTEST_PROP(Judgement, TheGoldenRoundedToTheContractDtypeIsExactlyAtTheFloor, (std::vector<std::int32_t> raw)) {
  // A kernel that rounds the exact result once to the contract dtype (bf16 for o and the
  // state) sits at the floor: its error IS the floor, summed in the same order, so the ratio
  // is exactly 1 (or both are 0), every element within half an ulp, whatever dtype stores it.
  RC_PRE(!raw.empty());
  std::vector<double> ref, rounded;
  for (std::int32_t v : raw) {
    ref.push_back((v % 100000) / 7.0);
    rounded.push_back(num::round_to(num::Format::bf16, ref.back()));
  }
  const Shape shape{1, static_cast<std::int64_t>(ref.size()), 1, 1};
  Case c;
  c.q.op = "kda.recurrent";
  c.q.expected = {{"o", values(shape, ref)}, {"final_state", values(shape, ref)}};
  c.candidate = {{"o", values(shape, rounded, "BF16")}, {"final_state", values(shape, rounded, "F32")}};
  for (const char* p : {"floor:1", "recurrent", "chunk"}) {
    c.q.policy = p;
    const CaseJudgement j = c.judge();
    RC_ASSERT(j.exit_code == 0);
    for (const auto& t : j.tensors) {
      RC_ASSERT(t.rel_rms == t.floor);
      RC_ASSERT(t.ratio == (t.floor > 0 ? 1.0 : 0.0));
      RC_ASSERT(t.max_ulp <= 0.5);
    }
  }
}

// Figures measured elsewhere (a device comparator's) judged by a rule: the verdict judge_case
// gives the same tensors. The fixture's bf16 candidate of recurrent_case: rel RMS = its floor.
TEST(Judgement, FiguresJudgedAloneGiveTheVerdictOfTheTensors) {
  Case c = recurrent_case("recurrent");
  const std::vector<double> rounded{1.0, 1.0};
  c.candidate = {{"o", values({1, 1, 1, 2}, rounded, "BF16")}, {"final_state", values({1, 1, 1, 2}, {a, 1})}};
  const CaseJudgement j = c.judge();
  const TensorJudgement& whole = c.at(j, "o");
  const TensorRule rule = PolicyTable::builtin().rules("recurrent", "kda.recurrent").at("o");
  TensorJudgement alone;
  alone.tensor = "o";
  judge_figures(alone, compare(rounded, {a, 1}, num::Format::bf16), rule);
  EXPECT_TRUE(whole.passed && alone.passed);
  EXPECT_EQ(alone.figure, bf16_floor);
  EXPECT_EQ(alone.bound, 1.5 * bf16_floor);
  EXPECT_EQ(alone.ratio, 1.0);
  EXPECT_EQ(alone.reason, whole.reason);
  EXPECT_EQ(alone.rule, whole.rule);
  // Twice the floor fails the 1.5x rule; a contract rule bounds by its error when larger.
  Metrics twice;
  twice.count = twice.finite_pairs = 2;
  twice.rel_rms = 2 * bf16_floor;
  twice.floor_rel_rms = bf16_floor;
  twice.max_abs = 1e-3;
  TensorJudgement over;
  judge_figures(over, twice, rule);
  EXPECT_FALSE(over.passed);
  EXPECT_EQ(over.ratio, 2.0);
  const TensorRule contract = PolicyTable::builtin().rules("fla-chunk-contract", "kda.recurrent").at("o");
  TensorJudgement within;
  judge_figures(within, twice, contract, 1.5 * bf16_floor);  // 2 x max(floor, 1.5 floor) = 3 floors
  EXPECT_TRUE(within.passed);
  EXPECT_EQ(within.bound, 2 * 1.5 * bf16_floor);
  EXPECT_EQ(within.contract_error, 1.5 * bf16_floor);
  // A finiteness mismatch fails whatever the figure.
  twice.first_nonfinite_mismatch = 1;
  TensorJudgement nonfinite;
  judge_figures(nonfinite, twice, contract, 1.5 * bf16_floor);
  EXPECT_FALSE(nonfinite.passed);
  EXPECT_NE(nonfinite.reason.find("first at flat index 1"), std::string::npos) << nonfinite.reason;
}

TEST(Agreement, TwoRunsAgreeWithinTheMultipleOfTheLargerOfFloorAndCarriedError) {
  // rel RMS 3e-3 against 2 x the nominal floor 2e-3: 3e-3 <= 4e-3, ratio 1.5.
  const Agreement a = judge_agreement(3e-3, -1, 2e-3, 0.0, 2.0);
  EXPECT_TRUE(a.passed);
  EXPECT_EQ(a.ratio, 3e-3 / 2e-3);
  EXPECT_EQ(a.reason, "not bitwise equal; rel RMS of the difference 3.000e-03 <= 2 x nominal floor 2.000e-03 (1.5x)");
  // A carried-state error above the floor is the scale: 3e-3 > 1 x 2.5e-3.
  const Agreement carried = judge_agreement(3e-3, -1, 2e-3, 2.5e-3, 1.0);
  EXPECT_FALSE(carried.passed);
  EXPECT_EQ(carried.ratio, 3e-3 / 2.5e-3);
  EXPECT_NE(carried.reason.find("> 1 x the carried-state error 2.500e-03 (above the nominal floor 2.000e-03)"),
            std::string::npos);
  // NaN/Inf in one run only fails, whatever the figure.
  const Agreement nonfinite = judge_agreement(0.0, 7, 2e-3, 0.0, 2.0);
  EXPECT_FALSE(nonfinite.passed);
  EXPECT_EQ(nonfinite.ratio, std::numeric_limits<double>::infinity());
  EXPECT_EQ(nonfinite.reason, "NaN/Inf in one run only, first at flat index 7");
  // No scale (values that round exactly): any difference fails, its ratio is infinite.
  EXPECT_FALSE(judge_agreement(1e-9, -1, 0.0, 0.0, 2.0).passed);
  EXPECT_EQ(judge_agreement(1e-9, -1, 0.0, 0.0, 2.0).ratio, std::numeric_limits<double>::infinity());
  // ... and no difference passes there at ratio 0.
  EXPECT_TRUE(judge_agreement(0.0, -1, 0.0, 0.0, 2.0).passed);
  EXPECT_EQ(judge_agreement(0.0, -1, 0.0, 0.0, 2.0).ratio, 0.0);
  // The least difference is named as the caller names it (a contract's own split difference).
  EXPECT_NE(judge_agreement(3e-3, -1, 2e-3, 2.5e-3, 2.0, "the contract's own difference")
                .reason.find("<= 2 x the contract's own difference 2.500e-03 (above the nominal floor 2.000e-03)"),
            std::string::npos);
}

}  // namespace
}  // namespace k3ref::check
