#include <string>

#include "k3ref/kda/options.h"

namespace k3ref::kda {
namespace {

std::string expected(const char* arg, const Shape& want, const Shape& got) {
  return std::string("kda: argument '") + arg + "': expected shape " + shape_to_string(want) + ", got " +
         shape_to_string(got);
}
void require_shape(const char* arg, const Shape& want, const Shape& got) {
  if (want != got) throw InvalidArgument(expected(arg, want, got));
}

}  // namespace

Dims validate(const InputShapes& s) {
  if (s.q.size() != 4)
    throw InvalidArgument("kda: argument 'q': expected 4 dimensions [B, T, H, K], got " + shape_to_string(s.q));
  if (s.v.size() != 4)
    throw InvalidArgument("kda: argument 'v': expected 4 dimensions [B, T, HV, V], got " + shape_to_string(s.v));
  Dims d;
  d.B = s.q[0];
  d.T = s.q[1];
  d.H = s.q[2];
  d.K = s.q[3];
  d.HV = s.v[2];
  d.V = s.v[3];
  for (auto [name, value] : {std::pair{"B", d.B}, {"T", d.T}}) {
    if (value < 0) throw InvalidArgument(std::string("kda: argument 'q': negative ") + name);
  }
  if (d.H <= 0) throw InvalidArgument("kda: argument 'q': number of heads H must be positive, got " + std::to_string(d.H));
  if (d.K <= 0) throw InvalidArgument("kda: argument 'q': head size K must be positive, got " + std::to_string(d.K));
  if (d.HV <= 0)
    throw InvalidArgument("kda: argument 'v': number of value heads HV must be positive, got " + std::to_string(d.HV));
  if (d.V <= 0) throw InvalidArgument("kda: argument 'v': head size V must be positive, got " + std::to_string(d.V));
  if (d.HV % d.H != 0)
    throw InvalidArgument("kda: argument 'v': value heads HV = " + std::to_string(d.HV) +
                          " must be a multiple of the q/k heads H = " + std::to_string(d.H));
  checked_numel(s.q, "kda: argument 'q'");
  require_shape("k", s.q, s.k);
  require_shape("v", {d.B, d.T, d.HV, d.V}, s.v);
  require_shape("g", {d.B, d.T, d.HV, d.K}, s.g);
  require_shape("beta", {d.B, d.T, d.HV}, s.beta);
  // With T = 0 no tensor has elements, so the shapes bound nothing: the products the
  // recurrence forms (state offsets, sequence x head counts) must be checked here.
  checked_numel({d.B, d.HV, d.K, d.V}, "kda: state size [B, HV, K, V]");

  if (s.cu_seqlens) {
    const auto& cu = *s.cu_seqlens;
    if (d.B != 1)
      throw InvalidArgument("kda: argument 'cu_seqlens': requires batch size B = 1, got B = " + std::to_string(d.B));
    if (cu.empty()) throw InvalidArgument("kda: argument 'cu_seqlens': must hold N + 1 >= 1 offsets, got none");
    if (cu.front() != 0)
      throw InvalidArgument("kda: argument 'cu_seqlens': must start at 0, starts at " + std::to_string(cu.front()));
    for (std::size_t i = 1; i < cu.size(); ++i)
      if (cu[i] < cu[i - 1])
        throw InvalidArgument("kda: argument 'cu_seqlens': must be non-decreasing, but cu_seqlens[" +
                              std::to_string(i) + "] = " + std::to_string(cu[i]) + " < cu_seqlens[" +
                              std::to_string(i - 1) + "] = " + std::to_string(cu[i - 1]));
    if (cu.back() != d.T)
      throw InvalidArgument("kda: argument 'cu_seqlens': must end at T = " + std::to_string(d.T) + ", ends at " +
                            std::to_string(cu.back()));
    d.N = static_cast<std::int64_t>(cu.size()) - 1;
    checked_numel({d.N, d.HV, d.K, d.V}, "kda: state size [N, HV, K, V]");
    for (std::int64_t n = 0; n < d.N; ++n) {
      d.seq_batch.push_back(0);
      d.seq_begin.push_back(cu[n]);
      d.seq_end.push_back(cu[n + 1]);
    }
  } else {
    d.N = d.B;
    for (std::int64_t b = 0; b < d.B; ++b) {
      d.seq_batch.push_back(b);
      d.seq_begin.push_back(0);
      d.seq_end.push_back(d.T);
    }
  }

  if (s.initial_state) {
    const Shape want = s.state_layout == StateLayout::k_first ? Shape{d.N, d.HV, d.K, d.V} : Shape{d.N, d.HV, d.V, d.K};
    if (*s.initial_state != want)
      throw InvalidArgument(expected("initial_state", want, *s.initial_state) + " (" +
                            std::string(to_string(s.state_layout)) + " layout, N = " + std::to_string(d.N) +
                            " sequences)");
  }
  const bool raw_gate = s.gate == GateForm::softplus || s.gate == GateForm::lower_bound;
  if (s.A_log) {
    if (!raw_gate)
      throw InvalidArgument("kda: argument 'A_log': only used by the softplus and lower_bound gates, gate is " +
                            std::string(to_string(s.gate)));
    require_shape("A_log", {d.HV}, *s.A_log);
  }
  if (s.dt_bias) {
    if (!raw_gate)
      throw InvalidArgument("kda: argument 'dt_bias': only used by the softplus and lower_bound gates, gate is " +
                            std::string(to_string(s.gate)));
    require_shape("dt_bias", {d.HV, d.K}, *s.dt_bias);
  }
  if (s.gate == GateForm::softplus && !s.A_log)
    throw InvalidArgument("kda: argument 'A_log': required by the softplus gate");
  if (s.gate == GateForm::lower_bound && !s.has_lower_bound)
    throw InvalidArgument("kda: argument 'lower_bound': required by the lower_bound gate");
  if (s.gate != GateForm::lower_bound && s.has_lower_bound)
    throw InvalidArgument("kda: argument 'lower_bound': only used by the lower_bound gate, gate is " +
                          std::string(to_string(s.gate)));
  return d;
}

}  // namespace k3ref::kda
