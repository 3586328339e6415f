// Precision contracts of real KDA kernels: each kernel's roundings as a policy of the one
// chunk algorithm (kda/chunkwise.h, whose two forms follow the kernels' order of
// operations), evaluated on the CPU on the inputs the kernel received, so that a kernel is
// judged against what its arithmetic can deliver (docs/contracts.md).
//
//   fla_recurrent        FLA fused_recurrent_kda: the library's recurrence (kda/recurrent.h)
//                        instantiated in float (fp32 state and accumulation), o rounded to bf16.
//   fla_chunk            FLA chunk_kda: the FLA chunk form (C = 64 from 16-token sub-chunks)
//                        with bf16 operands of every product, the fp32 state rounded to bf16
//                        where it is an operand (q·h, w·h), tf32 operands (truncated) of the
//                        cross-sub-chunk products and of the inverse's block merges, the fp32
//                        inverse stored as bf16.
//   fla_chunk_safe_gate  the same with safe_gate: the diagonal sub-chunk products through the
//                        anchor row min(8, rows - 1) of the sub-chunk (a future row for the
//                        first half), tf32 operands.
//   flashkda             FlashKDA: the FlashKDA chunk form (C = 16) with bf16 normalised q/k,
//                        bf16 decays as operands, bf16 scale, fp16 L and Neumann inverse with
//                        fp16 accumulation, bf16 state.
//
// With every site at Precision::exact a contract is the chunk form itself, and in rationals
// the recurrence (tests/kda/contract_test.cpp checks ==).
//
// Modelled, not emulated bit for bit (each bound is in docs/contracts.md): exp2 / exp as
// correctly rounded fp32 of the exact decay (ex2.approx: 2 ulp of fp32), sigmoid via
// tanh.approx as the exact sigmoid (for FlashKDA's beta the GPU harness passes the kernel's own
// values as BetaForm::as_given, measured per bf16 logit: the approximation cancels for negative
// logits, up to 1 % of beta at -12), FLA's fp32 cumulative sums of log2 decays as exact,
// tensor-core accumulation as sequential fp32 sums.
#pragma once

#include <cstdint>

#include "k3ref/kda/chunkwise.h"
#include "k3ref/kda/kda_io.h"
#include "k3ref/kda/rounding.h"

namespace k3ref::kda::contract {

enum class Kernel { fla_recurrent, fla_chunk, fla_chunk_safe_gate, flashkda };
inline constexpr Choices<Kernel, 4> kernels{"contract",
                                            {{{Kernel::fla_recurrent, "fla_recurrent", "FLA fused_recurrent_kda"},
                                              {Kernel::fla_chunk, "fla_chunk", "FLA chunk_kda"},
                                              {Kernel::fla_chunk_safe_gate, "fla_chunk_safe_gate",
                                               "FLA chunk_kda, safe_gate=True"},
                                              {Kernel::flashkda, "flashkda", "FlashKDA"}}}};
inline std::string_view to_string(Kernel k) { return kernels.name(k); }

// A kernel's contract: the rounding policy of its chunk form, and the sizes it runs at.
struct KernelContract : RoundingPolicy {
  Kernel kernel = Kernel::fla_chunk;
  Precision recurrence_precision = Precision::fp32;  // fla_recurrent: the recurrence's scalar (fp32 or exact)
  // The kernel's chunk (FLA 64, FlashKDA 16) and FLA's sub-chunk (16); tests shrink them
  // to reach several chunks and sub-chunks in rationals.
  std::int64_t chunk_size = 64, sub_chunk = 16;

  KernelContract& set(Site s, Precision p) {
    RoundingPolicy::set(s, p);
    return *this;
  }
  // The chunk form and its options this contract runs.
  ChunkwiseOptions chunk_options() const {
    ChunkwiseOptions copt;
    copt.form = kernel == Kernel::flashkda ? ChunkForm::flashkda : ChunkForm::fla;
    copt.chunk_size = chunk_size;
    copt.sub_chunk = kernel == Kernel::flashkda ? chunk_size : sub_chunk;
    copt.safe_gate = kernel == Kernel::fla_chunk_safe_gate;
    return copt;
  }
};

// The kernel's declared contract (src/kda/kernel_contracts.cc; docs/contracts.md lists
// each site with the kernel source that justifies it).
KernelContract kernel_contract(Kernel);
// The same algorithm rounding nowhere: the mathematical chunk form (or the recurrence).
KernelContract exact_contract(Kernel);

// The kernel's contract evaluated on `in` with the options of `k3ref kda`: o and the final
// state (layout as the options say), each element the value the contract's arithmetic gives.
template <class S>
Outputs<S> evaluate_contract(const KernelContract& c, const Inputs<S>& in, const Options<S>& opt) {
  if (opt.output_all_states)
    throw InvalidArgument("kda contract: option 'all_states' is not supported (the contracts give o and the final state)");
  if (c.kernel == Kernel::fla_recurrent) {
    if (c.recurrence_precision == Precision::exact) {
      Outputs<S> r = recurrent_forward(in, opt);
      for (S& y : r.o.values()) y = c.round(Site::output, y);
      return r;
    }
    if constexpr (std::is_same_v<S, double>) {
      auto narrow = [](const Tensor<double>& t) { return t.map<float>([](double v) { return static_cast<float>(v); }); };
      auto narrow_opt = [&](const std::optional<Tensor<double>>& t) -> std::optional<Tensor<float>> {
        if (!t) return std::nullopt;
        return narrow(*t);
      };
      const Inputs<float> f{narrow(in.q),  narrow(in.k), narrow(in.v),
                            narrow(in.g),  narrow(in.beta), narrow_opt(in.initial_state),
                            narrow_opt(in.A_log), narrow_opt(in.dt_bias), in.cu_seqlens};
      const Outputs<float> rf = recurrent_forward(f, convert_options<float>(opt));
      Outputs<double> r;
      r.o = rf.o.map<double>([&](float v) { return c.round(Site::output, static_cast<double>(v)); });
      if (rf.final_state) r.final_state = rf.final_state->map<double>([](float v) { return static_cast<double>(v); });
      return r;
    } else {
      throw InvalidArgument("kda contract 'fla_recurrent': the fp32 recurrence is evaluated from double inputs only");
    }
  }
  const Dims d = validated_dims(in, opt, "kda contract");
  if (c.chunk_size < 1 || c.sub_chunk < 1 || c.chunk_size % c.sub_chunk != 0)
    throw InvalidArgument("kda contract: chunk_size and sub_chunk must be positive, sub_chunk dividing chunk_size");
  ChunkwiseOutputs<S> r = chunkwise_core(prepare(in, opt, d), to_k_first(in.initial_state, opt.state_layout), opt, d,
                                         c.chunk_options(), static_cast<const RoundingPolicy&>(c));
  r.out.final_state = from_k_first(std::move(r.out.final_state), opt.state_layout);
  return std::move(r.out);
}

}  // namespace k3ref::kda::contract
