#include "k3ref/kcp/plan.h"

#include <algorithm>
#include <string>

#include "k3ref/error.h"

namespace k3ref::kcp {

std::int64_t document_of(const std::vector<std::int64_t>& cu, std::int64_t t) {
  // The last n with cu[n] <= t; empty documents before it share its start and are skipped.
  const auto it = std::upper_bound(cu.begin(), cu.end(), t);
  if (it == cu.begin() || it == cu.end())
    throw InvalidArgument("kcp::document_of: argument 't': token " + std::to_string(t) + " is outside the documents");
  return static_cast<std::int64_t>(it - cu.begin()) - 1;
}

Plan plan_split(const std::vector<std::int64_t>& cu, const std::vector<std::int64_t>& splits) {
  if (cu.size() < 2 || cu.front() != 0)
    throw InvalidArgument("kcp::plan_split: argument 'cu_seqlens': needs at least 2 entries, the first 0");
  for (std::size_t i = 1; i < cu.size(); ++i)
    if (cu[i] < cu[i - 1]) throw InvalidArgument("kcp::plan_split: argument 'cu_seqlens': must be non-decreasing");
  if (splits.size() < 2 || splits.front() != 0 || splits.back() != cu.back())
    throw InvalidArgument("kcp::plan_split: argument 'splits': needs at least 2 entries, from 0 to T = " +
                          std::to_string(cu.back()));
  for (std::size_t i = 1; i < splits.size(); ++i)
    if (splits[i] < splits[i - 1]) throw InvalidArgument("kcp::plan_split: argument 'splits': must be non-decreasing");

  Plan plan;
  plan.T = cu.back();
  plan.cu_seqlens = cu;
  plan.splits = splits;
  const std::int64_t P = static_cast<std::int64_t>(splits.size()) - 1;
  plan.ranks.resize(static_cast<std::size_t>(P));
  for (std::int64_t r = 0; r < P; ++r) {
    RankSlice& s = plan.ranks[static_cast<std::size_t>(r)];
    s.begin = splits[static_cast<std::size_t>(r)];
    s.end = splits[static_cast<std::size_t>(r) + 1];
    if (s.empty()) continue;
    s.first_doc = document_of(cu, s.begin);
    s.last_doc = document_of(cu, s.end - 1);
    const std::int64_t first_start = cu[static_cast<std::size_t>(s.first_doc)];
    s.continues = first_start < s.begin;
    // The rank holding the first document's first token: the last r0 with splits[r0] <= start
    // whose slice is not empty.
    s.origin_rank = r;
    if (s.continues)
      for (std::int64_t r0 = r - 1; r0 >= 0; --r0)
        if (splits[static_cast<std::size_t>(r0)] <= first_start && splits[static_cast<std::size_t>(r0)] < splits[static_cast<std::size_t>(r0) + 1]) {
          s.origin_rank = r0;
          break;
        }
    s.carries = cu[static_cast<std::size_t>(s.last_doc) + 1] > s.end;
    s.last_part_begin = std::max(s.begin, cu[static_cast<std::size_t>(s.last_doc)]);
    s.first_part_end = std::min(s.end, cu[static_cast<std::size_t>(s.first_doc) + 1]);
    s.local_cu_seqlens = {0};
    for (std::int64_t n = s.first_doc + 1; n <= s.last_doc; ++n)
      s.local_cu_seqlens.push_back(cu[static_cast<std::size_t>(n)] - s.begin);
    s.local_cu_seqlens.push_back(s.end - s.begin);
  }
  return plan;
}

std::vector<std::int64_t> even_split(std::int64_t T, std::int64_t pieces, std::int64_t align) {
  if (T < 0) throw InvalidArgument("kcp::even_split: argument 'T': must be non-negative");
  if (pieces < 1) throw InvalidArgument("kcp::even_split: argument 'pieces': must be at least 1");
  if (align < 1) throw InvalidArgument("kcp::even_split: argument 'align': must be at least 1");
  std::vector<std::int64_t> s{0};
  const std::int64_t base = T / pieces, extra = T % pieces;
  std::int64_t at = 0;
  for (std::int64_t i = 0; i < pieces; ++i) {
    at += base + (i < extra ? 1 : 0);
    s.push_back(i + 1 == pieces ? T : std::max(s.back(), at / align * align));
  }
  return s;
}

}  // namespace k3ref::kcp
