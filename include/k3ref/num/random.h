// Deterministic random numbers owned by the project. std::*_distribution is not used:
// its output is implementation-defined, and goldens must be byte-identical on every
// compiler and platform. Everything here is integer arithmetic plus exact scaling by
// powers of two, so the values are the same everywhere.
#pragma once

#include <cstdint>
#include <cmath>

#include "k3ref/error.h"

namespace k3ref::num {

// xoshiro256** seeded through splitmix64 (Blackman & Vigna). Small, fast, and fully
// specified, so a seed in a manifest reproduces the same stream forever.
class Random {
 public:
  explicit Random(std::uint64_t seed) {
    std::uint64_t x = seed;
    for (auto& word : state_) word = splitmix64(x);
  }

  std::uint64_t next_u64() {
    const std::uint64_t result = rotl(state_[1] * 5, 7) * 9;
    const std::uint64_t t = state_[1] << 17;
    state_[2] ^= state_[0];
    state_[3] ^= state_[1];
    state_[1] ^= state_[2];
    state_[0] ^= state_[3];
    state_[2] ^= t;
    state_[3] = rotl(state_[3], 45);
    return result;
  }

  // Uniform integer in [0, n), n > 0, without modulo bias (Lemire's method with rejection).
  std::uint64_t below(std::uint64_t n) {
    if (n == 0) throw InvalidArgument("Random::below: argument 'n' must be positive");
    const std::uint64_t threshold = (0 - n) % n;
    for (;;) {
      const unsigned __int128 m = static_cast<unsigned __int128>(next_u64()) * n;
      if (static_cast<std::uint64_t>(m) >= threshold) return static_cast<std::uint64_t>(m >> 64);
    }
  }

  // Uniform integer in [lo, hi].
  std::int64_t between(std::int64_t lo, std::int64_t hi) {
    if (hi < lo) throw InvalidArgument("Random::between: argument 'hi' is below 'lo'");
    return lo + static_cast<std::int64_t>(below(static_cast<std::uint64_t>(hi - lo) + 1));
  }

  // Dyadic rational uniform on the grid {lo + (hi - lo) * i / 2^bits : 0 <= i < 2^bits}.
  // With bits <= 8 and lo, hi small powers of two the values are exact in bf16.
  double dyadic(double lo, double hi, int bits) {
    const std::uint64_t i = next_u64() >> (64 - bits);
    return lo + (hi - lo) * std::ldexp(static_cast<double>(i), -bits);
  }

 private:
  static std::uint64_t rotl(std::uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  static std::uint64_t splitmix64(std::uint64_t& x) {
    std::uint64_t z = (x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  std::uint64_t state_[4];
};

}  // namespace k3ref::num
