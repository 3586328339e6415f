// The declared contracts of the real KDA kernels (kda/kernel_contracts.h): for each kernel,
// the precision of every rounding site, read from the kernel's source at the commits named
// in docs/contracts.md (FLA bc3b101d, FlashKDA 1ce47ea).
#include "k3ref/kda/kernel_contracts.h"

namespace k3ref::kda::contract {

KernelContract exact_contract(Kernel k) {
  KernelContract c;
  c.kernel = k;
  c.recurrence_precision = Precision::exact;
  c.chunk_size = k == Kernel::flashkda ? 16 : 64;
  return c;
}

KernelContract kernel_contract(Kernel k) {
  using P = Precision;
  KernelContract c;
  c.kernel = k;
  switch (k) {
    case Kernel::fla_recurrent:
      // fp32 loads, state, gate and sums; o stored in the dtype of v.
      c.recurrence_precision = P::fp32;
      c.set(Site::output, P::bf16);
      break;
    case Kernel::fla_chunk:
    case Kernel::fla_chunk_safe_gate:
      c.set(Site::input, P::bf16)              // q, k (its L2 norm writes q.dtype), v
          .set(Site::decay, P::fp32)           // exp2 of fp32 cumulative log2 decays
          // fp32 operands of tl.dot are tf32 on sm80+, their 13 low bits dropped (toward zero):
          // measured, the kernel's outputs match this and not round-to-nearest (docs/contracts.md)
          .set(Site::intra_operand, P::tf32_rz)
          .set(Site::intra_accumulate, P::fp32)
          .set(Site::aqk, P::bf16)             // Aqk stored in k.dtype
          .set(Site::akk, P::fp32)             // diagonal blocks in an fp32 buffer, the rest in registers
          .set(Site::L, P::fp32)
          .set(Site::inv_accumulate, P::fp32)
          .set(Site::inv, P::fp32)
          .set(Site::inv_operand, P::tf32_rz)  // the merges' tl.dot(input_precision="tf32")
          .set(Site::inv_store, P::bf16)       // Akk (the inverse) stored in k.dtype
          .set(Site::k_beta, P::bf16)          // k * beta, (v * beta).to(v.dtype)
          .set(Site::w_operand, P::bf16)       // (k beta exp2(g)).to(k.dtype)
          .set(Site::w, P::bf16)
          .set(Site::u_pre, P::bf16)
          .set(Site::q_decay, P::bf16)         // (q exp2(g)).to(q.dtype); scale applied after the product
          .set(Site::k_restore, P::bf16)       // kg stored in k.dtype
          .set(Site::state_operand, P::bf16)   // h.to(w.dtype), h stored in k.dtype for the output
          .set(Site::u, P::bf16)               // v_new stored in u.dtype
          .set(Site::chunk_accumulate, P::fp32)
          .set(Site::output, P::bf16)
          .set(Site::state, P::fp32);
      break;
    case Kernel::flashkda:
      c.chunk_size = 16;
      c.flush_decay_subnormals = true;         // ex2.approx.ftz.f32
      c.set(Site::input, P::bf16)              // L2-normalised q, k written back as bf16
          .set(Site::scale, P::bf16)
          .set(Site::decay, P::fp32)
          .set(Site::decay_operand, P::bf16)   // exp2(g cumsum).to(bf16) before each product
          .set(Site::intra_accumulate, P::fp32)
          .set(Site::aqk, P::bf16)             // M_qk
          .set(Site::akk, P::fp16)             // K_decay K_inv^T to fp16
          .set(Site::beta_l, P::fp16)
          .set(Site::L, P::fp16)
          .set(Site::inv_accumulate, P::fp16)  // fp16-accumulating MMA
          .set(Site::inv, P::fp16)
          .set(Site::inv_store, P::bf16)
          .set(Site::q_decay, P::bf16)
          .set(Site::k_decay, P::bf16)
          .set(Site::k_inv, P::bf16)
          .set(Site::k_restore, P::bf16)
          .set(Site::state_product, P::bf16)
          .set(Site::u_input, P::bf16)
          .set(Site::beta_u, P::bf16)
          .set(Site::u, P::bf16)
          .set(Site::chunk_accumulate, P::fp32)
          .set(Site::output, P::bf16)
          .set(Site::state, P::bf16);
      break;
  }
  return c;
}

}  // namespace k3ref::kda::contract
