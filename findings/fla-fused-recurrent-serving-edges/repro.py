#!/usr/bin/env python3
"""Standalone reproductions (PyTorch and FLA only, no k3ref) of what FLA's fused_recurrent_kda
does at the edges of its serving arguments, as read from fla/ops/kda/fused_recurrent.py
(docs/serving.md). Each prints what it observed and whether that matches the prediction; the script exits 1
while any predicted defect is present, 0 once none is.
Needs a CUDA device and FLA (set K3REF_FLA_PATH to a checkout); exit 77 otherwise.
Not part of the CPU test suite. Usage: K3REF_FLA_PATH=<dir holding fla> python3 repro.py
"""
import os
import sys

try:
    import torch
except ImportError:
    print("torch not importable: skipped")
    sys.exit(77)
if not torch.cuda.is_available():
    print("no CUDA device: skipped")
    sys.exit(77)
# FLA's own Triton kernels, not a backend it may dispatch to (as the other FLA findings).
os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")
os.environ.setdefault("FLA_FLASH_KDA", "0")
os.environ.setdefault("FLA_TILELANG", "0")
if os.environ.get("K3REF_FLA_PATH"):
    sys.path.insert(0, os.environ["K3REF_FLA_PATH"])
try:
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda, fused_recurrent_kda_fwd
except ImportError as e:
    print(f"FLA not importable ({e}): skipped")
    sys.exit(77)

dev = "cuda"
H, HV, K, V = 1, 2, 16, 32
torch.manual_seed(0)


def tokens(T):
    q = torch.randn(1, T, H, K, device=dev).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, device=dev), dim=-1).bfloat16()
    v = torch.randn(1, T, HV, V, device=dev).bfloat16()
    g = (-torch.rand(1, T, HV, K, device=dev)).bfloat16()
    beta = torch.rand(1, T, HV, device=dev).bfloat16()
    return q, k, v, g, beta


REPRODUCED = []  # the defects seen as predicted: the exit code is 1 while any is present


def report(name, predicted, observed):
    print(f"[{'as predicted' if observed else 'NOT as predicted'}] {name}: {predicted}")
    if observed:
        REPRODUCED.append(name)


# 1. num_accepted_tokens = 0 reads the previous row's last entry (the neighbour's slot).
q, k, v, g, beta = tokens(2)
pool = torch.randn(4, HV, K, V, device=dev)
pool[1] = float("nan")  # sequence 0's second column: written by it, never read by a correct kernel
idx = torch.tensor([[0, 1], [2, 3]], device=dev, dtype=torch.int32)
o, _ = fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool.clone(), inplace_final_state=True,
                               cu_seqlens=torch.tensor([0, 1, 2], device=dev), ssm_state_indices=idx,
                               num_accepted_tokens=torch.tensor([1, 0], device=dev, dtype=torch.int32))
report("accepted count 0", "sequence 1 enters from index [0, 1] (slot 1, NaN): its output is NaN",
       bool(torch.isnan(o[0, 1]).any()) and not bool(torch.isnan(o[0, 0]).any()))

# 2. Index -1 (vLLM's PAD_SLOT_ID) is not special: it reads the slot before the pool's start.
q, k, v, g, beta = tokens(1)
buffer = torch.zeros(3, HV, K, V, device=dev)
buffer[0] = float("nan")  # the memory just before the pool
pool = buffer[1:]
o, _ = fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool, inplace_final_state=True,
                               cu_seqlens=torch.tensor([0, 1], device=dev),
                               ssm_state_indices=torch.tensor([-1], device=dev, dtype=torch.int32))
report("pad index -1", "reads (and writes) the slot before the pool: NaN output, buffer[0] overwritten",
       bool(torch.isnan(o).any()) or not bool(torch.isnan(buffer[0]).all()))

# 3. Continuous batching with a 1-D index table and 2 tokens per sequence: the state after token t
#    is stored into index [n + t], so slot 0 ends with sequence 0's state after its FIRST token
#    (not its final state), and sequence 1's second store reads index [2], past the table.
q, k, v, g, beta = tokens(4)
pool = torch.randn(4, HV, K, V, device=dev)
before = pool.clone()
fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool, inplace_final_state=True,
                        cu_seqlens=torch.tensor([0, 2, 4], device=dev),
                        ssm_state_indices=torch.tensor([0, 2], device=dev, dtype=torch.int32))
_, after_first = fused_recurrent_kda(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], initial_state=before[:1].clone(),
                                     output_final_state=True)
report("1-D indices, 2 tokens", "slot 0 holds sequence 0's state after token 0, not after token 1",
       torch.allclose(pool[0], after_first[0], rtol=0, atol=1e-6))
print(f"    slots changed: {[s for s in range(4) if not torch.equal(pool[s], before[s])]} (named: [0, 2])")

# 4. inplace_final_state=False in continuous batching: N rows allocated, row bos + t written.
q, k, v, g, beta = tokens(6)
pool = torch.randn(2, HV, K, V, device=dev)
o, final = fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool, inplace_final_state=False,
                                   output_final_state=True, cu_seqlens=torch.tensor([0, 3, 6], device=dev),
                                   ssm_state_indices=torch.tensor([[0, 1, 1], [1, 0, 0]], device=dev,
                                                                  dtype=torch.int32))
torch.cuda.synchronize()
report("per-token output", f"final_state has {final.shape[0]} rows but rows 0..5 are written (run under "
       "compute-sanitizer --tool memcheck to see the out-of-bounds stores)", final.shape[0] == 2)

# 5. The public wrapper drops ssm_state_indices: plain mode, row n of initial_state for sequence n.
q, k, v, g, beta = tokens(2)
pool = torch.randn(2, HV, K, V, device=dev)
o_public, _ = fused_recurrent_kda(q, k, v, g, beta, initial_state=pool.clone(), cu_seqlens=torch.tensor([0, 1, 2], device=dev),
                                  ssm_state_indices=torch.tensor([1, 0], device=dev, dtype=torch.int32))
o_plain, _ = fused_recurrent_kda(q, k, v, g, beta, initial_state=pool.clone(), cu_seqlens=torch.tensor([0, 1, 2], device=dev))
report("public wrapper", "ssm_state_indices is silently ignored (outputs equal those without it)",
       torch.equal(o_public, o_plain))

print(f"{len(REPRODUCED)} of 5 defects present" + (f": {', '.join(REPRODUCED)}" if REPRODUCED else ""))
sys.exit(1 if REPRODUCED else 0)
