// Random QB instances for the property tests, in exact rationals.
#pragma once

#include <rapidcheck.h>

#include <algorithm>
#include <numeric>
#include <set>

#include "k3ref/num/random.h"
#include "k3ref/num/scalar.h"
#include "k3ref/qb/solver.h"

namespace k3ref::qb::testing {

using Q = num::rational;

struct Sizes {
  std::int64_t m, n, k;
};

// 2 <= n <= max_n, 1 <= k < n, m a multiple of n / gcd(n, k) (so q is an integer), m <= max_m.
inline Sizes random_sizes(std::int64_t max_m = 12, std::int64_t max_n = 6) {
  const std::int64_t n = *rc::gen::inRange<std::int64_t>(2, max_n + 1);
  const std::int64_t k = *rc::gen::inRange<std::int64_t>(1, n);
  const std::int64_t step = n / std::gcd(n, k);
  const std::int64_t most = std::max<std::int64_t>(1, max_m / step);
  const std::int64_t m = step * *rc::gen::inRange<std::int64_t>(1, most + 1);
  return Sizes{m, n, k};
}

// Tie-free scores: numerators drawn from 2^40 values over 2^20, all distinct in the whole
// matrix (so rule 2 of the tie rule always decides and no raw scores coincide). Ties between
// alternating sums of scores then need an exact integer relation among 40-bit numbers;
// only the structural ties of the iteration remain.
inline Tensor<Q> tie_free_scores(std::int64_t m, std::int64_t n) {
  // Drawn from a seed RapidCheck chooses (and reports on failure): rejection sampling of
  // distinct values on RapidCheck's own shrinking generators would not terminate when shrunk.
  num::Random rng(*rc::gen::arbitrary<std::uint64_t>());
  Tensor<Q> s({m, n});
  std::set<std::uint64_t> used;
  for (Q& x : s.values()) {
    std::uint64_t num;
    do num = rng.below(std::uint64_t{1} << 40);
    while (!used.insert(num).second);
    x = Q(static_cast<std::int64_t>(num)) / Q(std::int64_t{1} << 20);
  }
  return s;
}

// Tie-heavy scores: four levels {0, 1/4, 1/2, 3/4}.
inline Tensor<Q> tie_heavy_scores(std::int64_t m, std::int64_t n) {
  Tensor<Q> s({m, n});
  for (Q& x : s.values()) x = Q(*rc::gen::inRange(0, 4)) / Q(4);
  return s;
}

inline Tensor<Q> any_scores(std::int64_t m, std::int64_t n) {
  return *rc::gen::arbitrary<bool>() ? tie_free_scores(m, n) : tie_heavy_scores(m, n);
}

// A uniformly random permutation of 0..n-1 (Fisher-Yates on RapidCheck's integers).
inline std::vector<std::int64_t> random_permutation(std::int64_t n) {
  std::vector<std::int64_t> perm(static_cast<std::size_t>(n));
  std::iota(perm.begin(), perm.end(), 0);
  for (std::int64_t i = n - 1; i > 0; --i) std::swap(perm[i], perm[*rc::gen::inRange<std::int64_t>(0, i + 1)]);
  return perm;
}

inline Q small_rational() { return Q(*rc::gen::inRange(-64, 65)) / Q(*rc::gen::element(1, 2, 3, 7, 16)); }

}  // namespace k3ref::qb::testing
