// io/kernel_domains.h: the built-in kernel domains (policy/kernel_domains.json), the verdict and
// reason a case gets (the words tests/python/test_kernel_domains.py asserts for the Python
// reader on the same cases), and malformed files refused naming the entry.
#include "k3ref/io/kernel_domains.h"

#include "test_support.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "golden/suite.h"
#include "k3ref/error.h"

namespace k3ref::io {
namespace {

using nlohmann::json;
using test::source_root;

std::string read_text(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string error_of(const std::string& text) {
  try {
    KernelDomains::parse(text, "d.json");
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

const json flashkda_case = {{"B", 1}, {"T", 40}, {"H", 2}, {"HV", 2}, {"K", 128}, {"V", 128},
                            {"gate", "lower_bound"}, {"gate_base", "2"}, {"lower_bound", -5.0}, {"A_log", true},
                            {"beta", "sigmoid"}, {"qk_l2norm", true}, {"state_layout", "k_first"},
                            {"cu_seqlens", nullptr}, {"initial_state", true}};

json with(json j, const char* key, json value) {
  j[key] = std::move(value);
  return j;
}

TEST(KernelDomains, BuiltInCopyParsesAndNamesEveryBuiltInKernel) {
  const auto& d = KernelDomains::builtin();
  EXPECT_EQ(d.names(), (std::vector<std::string>{"fla.chunk_kda",
                                                 "fla.chunk_kda[safe_gate]",
                                                 "fla.fused_recurrent_kda",
                                                 "flashkda.fwd",
                                                 "k3gc.fp32",
                                                 "k3gc.fp64_reference",
                                                 "sglang.fused_sigmoid_gating[decode]",
                                                 "sglang.fused_sigmoid_gating[gdn_decode]",
                                                 "sglang.fused_sigmoid_gating[target_verify]",
                                                 "tokenspeed.gdn_decode_step",
                                                 "tokenspeed.kda_chunk_prefill",
                                                 "tokenspeed.kda_mtp_verify",
                                                 "tokenspeed.kda_recurrent_decode_pool",
                                                 "torch.fp64_bf16",
                                                 "vllm.fused_recurrent_gdn[continuous_batching]",
                                                 "vllm.fused_recurrent_gdn[spec_decode]",
                                                 "vllm.gdn_replayssm_decode",
                                                 "vllm.kda_chunk_prefill",
                                                 "vllm.kda_decode"}));
  // The compiled copy is the source file's (parsed the same: a stale copy would select old goldens).
  const auto from_file = KernelDomains::parse(read_text(source_root() / "policy" / "kernel_domains.json"), "file");
  EXPECT_EQ(from_file.names(), d.names());
  EXPECT_EQ(d.find("nope"), nullptr);
}

TEST(KernelDomains, ReasonsNameTheFirstConstraintACaseBreaks) {
  const auto& d = KernelDomains::builtin();
  const KernelDomain& flashkda = *d.find("flashkda.fwd");
  const KernelDomain& safe_gate = *d.find("fla.chunk_kda[safe_gate]");
  EXPECT_EQ(flashkda.outside("kda.recurrent", flashkda_case, "bf16"), std::nullopt);
  EXPECT_EQ(flashkda.outside("kda.recurrent", with(flashkda_case, "K", 64), "bf16"), "K = 64: the kernel takes K = 128");
  EXPECT_EQ(flashkda.outside("kda.recurrent", with(flashkda_case, "HV", 4), "bf16"), "HV/H = 2: the kernel takes HV/H = 1");
  EXPECT_EQ(flashkda.outside("kda.recurrent", flashkda_case, "fp16"), "inputs fp16: the kernel takes inputs bf16");
  EXPECT_EQ(flashkda.outside("kda.recurrent", with(flashkda_case, "lower_bound", 0.0), "bf16"), std::nullopt);
  EXPECT_EQ(flashkda.outside("qb.solve", flashkda_case, "bf16"), "operator qb.solve: the kernel takes operator kda.recurrent");
  // [-5, 0): the bound -5 inside, 0 outside.
  EXPECT_EQ(safe_gate.outside("kda.recurrent", flashkda_case, "bf16"), std::nullopt);
  EXPECT_EQ(safe_gate.outside("kda.recurrent", with(flashkda_case, "lower_bound", 0.0), "bf16"),
            "lower_bound = 0: the kernel takes lower_bound in [-5, 0)");
  EXPECT_EQ(safe_gate.outside("kda.recurrent", with(flashkda_case, "gate", "softplus"), "bf16"),
            "gate softplus: the kernel takes gate lower_bound");
  EXPECT_EQ(safe_gate.outside("kda.recurrent", with(flashkda_case, "K", 512), "bf16"), "K = 512: the kernel takes K <= 256");
  EXPECT_EQ(d.find("fla.chunk_kda")->outside("kda.recurrent", with(with(flashkda_case, "gate", "softplus"), "A_log", false), "bf16"),
            "gate softplus without A_log: the kernel takes it with A_log");
}

// A KDA kernel: 12 KDA goldens inside its domain; a serving kernel (the engines' pool decode,
// verify, replay: operators named, kda.recurrent not among them): a golden of one of its operators.
TEST(KernelDomains, EveryBuiltInKernelHasGoldensInsideItsDomain) {
  for (const auto& k : KernelDomains::builtin().kernels) {
    const bool serving = k.ops && std::find(k.ops->begin(), k.ops->end(), "kda.recurrent") == k.ops->end();
    int inside = 0;
    for (const auto& c : golden::suite("default"))
      inside += (serving ? std::find(k.ops->begin(), k.ops->end(), c.op) != k.ops->end() : c.op == "kda.recurrent") &&
                !k.outside(c.op, c.params, "bf16");
    EXPECT_GE(inside, serving ? 1 : 12) << k.name;
  }
}

TEST(KernelDomains, MalformedFilesAreRefusedNamingTheEntry) {
  const json good = json::parse(read_text(source_root() / "policy" / "kernel_domains.json"));
  auto broken = [&](auto&& edit) {
    json j = good;
    edit(j);
    return error_of(j.dump());
  };
  EXPECT_EQ(error_of(good.dump()), "");
  EXPECT_NE(broken([](json& j) { j["version"] = 2; }).find("d.json: 'version' must be 1"), std::string::npos);
  EXPECT_NE(broken([](json& j) { j["kernels"]["flashkda.fwd"]["head_size"] = 1; })
                .find("d.json: kernels.flashkda.fwd: unknown key 'head_size'"), std::string::npos);
  EXPECT_NE(broken([](json& j) { j["kernels"]["flashkda.fwd"]["K"] = {{"in", {128}}, {"max", 128}}; })
                .find("kernels.flashkda.fwd.K: 'in' takes no bound beside it"), std::string::npos);
  EXPECT_NE(broken([](json& j) { j["kernels"]["flashkda.fwd"]["K"] = {{"max", "128"}}; })
                .find("kernels.flashkda.fwd.K.max: must be a finite number"), std::string::npos);
  EXPECT_NE(broken([](json& j) { j["kernels"]["fla.chunk_kda"]["gates"].push_back({{"form", "softplus"}}); })
                .find("kernels.fla.chunk_kda.gates[3]: gate 'softplus' listed twice"), std::string::npos);
  EXPECT_NE(broken([](json& j) { j["kernels"]["flashkda.fwd"]["betas"] = json::array(); })
                .find("kernels.flashkda.fwd.betas: must be a non-empty list"), std::string::npos);
  EXPECT_NE(broken([](json& j) { j["kernels"]["flashkda.fwd"].erase("about"); }).find("'about' must be a string"),
            std::string::npos);
  // The project's JSON rules: a duplicate key is refused, not silently the last one.
  const std::string text = read_text(source_root() / "policy" / "kernel_domains.json");
  std::string dup = text;
  dup.replace(dup.find("\"kernels\": {"), 12, "\"kernels\": {\"x\": {\"about\": \"\"}, \"x\": {\"about\": \"\"},");
  EXPECT_NE(error_of(dup).find("duplicate key 'x'"), std::string::npos) << error_of(dup);
}

}  // namespace
}  // namespace k3ref::io
