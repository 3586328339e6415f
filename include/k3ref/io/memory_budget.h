// The working-memory budget of a reference computation, estimated from the shapes before
// anything is allocated: one rule for `k3ref kda --memory-budget` (src/cli) and for the Python
// package's `memory_budget=` keyword (k3ref._core.kda_memory_estimate, python/k3ref). Header
// only, so that every caller links nothing for it.
//
// The estimate (bytes): the outputs in the tier and as doubles, the inputs lifted to the tier,
// and, per thread (at most one per sequence-head), two states K x V in the tier; the chunk forms
// add each thread's chunk scratch (several C x C matrices and C x K, C x V blocks, allocated at
// the chunk size C whatever the number of tokens) and, with stages, the stage tensors. A value
// of the tier takes 8 bytes in double and about 150 at 256 bits (measured, limbs and header).
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

#include "k3ref/error.h"
#include "k3ref/io/file.h"

namespace k3ref::io {

// Bytes one value of a tier occupies while it is computed with: a double, or the 256-bit float.
constexpr std::int64_t bytes_per_element(bool high_precision) { return high_precision ? 150 : 8; }

// The default budget: half of the machine's physical memory (8 GiB when it cannot be read).
inline std::int64_t default_memory_budget() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<std::int64_t>(pages) * page / 2 : std::int64_t{8} << 30;
}

// A budget written as bytes with an optional binary K, M, G or T suffix ("512M"); empty: the
// default. InvalidArgument naming `option` otherwise.
inline std::int64_t parse_memory_budget(std::string_view text, const std::string& option) {
  if (text.empty()) return default_memory_budget();
  std::size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  std::int64_t value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + digits, value);
  const std::string_view suffix = text.substr(digits);
  const int shift = suffix.empty() ? 0 : suffix == "K" ? 10 : suffix == "M" ? 20 : suffix == "G" ? 30 : suffix == "T" ? 40 : -1;
  if (digits == 0 || ec != std::errc() || shift < 0 || value <= 0 ||
      value > (std::numeric_limits<std::int64_t>::max() >> shift))
    throw InvalidArgument(option + ": expected a positive number of bytes with an optional K, M, G or T suffix (binary), not " +
                          excerpt(text));
  return value << shift;
}

// The sizes an estimate needs, all counts of elements (>= 0).
struct WorkShape {
  std::int64_t outputs = 0;         // every output tensor's elements (o, final_state, all_states, stages, gradients)
  std::int64_t inputs = 0;          // every input tensor's elements
  std::int64_t sequence_heads = 1;  // N x HV: the items the threads share
  std::int64_t threads = 1;         // threads asked for
  std::int64_t K = 0, V = 0;        // head sizes: each thread's state is K x V
  std::int64_t chunk_size = 0;      // C of a chunk form (0: none)
};

// Bytes per thread of a chunk form's scratch at chunk size C (ChunkScratch in kda/chunkwise.h:
// about 8 C x C matrices and 24 blocks of C x (K or V)), in elements.
constexpr double chunk_scratch_elements(std::int64_t C, std::int64_t K, std::int64_t V) {
  return 8.0 * static_cast<double>(C) * static_cast<double>(C) +
         24.0 * static_cast<double>(C) * static_cast<double>(std::max(K, V));
}

// The estimate, in bytes (a double: products of hostile sizes must not overflow).
inline double working_memory(const WorkShape& w, bool high_precision) {
  const double per = static_cast<double>(bytes_per_element(high_precision));
  const double threads =
      static_cast<double>(std::max<std::int64_t>(1, std::min(w.threads, std::max<std::int64_t>(1, w.sequence_heads))));
  double need = static_cast<double>(w.outputs) * (per + 8) + static_cast<double>(w.inputs) * (per + 8) +
                threads * static_cast<double>(w.K) * static_cast<double>(w.V) * per * 2;
  if (w.chunk_size > 0) need += threads * chunk_scratch_elements(w.chunk_size, w.K, w.V) * per;
  return need;
}

}  // namespace k3ref::io
