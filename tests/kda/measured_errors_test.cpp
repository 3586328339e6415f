// The double tiers of KDA on every committed recurrence golden, held to the measured errors
// in tests/kda/measured_errors.json (Boost.Math's habit: a table of the errors measured when
// the code was known good, and a test that fails beyond a small stated factor of them).
// Tiers: on the recurrence goldens, "double" = kda::recurrent_forward in double and
// "double_chunkwise_fla" = the FLA chunkwise form (C = 64) in double; on the chunkwise stage
// goldens, "double_chunkwise" = the golden's own form and chunk size in double, every stage
// tensor. All against the goldens' 256-bit values rounded to double. A failure names the
// worst element by its (batch, token, head, channel) index.
//
// Regenerate the table after a deliberate change (and say why in the commit):
//   K3REF_MEASURED_ERRORS_OUT=tests/kda/measured_errors.json build/tests/kda_measured_errors_test
#include "test_support.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <map>
#include <optional>
#include <string>

#include "k3ref/check/metrics.h"
#include "golden/kda_family.h"
#include "k3ref/io/safetensors.h"
#include "k3ref/kda/chunkwise.h"
#include "k3ref/kda/kda_io.h"
#include "k3ref/kda/recurrent.h"
#include "k3ref/tensor/convert.h"

