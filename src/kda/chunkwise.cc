// Scalar-free parts of the chunkwise KDA forms (kda/chunkwise.h).
#include "k3ref/kda/chunkwise.h"

#include <cmath>
#include <string>

namespace k3ref::kda {

std::int64_t effective_chunk_size(const ChunkwiseOptions& copt) {
  if (copt.chunk_size != 0) return copt.chunk_size;
  return copt.form == ChunkForm::flashkda ? 16 : 64;
}

int neumann_factor_count(std::int64_t C) {
  if (C < 1) throw InvalidArgument("kda::neumann_factor_count: argument 'C' must be positive");
  int m = 1;
  while ((std::int64_t{1} << m) < C) ++m;
  return m;
}

void validate_chunkwise(const ChunkwiseOptions& copt, bool output_all_states) {
  if (copt.chunk_size < 0) throw InvalidArgument("kda::chunkwise: argument 'chunk_size': must be positive (0: default)");
  // A chunk is a C x C matrix (several, per thread): 1024 keeps them at 8 MiB each, while the
  // kernels use 16 and 64; a chunk_size of 8192 would take gigabytes even on four tokens.
  if (copt.chunk_size > max_chunk_size)
    throw InvalidArgument("kda::chunkwise: argument 'chunk_size': at most " + std::to_string(max_chunk_size) +
                          " (a chunk is a C x C matrix), not " + std::to_string(copt.chunk_size));
  const std::int64_t C = effective_chunk_size(copt);
  if (copt.form == ChunkForm::fla && (copt.sub_chunk < 1 || C % copt.sub_chunk != 0))
    throw InvalidArgument("kda::chunkwise: argument 'sub_chunk': must be positive and divide the chunk size " +
                          std::to_string(C));
  if (output_all_states)
    throw InvalidArgument(
        "kda::chunkwise: option 'output_all_states': the chunk form has states only at chunk boundaries "
        "(ChunkStages::chunk_states); use recurrent_forward for per-token states");
}

double inverse_decay_overflow_bound(num::Format format, std::int64_t span) {
  if (span < 1) throw InvalidArgument("kda::inverse_decay_overflow_bound: argument 'span' must be positive");
  const num::FormatInfo info = num::format_info(format);
  if (!info.has_infinity)
    throw InvalidArgument("kda::inverse_decay_overflow_bound: argument 'format' has no infinity (saturating fn format)");
  // max_finite = (2 - 2^-p) 2^emax, its ulp 2^(emax - p): threshold = 2^(emax+1) (1 - 2^-(p+2)).
  // ln of it without forming 2^(emax+1) (which is beyond double for fp64).
  int e = 0;
  const double m = std::frexp(info.max_finite, &e);  // max_finite = m 2^e, m = 1 - 2^-(p+1)
  const double threshold_mantissa = m + std::ldexp(0.5, -info.mantissa_bits - 1);
  const double ln_threshold = std::log(threshold_mantissa) + e * std::log(2.0);
  return ln_threshold / static_cast<double>(span);
}

}  // namespace k3ref::kda
