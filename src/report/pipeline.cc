#include "report/pipeline.h"

#include <algorithm>
#include <stdexcept>

#include "k3ref/error.h"

namespace k3ref::attnres::pipeline {

std::string to_string(Policy policy) {
  switch (policy) {
    case Policy::naive: return "naive";
    case Policy::cached_per_link: return "cached_per_link";
    case Policy::cached_receiver_aware: return "cached_receiver_aware";
  }
  return "unknown";
}

namespace {

void validate(const Config& c) {
  if (c.physical_stages < 1 || c.virtual_stages < 1 || c.blocks_per_chunk < 0 || c.width < 0)
    throw InvalidArgument("pipeline: need P >= 1, V >= 1, N_p >= 0, d >= 0");
}

}  // namespace

Result simulate(const Config& config, Policy policy) {
  validate(config);
  const std::int64_t P = config.physical_stages, C = P * config.virtual_stages, Np = config.blocks_per_chunk;
  const std::int64_t total_blocks = C * Np;
  // held[r][b]: rank r has block b in memory. carried[r][b]: the link r -> r+1 has carried b.
  std::vector<std::vector<bool>> held(P, std::vector<bool>(total_blocks, false));
  std::vector<std::vector<bool>> carried(P, std::vector<bool>(total_blocks, false));
  Result result;
  auto count_held = [&](std::int64_t r) {
    std::int64_t n = 0;
    for (bool b : held[r]) n += b;
    return n;
  };

  for (std::int64_t c = 0; c < C; ++c) {
    const std::int64_t rank = c % P;
    if (c > 0) {
      const std::int64_t from = (c - 1) % P;
      Hop hop{c, from, rank, 0};
      // What the sender holds is decided before the receiver's store changes (from may equal rank).
      const std::vector<bool> sender = held[from];
      if (policy == Policy::naive) held[rank].assign(total_blocks, false);  // nothing survives a chunk
      for (std::int64_t b = 0; b < total_blocks; ++b) {
        if (!sender[b]) continue;
        bool send = false;
        switch (policy) {
          case Policy::naive: send = true; break;
          case Policy::cached_per_link: send = !carried[from][b]; break;
          case Policy::cached_receiver_aware: send = !held[rank][b]; break;
        }
        if (!send) continue;
        ++hop.blocks;
        carried[from][b] = true;
        held[rank][b] = true;
      }
      result.hops.push_back(hop);
      result.blocks_sent += hop.blocks;
      if (from != rank) result.cross_device_elements += hop.blocks * config.width;
    }
    // Block AttnRes in chunk c reads every block of chunks 0 .. c-1.
    for (std::int64_t b = 0; b < c * Np; ++b)
      if (!held[rank][b])
        throw std::logic_error("pipeline: chunk " + std::to_string(c) + " on rank " + std::to_string(rank) +
                               " lacks block " + std::to_string(b) + " under policy " + to_string(policy));
    for (std::int64_t b = c * Np; b < (c + 1) * Np; ++b) held[rank][b] = true;
    result.peak_blocks_held = std::max(result.peak_blocks_held, count_held(rank));
  }
  result.elements_sent = result.blocks_sent * config.width;
  return result;
}

std::int64_t naive_formula(const Config& c) {
  validate(c);
  const std::int64_t C = c.physical_stages * c.virtual_stages;
  return C * (C - 1) / 2 * c.blocks_per_chunk * c.width;
}

std::int64_t cached_formula(const Config& c) {
  validate(c);
  const std::int64_t P = c.physical_stages, V = c.virtual_stages;
  return (P * (P - 1) / 2 + (V - 1) * P * P) * c.blocks_per_chunk * c.width;
}

std::int64_t receiver_aware_formula(const Config& c) {
  validate(c);
  const std::int64_t P = c.physical_stages, V = c.virtual_stages;
  return (P * (P - 1) / 2 + (V - 1) * P * (P - 1)) * c.blocks_per_chunk * c.width;
}

}  // namespace k3ref::attnres::pipeline
