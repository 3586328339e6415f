// The cost models' calculators behind `k3ref report decode|prefill|moe` and the Python
// package (docs/cost-models.md): each returns its figures as JSON, which the command prints
// as a table or as JSON.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

namespace k3ref::report {

struct DecodeQuery {
  std::int64_t head_dim = 128, heads = 1, tokens = 1;
};
// FLOPs and bytes of `tokens` decode steps of `heads` heads: 7 D^2 and 8 D^2 each.
nlohmann::ordered_json decode_report(const DecodeQuery&);

struct PrefillQuery {
  std::int64_t tokens = 4096, chunk = 16, head_dim = 128, heads = 1, kernels = 2;
};
// FlashKDA's prefill: per chunk 12 C^3 + 8 C^2 D + 6 C D^2 FLOP and 8 C^2 + 22 C D bytes,
// ceil(T / C) chunks, 8 D^2 bytes of state per kernel, per head.
nlohmann::ordered_json prefill_report(const PrefillQuery&);

struct MoeQuery {
  double bytes_per_element = 2, flops_per_second = 0, bytes_per_second = 0;
  std::int64_t intermediate = 3072, gpus = 8;
  std::int64_t experts = 0, top_k = 0, tokens = 0;  // of the simulated uniform dispatch (0: not simulated)
  // A measured routing: a golden's selection tensor [..., m, k] (every leading index one batch).
  std::optional<std::string> golden;
  std::string tensor = "selection";
};
// T_comm / T_comp = (P F) / (6 m B) (1 - 1/E) under uniform routing; with `experts` and
// `top_k`, the same from a simulated uniform dispatch; with `golden`, from its routing (the
// busiest GPU's remote routes received over its routes computed; tokens in contiguous blocks).
nlohmann::ordered_json moe_report(const MoeQuery&);

// The report as aligned "name  value" lines (nested objects indented).
std::string render_text(const nlohmann::ordered_json& report);

}  // namespace k3ref::report
