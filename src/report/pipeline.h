// Pipeline-parallel communication of block AttnRes (proofs/attnres_pipeline.md).
//
// P physical stages (ranks) and V virtual stages: the model is cut into C = P·V chunks,
// chunk c = v·P + p running on rank p (interleaved schedule), each chunk completing N_p
// blocks (the embedding counts among chunk 0's). Every chunk needs every block of every
// earlier chunk (block AttnRes attends over all completed blocks), and the activations
// flow along the hops chunk c-1 -> chunk c, i.e. rank (c-1) mod P -> rank c mod P. The
// simulator plays the C chunks in order with explicit per-rank block stores and counts
// the blocks each hop carries (one block = d numbers per token):
//
//   naive                  a chunk's blocks live only while it runs; each hop carries
//                          everything accumulated so far:         C(C-1)/2 · N_p · d
//   cached_per_link        ranks keep blocks across virtual stages; each link carries
//                          every block its sender holds that this link has not carried
//                          before (the paper's count):  P(P-1)/2 · N_p · d + (V-1)·P²·N_p·d
//   cached_receiver_aware  as above, but the sender skips blocks the receiver already holds
//                          (its own earlier chunk):   P(P-1)/2 · N_p · d + (V-1)·P(P-1)·N_p·d
//
// The formulas count every hop, including, when P = 1, hand-offs on one device; the
// simulator reports cross-device volume separately.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace k3ref::attnres::pipeline {

enum class Policy { naive, cached_per_link, cached_receiver_aware };

std::string to_string(Policy policy);

struct Config {
  std::int64_t physical_stages = 1;   // P
  std::int64_t virtual_stages = 1;    // V
  std::int64_t blocks_per_chunk = 1;  // N_p
  std::int64_t width = 1;             // d
};

struct Hop {
  std::int64_t into_chunk = 0;  // the receiving chunk c (>= 1)
  std::int64_t from_rank = 0, to_rank = 0;
  std::int64_t blocks = 0;      // blocks carried
};

struct Result {
  std::vector<Hop> hops;                 // C - 1 hops, in order
  std::int64_t blocks_sent = 0;          // over all hops
  std::int64_t elements_sent = 0;        // blocks_sent · d
  std::int64_t cross_device_elements = 0;
  std::int64_t peak_blocks_held = 0;     // largest store of any rank at any time
};

// Plays the schedule; throws std::logic_error if a chunk would start without every block of
// every earlier chunk in its rank's store (a protocol that starves block AttnRes).
Result simulate(const Config& config, Policy policy);

// The closed forms above (elements, i.e. blocks · d).
std::int64_t naive_formula(const Config& config);
std::int64_t cached_formula(const Config& config);
std::int64_t receiver_aware_formula(const Config& config);

}  // namespace k3ref::attnres::pipeline
