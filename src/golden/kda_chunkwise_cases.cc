// Stage goldens of the chunkwise KDA forms ("kda.chunkwise_flashkda", C = 16, and
// "kda.chunkwise_fla", C = 64). Each case reuses the inputs of a recurrence case of the
// catalogue (drawn in memory from that case's parameters and seed, so the same bytes as its
// file holds), runs the chunk algorithm at
// golden precision with every stage recorded, and stores the stage tensors beside o and
// final_state, so a kernel's prepare stage can be checked apart from its recurrence.
#include <string>

#include "golden/kda_family.h"
#include "k3ref/kda/chunkwise.h"
#include "k3ref/kda/kda_io.h"
#include "k3ref/num/float_format.h"
#include "k3ref/num/scalar.h"

namespace k3ref::golden {
namespace {

using nlohmann::json;
using G = num::golden_float;

io::SafetensorsFile generate_kda_chunkwise(const Case& c) {
  const json& kda_params = c.params;  // the KDA keys sit beside the chunk parameters
  const kda::Inputs<double> in = recurrence_inputs(recurrence_case(c.params.at("base_case").get<std::string>(), "chunkwise case " + c.name));

  kda::ChunkwiseOptions copt;
  copt.form = kda::chunk_forms.parse(c.params.at("form").get<std::string>());
  copt.chunk_size = c.params.at("chunk_size");
  copt.sub_chunk = c.params.at("sub_chunk");
  copt.record_stages = true;
  const auto exact = kda::chunkwise_forward(kda::lift<G>(in), kda_golden_options(kda_params), copt);
  const auto& st = *exact.stages;

  io::SafetensorsFile file;
  add_kda_inputs(file, in);
  kda::Outputs<double> out;
  out.o = round_to_double(exact.out.o);
  out.final_state = round_to_double(*exact.out.final_state);
  kda::add_outputs(file, out);
  std::string names = "o,final_state";
  kda::for_each_stage(st, [&](const char* name, const Tensor<G>& t) {
    file.tensors.emplace_back(name, io::from_f64(round_to_double(t), DType::F64));
    names += std::string(",") + name;
  });
  file.tensors.emplace_back("chunk_starts", io::from_i64(st.chunk_starts, DType::I64));
  file.metadata = metadata_of(c, golden_float_precision(), file, names, "chunk_starts");
  return file;
}

std::vector<Case> kda_chunkwise_default_cases() {
  // A handful of recurrence cases: T not a multiple of C, batch, varlen with GVA, decays at
  // the safe-gate bound -5 (inverse decays near exp(80)), FlashKDA's base-2 lower-bound gate.
  // (kda_flashkda_like, K = 128, would alone take 3.7 MB of stages; its gate is covered by
  // kda_gate_lower_bound_base2.) About 3 MB in all.
  const std::vector<std::string> flashkda_bases = {"kda_b2_t37", "kda_varlen_gva", "kda_decay_at_minus5",
                                                   "kda_gate_lower_bound_base2"};
  const std::vector<std::string> fla_bases = {"kda_varlen_gva", "kda_t100", "kda_decay_minus5_to_0"};
  std::vector<Case> cases;
  auto add = [&](const std::string& base_name, const char* form, std::int64_t C) {
    const Case base = recurrence_case(base_name, "a chunkwise case");
    // The base case's KDA parameters and, beside them, the chunk form's.
    json params = base.params;
    params["base_case"] = base_name;
    params["form"] = form;
    params["chunk_size"] = C;
    params["sub_chunk"] = 16;
    cases.push_back(make_case("kda_chunkwise_" + std::string(form) + "_c" + std::to_string(C) + base_name.substr(3),
                              std::string("kda.chunkwise_") + form, params));
  };
  for (const auto& b : flashkda_bases) add(b, "flashkda", 16);
  for (const auto& b : fla_bases) add(b, "fla", 64);
  return cases;
}

}  // namespace

Family family_kda_chunkwise() {
  return {"kda_chunkwise",
          {{"kda.chunkwise_flashkda", generate_kda_chunkwise, golden_float_precision(), {"flashkda"}},
           {"kda.chunkwise_fla", generate_kda_chunkwise, golden_float_precision(), {"chunk"}}},
          kda_chunkwise_default_cases};
}

}  // namespace k3ref::golden
