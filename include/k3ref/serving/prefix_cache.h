// The prefix-cache hit rule of a hybrid MLA + KDA model, as a small reference model
// (docs/serving.md, "Prefix caching").
//
// Tokens are hashed in hash blocks (512 tokens); memory is allocated in coarse physical
// blocks (6144 tokens, a whole number of hash blocks). MLA layers keep a KV entry per token,
// so they can restore any hash-block boundary whose pages are still cached. A KDA layer keeps
// one state, so it can restore only a boundary at which its state was checkpointed: the state
// after exactly b tokens, stored under the key of the prefix [0, b). The KDA layers are split
// into cache groups, each storing and evicting its own checkpoints; a hit at b needs all of
// them. So a hit is the longest boundary b that
//   - is a multiple of the hash block and leaves at least one token to compute (b < request),
//   - lies inside the common prefix of the request and a cached sequence,
//   - has the MLA pages of all of [0, b) cached, and
//   - has a checkpoint at b in every KDA cache group.
// A request sharing its first 2800 tokens with a cached sequence hits at 2560 = 5 * 512,
// inside the first 6144-token physical block (a rule at physical-block granularity would give 0).
//
// The key of a boundary is the token prefix itself: an exact stand-in for a chain of block
// hashes (no collisions), which is what a reference model needs.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

namespace k3ref::serving {

struct PrefixCacheConfig {
  std::int64_t hash_block = 512;
  std::int64_t physical_block = 6144;  // a multiple of hash_block
  std::int64_t kda_groups = 1;
};

using Tokens = std::vector<std::int32_t>;

class PrefixCacheModel {
 public:
  explicit PrefixCacheModel(PrefixCacheConfig config);
  const PrefixCacheConfig& config() const { return config_; }

  // Caches a finished prefill of `tokens`: the MLA pages of every full hash block and, in
  // every KDA group, a checkpoint at every hash-block boundary b <= tokens.size().
  void insert(const Tokens& tokens);

  // The pieces of insert, for tests of partial states. MLA pages of [0, b): b a boundary.
  void store_mla(const Tokens& tokens, std::int64_t b);
  // Group g's checkpoint for the boundary b of `tokens`, holding the state after
  // `state_position` tokens. Rejects b not a hash-block boundary (or past the tokens) and
  // state_position != b: a state stored under another prefix's key is the bug this rule
  // exists to exclude.
  void store_checkpoint(std::int64_t group, const Tokens& tokens, std::int64_t b, std::int64_t state_position);

  // Evicts group g's checkpoint at b. Its siblings (the checkpoints at b in the other groups)
  // are invalidated with it: without all of them b cannot be restored, and keeping them would
  // hold memory a hit can never use.
  void evict_checkpoint(std::int64_t group, const Tokens& tokens, std::int64_t b);
  // Evicts physical block `index` of `tokens` (tokens [index * P, (index + 1) * P)): its MLA
  // pages and checkpoints; the blocks after it go too, since a hit needs every page before it.
  void evict_physical_block(const Tokens& tokens, std::int64_t index);

  // The longest restorable boundary for `request` (0: nothing restorable).
  std::int64_t longest_hit(const Tokens& request) const;
  // The boundaries of `tokens` at which group g holds a checkpoint, ascending.
  std::vector<std::int64_t> checkpoints(std::int64_t group, const Tokens& tokens) const;
  // Whether the MLA pages of hash block ending at b are cached.
  bool has_mla(const Tokens& tokens, std::int64_t b) const;

 private:
  struct Boundary {
    bool mla = false;
    std::vector<bool> kda;  // per group
  };
  Boundary& entry(const Tokens& tokens, std::int64_t b, const char* what);
  void check_group(std::int64_t group, const char* what) const;
  PrefixCacheConfig config_;
  std::map<Tokens, Boundary> boundaries_;  // key: the prefix [0, b)
};

}  // namespace k3ref::serving
