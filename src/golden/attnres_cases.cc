// The AttnRes goldens (ops attnres.full, attnres.block, attnres.phase1): parameters,
// deterministic bf16-exact inputs, the reference at golden precision (num::golden_bits)
// rounded once to F64.
#include <cmath>
#include <optional>
#include <string>

#include "k3ref/attnres/attnres.h"
#include "golden/catalogue.h"
#include "k3ref/num/float_format.h"
#include "k3ref/num/random.h"
#include "k3ref/num/scalar.h"

namespace k3ref::golden {
namespace {

using nlohmann::json;
using num::Format;

struct AttnResParams {
  std::int64_t L = 4, T = 2, d = 16;
  std::optional<std::int64_t> block_size;  // absent for attnres.full
  double eps = 1e-6;
  // Queries uniform in +-query_scale / sqrt(d), so scores w·key spread over a few units
  // (key = RMSNorm(x) has RMS about |g|); 0 gives the zero-initialised queries.
  double query_scale = 4;
  double norm_weight_lo = 0.5, norm_weight_hi = 1.5;
};

json to_json(const AttnResParams& p) {
  json j = {{"L", p.L}, {"T", p.T}, {"d", p.d}, {"eps", p.eps}, {"query_scale", p.query_scale},
            {"norm_weight_range", {p.norm_weight_lo, p.norm_weight_hi}}};
  j["block_size"] = p.block_size ? json(*p.block_size) : json(nullptr);
  return j;
}

AttnResParams from_json(const json& j) {
  AttnResParams p;
  p.L = j.at("L");
  p.T = j.at("T");
  p.d = j.at("d");
  if (!j.at("block_size").is_null()) p.block_size = j.at("block_size").get<std::int64_t>();
  p.eps = j.at("eps");
  p.query_scale = j.at("query_scale");
  p.norm_weight_lo = j.at("norm_weight_range")[0];
  p.norm_weight_hi = j.at("norm_weight_range")[1];
  return p;
}

// Uniform in [lo, hi], rounded to bf16: the stored value is exactly what the reference reads.
Tensor<double> draw(num::Random& rng, const Shape& shape, double lo, double hi) {
  return draw_uniform_rounded(rng, shape, lo, hi, Format::bf16);
}

struct Drawn {
  Tensor<double> values, queries, norm_weights;
};

Drawn make_inputs(const AttnResParams& p, std::uint64_t seed) {
  num::Random rng(seed);
  const double a = p.query_scale / std::sqrt(static_cast<double>(p.d));
  Drawn x;
  x.values = draw(rng, {p.L + 1, p.T, p.d}, -1, 1);
  x.queries = draw(rng, {p.L + 1, p.d}, -a, a);
  x.norm_weights = draw(rng, {p.L + 1, p.d}, p.norm_weight_lo, p.norm_weight_hi);
  return x;
}

io::SafetensorsFile generate_attnres(const Case& c) {
  const AttnResParams p = from_json(c.params);
  const Drawn in = make_inputs(p, c.seed);
  using G = num::golden_float;
  auto lift = [](const Tensor<double>& t) { return t.map<G>([](double x) { return G(x); }); };
  auto lower = [](const Tensor<G>& t) { return t.map<double>([](const G& x) { return num::to_double_rne(x); }); };
  const attnres::Weights<G> w{lift(in.queries), lift(in.norm_weights), G(p.eps)};
  const Tensor<G> values = lift(in.values);

  attnres::Outputs<G> out;
  std::string outputs = "h,alpha";
  if (c.op == "attnres.full") {
    out = attnres::full_forward(w, values);
  } else if (c.op == "attnres.block" || c.op == "attnres.phase1") {
    if (!p.block_size) throw InvalidArgument("golden " + c.name + ": " + c.op + " needs 'block_size'");
    const auto form = c.op == "attnres.block" ? attnres::BlockForm::direct : attnres::BlockForm::two_phase;
    out = attnres::block_forward(w, values, *p.block_size, form);
    outputs += ",block_sums";
    if (c.op == "attnres.phase1") outputs += ",phase1_output,phase1_max,phase1_sum";
  } else {
    throw InvalidArgument("golden " + c.name + ": not an AttnRes op: " + c.op);
  }

  io::SafetensorsFile file;
  file.tensors.emplace_back("values", io::from_f64(in.values, DType::BF16));
  file.tensors.emplace_back("queries", io::from_f64(in.queries, DType::BF16));
  file.tensors.emplace_back("norm_weights", io::from_f64(in.norm_weights, DType::BF16));
  file.tensors.emplace_back("h", io::from_f64(lower(out.h), DType::F64));
  file.tensors.emplace_back("alpha", io::from_f64(lower(out.alpha), DType::F64));
  if (out.block_sums) file.tensors.emplace_back("block_sums", io::from_f64(lower(*out.block_sums), DType::F64));
  if (c.op == "attnres.phase1") {
    file.tensors.emplace_back("phase1_output", io::from_f64(lower(*out.phase1_output), DType::F64));
    file.tensors.emplace_back("phase1_max", io::from_f64(lower(*out.phase1_max), DType::F64));
    file.tensors.emplace_back("phase1_sum", io::from_f64(lower(*out.phase1_sum), DType::F64));
  }
  file.metadata = metadata_of(c, golden_float_precision(), file, outputs);
  return file;
}

std::vector<Case> attnres_default_cases() {
  std::vector<Case> cases;
  auto add = [&](const std::string& name, const std::string& op, auto&& configure) {
    AttnResParams p;
    configure(p);
    cases.push_back(make_case(name, op, to_json(p)));
  };
  // Full AttnRes: every layer attends over every earlier layer output.
  add("attnres_full_l8", "attnres.full", [](AttnResParams& p) { p.L = 8; p.T = 3; p.d = 64; });
  // Block AttnRes with a remainder block (4 + 4 + 4 + 2), odd width.
  add("attnres_block_remainder", "attnres.block", [](AttnResParams& p) { p.L = 14; p.block_size = 4; p.T = 3; p.d = 96; });
  // Zero-initialised queries: every weight is uniform.
  add("attnres_block_zero_queries", "attnres.block",
      [](AttnResParams& p) { p.L = 10; p.block_size = 4; p.T = 2; p.d = 32; p.query_scale = 0; });
  // Large queries: scores of tens of units, nearly one-hot weights (the max subtraction matters).
  add("attnres_block_peaked", "attnres.block",
      [](AttnResParams& p) { p.L = 12; p.block_size = 3; p.T = 2; p.d = 64; p.query_scale = 64; });
  // K3-like: blocks of 12 layers (attention and MLP sublayers counted apart), d = 1024.
  add("attnres_block_k3_like", "attnres.block", [](AttnResParams& p) { p.L = 36; p.block_size = 12; p.T = 2; p.d = 1024; });
  // Phase-1 statistics (o, m, l) of every layer against its completed blocks, and the merged h.
  add("attnres_phase1_k3_like", "attnres.phase1", [](AttnResParams& p) { p.L = 24; p.block_size = 12; p.T = 2; p.d = 512; });
  add("attnres_phase1_remainder", "attnres.phase1", [](AttnResParams& p) { p.L = 7; p.block_size = 3; p.T = 2; p.d = 48; });
  return cases;
}

}  // namespace

Family family_attnres() {
  return {"attnres",
          {{"attnres.full", generate_attnres, golden_float_precision(), {"liger-attnres"}},
           {"attnres.block", generate_attnres, golden_float_precision(), {"liger-attnres"}},
           {"attnres.phase1", generate_attnres, golden_float_precision(), {"liger-attnres"}}},
          attnres_default_cases};
}

}  // namespace k3ref::golden
