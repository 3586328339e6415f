#include "k3ref/serving/prefix_cache.h"

#include <algorithm>
#include <string>

#include "k3ref/error.h"

namespace k3ref::serving {
namespace {

std::string str(std::int64_t x) { return std::to_string(x); }

Tokens prefix(const Tokens& t, std::int64_t b) { return Tokens(t.begin(), t.begin() + b); }

}  // namespace

PrefixCacheModel::PrefixCacheModel(PrefixCacheConfig config) : config_(config) {
  const std::string p = "serving::PrefixCacheModel: argument 'config': ";
  if (config.hash_block <= 0) throw InvalidArgument(p + "hash_block must be positive, got " + str(config.hash_block));
  if (config.physical_block <= 0 || config.physical_block % config.hash_block != 0)
    throw InvalidArgument(p + "physical_block " + str(config.physical_block) + " must be a positive multiple of hash_block " +
                          str(config.hash_block));
  if (config.kda_groups < 1) throw InvalidArgument(p + "kda_groups must be at least 1, got " + str(config.kda_groups));
}

void PrefixCacheModel::check_group(std::int64_t group, const char* what) const {
  if (group < 0 || group >= config_.kda_groups)
    throw InvalidArgument(std::string("serving::PrefixCacheModel::") + what + ": argument 'group': " + str(group) +
                          " is outside [0, " + str(config_.kda_groups) + ")");
}

PrefixCacheModel::Boundary& PrefixCacheModel::entry(const Tokens& tokens, std::int64_t b, const char* what) {
  if (b <= 0 || b % config_.hash_block != 0 || b > static_cast<std::int64_t>(tokens.size()))
    throw InvalidArgument(std::string("serving::PrefixCacheModel::") + what + ": argument 'b': " + str(b) +
                          " is not a hash-block boundary (a positive multiple of " + str(config_.hash_block) +
                          ") within the " + str(static_cast<std::int64_t>(tokens.size())) + " tokens");
  Boundary& e = boundaries_[prefix(tokens, b)];
  e.kda.resize(static_cast<std::size_t>(config_.kda_groups), false);
  return e;
}

void PrefixCacheModel::insert(const Tokens& tokens) {
  for (std::int64_t b = config_.hash_block; b <= static_cast<std::int64_t>(tokens.size()); b += config_.hash_block) {
    store_mla(tokens, b);
    for (std::int64_t g = 0; g < config_.kda_groups; ++g) store_checkpoint(g, tokens, b, b);
  }
}

void PrefixCacheModel::store_mla(const Tokens& tokens, std::int64_t b) { entry(tokens, b, "store_mla").mla = true; }

void PrefixCacheModel::store_checkpoint(std::int64_t group, const Tokens& tokens, std::int64_t b, std::int64_t state_position) {
  check_group(group, "store_checkpoint");
  Boundary& e = entry(tokens, b, "store_checkpoint");
  if (state_position != b)
    throw InvalidArgument("serving::PrefixCacheModel::store_checkpoint: argument 'state_position': the state after " +
                          str(state_position) + " tokens cannot be stored under the key of the prefix [0, " + str(b) + ")");
  e.kda[static_cast<std::size_t>(group)] = true;
}

void PrefixCacheModel::evict_checkpoint(std::int64_t group, const Tokens& tokens, std::int64_t b) {
  check_group(group, "evict_checkpoint");
  Boundary& e = entry(tokens, b, "evict_checkpoint");
  std::fill(e.kda.begin(), e.kda.end(), false);  // the siblings go with it
}

void PrefixCacheModel::evict_physical_block(const Tokens& tokens, std::int64_t index) {
  if (index < 0)
    throw InvalidArgument("serving::PrefixCacheModel::evict_physical_block: argument 'index': negative, got " + str(index));
  for (std::int64_t b = index * config_.physical_block + config_.hash_block; b <= static_cast<std::int64_t>(tokens.size());
       b += config_.hash_block)
    boundaries_.erase(prefix(tokens, b));
}

bool PrefixCacheModel::has_mla(const Tokens& tokens, std::int64_t b) const {
  if (b > static_cast<std::int64_t>(tokens.size()) || b <= 0) return false;
  const auto it = boundaries_.find(prefix(tokens, b));
  return it != boundaries_.end() && it->second.mla;
}

std::int64_t PrefixCacheModel::longest_hit(const Tokens& request) const {
  std::int64_t best = 0;
  const std::int64_t limit = static_cast<std::int64_t>(request.size()) - 1;  // one token must be computed
  for (std::int64_t b = config_.hash_block; b <= limit; b += config_.hash_block) {
    const auto it = boundaries_.find(prefix(request, b));
    // A missing key means the request diverges inside this block (or it was never cached);
    // missing MLA pages end the restorable prefix.
    if (it == boundaries_.end() || !it->second.mla) break;
    if (std::all_of(it->second.kda.begin(), it->second.kda.end(), [](bool x) { return x; })) best = b;
  }
  return best;
}

std::vector<std::int64_t> PrefixCacheModel::checkpoints(std::int64_t group, const Tokens& tokens) const {
  check_group(group, "checkpoints");
  std::vector<std::int64_t> out;
  for (std::int64_t b = config_.hash_block; b <= static_cast<std::int64_t>(tokens.size()); b += config_.hash_block) {
    const auto it = boundaries_.find(prefix(tokens, b));
    if (it != boundaries_.end() && it->second.kda[static_cast<std::size_t>(group)]) out.push_back(b);
  }
  return out;
}

}  // namespace k3ref::serving
