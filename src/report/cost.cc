#include "report/cost.h"

#include <cstdio>

#include "k3ref/cost/models.h"
#include "k3ref/error.h"
#include "k3ref/io/safetensors.h"
#include "k3ref/tensor/convert.h"

namespace k3ref::report {
namespace {

using json = nlohmann::ordered_json;

void require_positive(std::int64_t v, const char* name) {
  if (v < 1) throw InvalidArgument(std::string("report: argument '") + name + "': must be at least 1");
}

json work_json(const cost::Work<double>& w) {
  return {{"flops", w.flops}, {"bytes", w.bytes}, {"flops_per_byte", w.intensity()}};
}

// The selection of one batch, [m, k], from a [..., m, k] tensor.
Tensor<std::int32_t> batch_selection(const Tensor<std::int64_t>& all, std::int64_t b) {
  const std::int64_t m = all.dim(all.rank() - 2), k = all.dim(all.rank() - 1);
  Tensor<std::int32_t> sel({m, k});
  for (std::int64_t e = 0; e < m * k; ++e) sel.data()[e] = static_cast<std::int32_t>(all.data()[b * m * k + e]);
  return sel;
}

}  // namespace

json decode_report(const DecodeQuery& q) {
  require_positive(q.head_dim, "head_dim");
  require_positive(q.heads, "heads");
  require_positive(q.tokens, "tokens");
  const auto one = cost::decode_per_head<double>(q.head_dim);
  const double n = static_cast<double>(q.heads) * static_cast<double>(q.tokens);
  return {{"model", "decode"},
          {"head_dim", q.head_dim},
          {"heads", q.heads},
          {"tokens", q.tokens},
          {"per_head_and_token", work_json(one)},
          {"total", work_json({one.flops * n, one.bytes * n})}};
}

json prefill_report(const PrefillQuery& q) {
  require_positive(q.tokens, "tokens");
  require_positive(q.chunk, "chunk");
  require_positive(q.head_dim, "head_dim");
  require_positive(q.heads, "heads");
  const auto chunk = cost::flashkda_chunk_per_head<double>(q.chunk, q.head_dim);
  const auto head = cost::flashkda_prefill_per_head<double>(q.tokens, q.chunk, q.head_dim, q.kernels);
  const double h = static_cast<double>(q.heads);
  return {{"model", "flashkda_prefill"},
          {"tokens", q.tokens},
          {"chunk", q.chunk},
          {"chunks", (q.tokens + q.chunk - 1) / q.chunk},
          {"head_dim", q.head_dim},
          {"heads", q.heads},
          {"kernels", q.kernels},
          {"per_chunk_and_head", work_json(chunk)},
          {"per_head", work_json(head)},
          {"total", work_json({head.flops * h, head.bytes * h})}};
}

json moe_report(const MoeQuery& q) {
  require_positive(q.gpus, "gpus");
  require_positive(q.intermediate, "intermediate");
  if (!(q.bytes_per_element > 0) || !(q.flops_per_second > 0) || !(q.bytes_per_second > 0))
    throw InvalidArgument("report moe: bytes per element, FLOP/s and bytes/s must be positive");
  const double P = q.bytes_per_element, F = q.flops_per_second, B = q.bytes_per_second,
               m = static_cast<double>(q.intermediate);
  json r = {{"model", "moe_comm_comp"},
            {"bytes_per_element", P},
            {"flops_per_second", F},
            {"bytes_per_second", B},
            {"intermediate", q.intermediate},
            {"gpus", q.gpus},
            {"uniform_ratio", cost::moe_comm_comp_ratio_uniform(P, F, m, B, static_cast<double>(q.gpus))}};
  if (q.experts > 0 && q.top_k > 0) {
    std::vector<std::int64_t> source;
    const std::int64_t repeats = std::max<std::int64_t>(1, q.tokens / (q.gpus * q.experts));
    const auto sel = cost::uniform_selection(q.experts, q.gpus, q.top_k, repeats, source);
    r["simulated_uniform"] = {{"experts", q.experts}, {"top_k", q.top_k}, {"tokens", sel.dim(0)},
                              {"ratio", cost::moe_comm_comp_ratio(cost::moe_dispatch(sel, q.experts, q.gpus, source), P, F, m, B)}};
  }
  if (q.golden) {
    const io::SafetensorsFile file = io::read_safetensors(*q.golden);
    const io::RawTensor* raw = nullptr;
    for (const auto& [name, t] : file.tensors)
      if (name == q.tensor) raw = &t;
    if (!raw) throw InvalidArgument("report moe: " + *q.golden + " has no tensor '" + q.tensor + "'");
    const Tensor<std::int64_t> all = to_i64(*raw, q.tensor);
    if (all.rank() < 2) throw InvalidArgument("report moe: tensor '" + q.tensor + "' must be [..., m, k]");
    std::int64_t experts = q.experts;
    if (experts == 0 && file.metadata.count("k3ref.params")) {
      const auto params = nlohmann::json::parse(file.metadata.at("k3ref.params"));
      if (params.contains("n")) experts = params.at("n").get<std::int64_t>();
    }
    if (experts < 1) throw InvalidArgument("report moe: --experts is needed (the golden's parameters have no 'n')");
    const std::int64_t tokens = all.dim(all.rank() - 2), k = all.dim(all.rank() - 1), batches = all.numel() / (tokens * k);
    json per_batch = json::array();
    for (std::int64_t b = 0; b < batches; ++b) {
      const auto sel = batch_selection(all, b);
      const auto c = cost::moe_dispatch(sel, experts, q.gpus, cost::block_sources(tokens, q.gpus));
      const double ratio = cost::moe_comm_comp_ratio(c, P, F, m, B);
      per_batch.push_back({{"batch", b},
                           {"ratio", ratio},
                           {"busiest_routes", *std::max_element(c.routes_in.begin(), c.routes_in.end())},
                           {"busiest_remote_routes", *std::max_element(c.remote_in.begin(), c.remote_in.end())},
                           {"uniform_routes", static_cast<double>(tokens * k) / static_cast<double>(q.gpus)}});
    }
    r["measured"] = {{"golden", *q.golden}, {"tensor", q.tensor}, {"experts", experts}, {"tokens", tokens}, {"top_k", k},
                     {"batches", per_batch}};
  }
  return r;
}

namespace {
using json = nlohmann::ordered_json;
void render(const json& j, const std::string& indent, std::string& out) {
  for (const auto& [key, v] : j.items()) {
    if (v.is_object()) {
      out += indent + key + "\n";
      render(v, indent + "  ", out);
    } else if (v.is_array()) {
      for (std::size_t i = 0; i < v.size(); ++i) {
        out += indent + key + "[" + std::to_string(i) + "]\n";
        render(v[i], indent + "  ", out);
      }
    } else {
      char line[256];
      const std::string value = v.is_number_float() ? [&] {
        char b[64];
        std::snprintf(b, sizeof b, "%.6g", v.get<double>());
        return std::string(b);
      }()
                                                    : (v.is_string() ? v.get<std::string>() : v.dump());
      std::snprintf(line, sizeof line, "%s%-*s %s\n", indent.c_str(), static_cast<int>(24 - indent.size()), key.c_str(), value.c_str());
      out += line;
    }
  }
}
}  // namespace

std::string render_text(const json& report) {
  std::string out;
  render(report, "", out);
  return out;
}

}  // namespace k3ref::report
