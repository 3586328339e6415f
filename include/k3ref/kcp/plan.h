// Where the slices of a context-parallel (or intra-device) split sit relative to the
// documents of a packed sequence. Scalar-free: it only reads cu_seqlens and the split
// positions, so it lives in src/kcp/plan.cc.
//
// A split of T tokens over P ranks is P + 1 positions 0 = s_0 <= s_1 <= ... <= s_P = T;
// rank r holds tokens [s_r, s_{r+1}) (possibly none). Documents come from cu_seqlens
// (N + 1 positions, empty documents allowed); document n holds [cu_n, cu_{n+1}).
#pragma once

#include <cstdint>
#include <vector>

namespace k3ref::kcp {

// One rank's slice and what it needs to know about the documents it touches.
struct RankSlice {
  std::int64_t begin = 0, end = 0;  // tokens [begin, end)
  bool empty() const { return begin == end; }
  // Documents of the first and last token (-1 when the slice is empty).
  std::int64_t first_doc = -1, last_doc = -1;
  // The first document began on an earlier rank: the rank needs an entering state
  // from the scan. Otherwise its first document starts from its own initial state.
  bool continues = false;
  // Rank on which the first document began (== own index when !continues; -1 if empty).
  std::int64_t origin_rank = -1;
  // The last document goes on past `end`: the rank's state leaves it (forward) and a
  // state gradient comes back into it (backward).
  bool carries = false;
  // Start of the last document's part inside the slice: max(begin, cu[last_doc]).
  std::int64_t last_part_begin = 0;
  // End of the first document's part inside the slice: min(end, cu[first_doc + 1]).
  std::int64_t first_part_end = 0;
  // Local cu_seqlens of the slice (first entry 0, last end - begin): the slice's pieces
  // of documents first_doc, first_doc + 1, ..., last_doc, empty documents included.
  std::vector<std::int64_t> local_cu_seqlens;
};

struct Plan {
  std::int64_t T = 0;
  std::vector<std::int64_t> cu_seqlens;  // [N + 1]
  std::vector<std::int64_t> splits;      // [P + 1]
  std::vector<RankSlice> ranks;          // [P]
  std::int64_t num_docs() const { return static_cast<std::int64_t>(cu_seqlens.size()) - 1; }
  std::int64_t num_ranks() const { return static_cast<std::int64_t>(ranks.size()); }
};

// Document holding token t (0 <= t < T): the n with cu[n] <= t < cu[n + 1].
std::int64_t document_of(const std::vector<std::int64_t>& cu_seqlens, std::int64_t t);

// Validates cu_seqlens (starts at 0, non-decreasing) and splits (starts at 0, ends at
// cu.back(), non-decreasing); throws InvalidArgument naming the argument.
Plan plan_split(const std::vector<std::int64_t>& cu_seqlens, const std::vector<std::int64_t>& splits);

// P pieces of near-equal length (the first T mod P one token longer), each boundary
// rounded down to a multiple of `align` (a kernel's chunk size), as an intra-device
// planner would cut a prefill across SMs.
std::vector<std::int64_t> even_split(std::int64_t T, std::int64_t pieces, std::int64_t align = 1);

}  // namespace k3ref::kcp