namespace k3ref::kda {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// A measured figure may grow by this factor (other compilers' or libms' exp and sqrt round
// differently) before the test fails; below one rounding (2^-53 relative, 1 ulp) the table
// entry counts as that rounding.
constexpr double kFactor = 2.0;
constexpr double kRelRmsFloor = 0x1p-53;
constexpr double kUlpFloor = 1.0;

using test::source_root;

// The named index of flat element `flat` of an output of the case.
std::string element_name(const std::string& tensor, const Shape& shape, std::int64_t flat, bool v_first) {
  std::vector<std::string> axes;
  const char* row = v_first ? "value" : "key";
  const char* column = v_first ? "key" : "value";
  if (tensor == "final_state") axes = {"sequence", "head", row, column};
  else if (tensor == "chunk_states") axes = {"chunk", "head", row, column};
  else if (tensor == "all_states") axes = {"batch", "token", "head", row, column};
  else axes = {"batch", "token", "head", "channel"};  // o and the per-token stage tensors
  std::vector<std::int64_t> at(shape.size());
  for (std::size_t d = shape.size(); d-- > 0;) {
    at[d] = flat % shape[d];
    flat /= shape[d];
  }
  std::string s = "(";
  for (std::size_t d = 0; d < at.size(); ++d)
    s += (d ? ", " : "") + (d < axes.size() ? axes[d] : "dim") + " " + std::to_string(at[d]);
  return s + ")";
}

struct Measured {
  double rel_rms, max_ulp;
  std::string worst;  // the element of the largest ulp distance, named
};

Measured measure(const std::string& tensor, const Tensor<double>& mine, const Tensor<double>& ref, bool v_first) {
  const check::Metrics m = check::compare(mine.values(), ref.values(), num::Format::fp64);
  Measured r{m.rel_rms, m.max_ulp, "-"};
  if (m.max_ulp_index >= 0) {
    char values[96];
    std::snprintf(values, sizeof values, ": %.17g vs %.17g", mine.data()[m.max_ulp_index], ref.data()[m.max_ulp_index]);
    r.worst = element_name(tensor, ref.shape(), m.max_ulp_index, v_first) + values;
  }
  return r;
}

TEST(KdaMeasuredErrors, DoubleTiersStayWithinTheMeasuredTable) {
  const fs::path goldens = source_root() / "goldens";
  const fs::path table_path = source_root() / "tests" / "kda" / "measured_errors.json";
  const char* out_path = std::getenv("K3REF_MEASURED_ERRORS_OUT");
  json table;
  if (!out_path) {
    std::ifstream in(table_path);
    ASSERT_TRUE(in) << "cannot read " << table_path;
    table = json::parse(in);
  }
  json measured = {{"factor", kFactor}, {"cases", json::object()}};
  const json manifest = json::parse(std::ifstream(goldens / "MANIFEST.json"));
  int cases = 0;
  std::printf("%-34s %-22s %-12s %11s %9s  worst element\n", "case", "tier", "tensor", "rel RMS", "max ulp");
  for (const json& c : manifest.at("cases")) {
    const std::string op = c.at("op");
    const bool chunk_case = op == "kda.chunkwise_flashkda" || op == "kda.chunkwise_fla";
    if (op != "kda.recurrent" && !chunk_case) continue;
    ++cases;
    const std::string name = c.at("name");
    const io::SafetensorsFile file = io::read_safetensors(goldens / c.at("file").get<std::string>());
    const Inputs<double> in = inputs_from_file(file, name);
    Options<double> opt = golden::kda_double_options(c.at("params"));
    const bool v_first = opt.state_layout == StateLayout::v_first;
    struct Row {
      const char* tier;
      std::string tensor;
      const Tensor<double>* mine;
    };
    std::vector<Row> rows;
    std::optional<Outputs<double>> recurrent;
    std::optional<ChunkwiseOutputs<double>> chunked;
    if (!chunk_case) {
      recurrent = recurrent_forward(in, opt);
      opt.output_all_states = false;
      ChunkwiseOptions fla;
      fla.form = ChunkForm::fla;
      chunked = chunkwise_forward(in, opt, fla);
      rows = {{"double", "o", &recurrent->o}, {"double", "final_state", &*recurrent->final_state}};
      if (recurrent->all_states && file.find("all_states"))
        rows.push_back({"double", "all_states", &*recurrent->all_states});
      rows.push_back({"double_chunkwise_fla", "o", &chunked->out.o});
      rows.push_back({"double_chunkwise_fla", "final_state", &*chunked->out.final_state});
    } else {
      ChunkwiseOptions copt;
      copt.form = op == "kda.chunkwise_fla" ? ChunkForm::fla : ChunkForm::flashkda;
      copt.chunk_size = c.at("params").at("chunk_size");
      copt.record_stages = true;
      opt.output_all_states = false;
      chunked = chunkwise_forward(in, opt, copt);
      const ChunkStages<double>& st = *chunked->stages;
      const std::map<std::string, const Tensor<double>*> by_name{
          {"o", &chunked->out.o}, {"final_state", &*chunked->out.final_state}, {"decay", &st.decay},
          {"q_decay", &st.q_decay}, {"k_decay", &st.k_decay}, {"k_inv", &st.k_inv}, {"k_restore", &st.k_restore},
          {"L", &st.L}, {"INV", &st.inv}, {"M_qk", &st.m_qk}, {"w", &st.w}, {"u_pre", &st.u_pre}, {"u", &st.u},
          {"chunk_states", &st.chunk_states}};
      std::string outputs = file.metadata.at("k3ref.outputs") + ",";
      for (std::size_t at; (at = outputs.find(',')) != std::string::npos; outputs.erase(0, at + 1)) {
        const std::string tensor = outputs.substr(0, at);
        const auto it = by_name.find(tensor);
        if (it == by_name.end()) {
          ADD_FAILURE() << name << ": output '" << tensor << "' has no double counterpart in ChunkStages";
          continue;
        }
        rows.push_back({"double_chunkwise", tensor, it->second});
      }
    }
    for (const Row& row : rows) {
      const Tensor<double> ref = io::to_f64(file.at(row.tensor, name), name);
      const Measured m = measure(row.tensor, *row.mine, ref, v_first);
      std::printf("%-34s %-22s %-12s %11.3e %9.1f  %s\n", name.c_str(), row.tier, row.tensor.c_str(), m.rel_rms, m.max_ulp,
                  m.worst.c_str());
      measured["cases"][name][row.tier][row.tensor] = {{"rel_rms", m.rel_rms}, {"max_ulp", m.max_ulp}};
      if (out_path) continue;
      const json* entry = nullptr;
      if (table["cases"].contains(name) && table["cases"][name].contains(row.tier) &&
          table["cases"][name][row.tier].contains(row.tensor))
        entry = &table["cases"][name][row.tier][row.tensor];
      if (!entry) {
        ADD_FAILURE() << name << " " << row.tier << " " << row.tensor << ": no entry in " << table_path
                      << " (regenerate it with K3REF_MEASURED_ERRORS_OUT)";
        continue;
      }
      const double rel_bound = kFactor * std::max(entry->at("rel_rms").get<double>(), kRelRmsFloor);
      const double ulp_bound = kFactor * std::max(entry->at("max_ulp").get<double>(), kUlpFloor);
      EXPECT_LE(m.rel_rms, rel_bound) << name << " " << row.tier << " " << row.tensor << ": relative RMS error "
                                      << m.rel_rms << " > " << kFactor << " x measured " << entry->at("rel_rms")
                                      << "; worst element " << m.worst;
      EXPECT_LE(m.max_ulp, ulp_bound) << name << " " << row.tier << " " << row.tensor << ": " << m.max_ulp
                                      << " ulps > " << kFactor << " x measured " << entry->at("max_ulp")
                                      << " at " << m.worst;
    }
  }
  EXPECT_GT(cases, 0) << "no KDA recurrence or chunkwise case in " << goldens / "MANIFEST.json";
  if (out_path) {
    std::ofstream(out_path) << measured.dump(1) << "\n";
    std::printf("wrote %s\n", out_path);
  } else {
    EXPECT_EQ(table["cases"].size(), measured["cases"].size()) << "the table lists cases the suite no longer has";
  }
}

}  // namespace
}  // namespace k3ref::kda
