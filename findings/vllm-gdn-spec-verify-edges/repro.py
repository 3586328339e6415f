#!/usr/bin/env python3
"""Standalone reproductions (PyTorch, Triton and vLLM's kernel files only, no k3ref) of what
vLLM's copies of the fused recurrent kernel do at the edges of their serving arguments.

GDN (vllm/model_executor/layers/fla/ops/fused_recurrent.py, 03c6dad8,
fused_recurrent_gated_delta_rule_fwd): an accepted count 0 enters from column -1 of the index
table (the previous row's last slot), and an index -1 addresses the slot before the pool.
KDA (--kda: kda.py's fused_recurrent_kda_fwd, f3b2a819, whose fused_recurrent.py has the same
entering index `ssm_state_indices + i_n * stride_indices_seq + num_accepted_tokens[i_n] - 1`;
its null-block guard `state_idx <= 0` skips padded sequences): an accepted count 0 enters from
the previous row's last slot.
Prints what it observed against the prediction; exits 1 while a predicted defect is present, 0
once none is, 77 without CUDA or the files. One process imports one vLLM tree, so the two
kernels (of two commits) run in two invocations.
Usage: python3 repro.py <dir holding vllm/model_executor/layers/fla/ops/>         (GDN)
       python3 repro.py --kda <dir holding that tree's kda.py, or whose kda/ does>  (KDA)
"""
import sys
import types
from pathlib import Path

try:
    import torch
except ImportError:
    print("torch not importable: skipped")
    sys.exit(77)
OPS = "vllm/model_executor/layers/fla/ops"
KDA = len(sys.argv) > 1 and sys.argv[1] == "--kda"
args = sys.argv[2:] if KDA else sys.argv[1:]
if not torch.cuda.is_available() or not args:
    print("needs a CUDA device and the directory holding vllm/: skipped")
    sys.exit(77)
root = Path(args[0])
if KDA and (root / "kda" / OPS / "kda.py").is_file():
    root = root / "kda"
wanted = root / OPS / ("kda.py" if KDA else "fused_recurrent.py")
if not wanted.is_file():
    print(f"no {wanted}: skipped")
    sys.exit(77)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# vLLM's packages without their __init__ files, and the modules the kernels import from vLLM.
for name in ("vllm", "vllm.model_executor", "vllm.model_executor.layers", "vllm.model_executor.layers.fla",
             "vllm.model_executor.layers.fla.ops", "vllm.utils"):
    sys.modules[name] = types.ModuleType(name)
    sys.modules[name].__path__ = [str(root.joinpath(*name.split(".")))]
utils = types.ModuleType("vllm.triton_utils")
utils.triton, utils.tl, utils.tldevice = triton, tl, None
sys.modules["vllm.triton_utils"] = utils
if KDA:
    class _Platform:
        @staticmethod
        def is_cuda_alike():
            return True

    class CustomOp(torch.nn.Module):  # kda.py's layer norm class derives from it (not called here)
        @classmethod
        def register(cls, name):
            return lambda op: op

    sys.modules["vllm.platforms"] = types.ModuleType("vllm.platforms")
    sys.modules["vllm.platforms"].current_platform = _Platform()
    sys.modules["vllm.model_executor.custom_op"] = types.ModuleType("vllm.model_executor.custom_op")
    sys.modules["vllm.model_executor.custom_op"].CustomOp = CustomOp
    from vllm.model_executor.layers.fla.ops.kda import fused_recurrent_kda_fwd  # noqa: E402
else:
    from vllm.model_executor.layers.fla.ops.fused_recurrent import fused_recurrent_gated_delta_rule_fwd  # noqa: E402

dev = "cuda"
if KDA:
    # 1'. num_accepted_tokens = 0 in kda.py's entry point. Index 0 is vLLM's null block, so the
    #     slots are 1..4; sequence 1 enters from index [1, -1] = [0, 1] = slot 2 (NaN here).
    H, HV, K, V = 2, 2, 16, 16  # fused_recurrent_kda_fwd allocates o like k: H K = HV V
    torch.manual_seed(0)
    T = 4
    q = torch.randn(1, T, H, K, device=dev).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, device=dev), dim=-1).bfloat16()
    v = torch.randn(1, T, HV, V, device=dev).bfloat16()
    g = -torch.rand(1, T, HV, K, device=dev)
    beta = torch.rand(1, T, HV, device=dev)
    pool = torch.randn(5, HV, V, K, device=dev)  # V-first
    pool[2] = float("nan")
    idx = torch.tensor([[1, 2], [3, 4]], device=dev, dtype=torch.int32)
    # inplace_final_state=False: the pool is only read (no race with sequence 0 writing slot 2)
    o, _ = fused_recurrent_kda_fwd(q, k, v, g, beta, K ** -0.5, pool, inplace_final_state=False,
                                   cu_seqlens=torch.tensor([0, 2, 4], device=dev), ssm_state_indices=idx,
                                   num_accepted_tokens=torch.tensor([1, 0], device=dev, dtype=torch.int32))
    torch.cuda.synchronize()
    nan = int(torch.isnan(o[0, 2:4].float()).sum())
    print(f"sequence 1's outputs: {nan} of {o[0, 2:4].numel()} NaN")
    REPRODUCED = [] if nan < o[0, 2:4].numel() else ["accepted count 0"]
    print(f"[{'as predicted' if REPRODUCED else 'NOT as predicted'}] accepted count 0 (KDA): sequence 1 reads "
          "slot 2, the previous row's last entry (NaN outputs)")
    print(f"{len(REPRODUCED)} of 1 predicted defect present")
    sys.exit(1 if REPRODUCED else 0)

H, HV, K, V = 1, 2, 16, 8
torch.manual_seed(0)
REPRODUCED = []


def tokens(T):
    q = torch.randn(1, T, H, K, device=dev).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, device=dev), dim=-1).bfloat16()
    v = torch.randn(1, T, HV, V, device=dev).bfloat16()
    g = -torch.rand(1, T, HV, device=dev)
    beta = torch.rand(1, T, HV, device=dev)
    return q, k, v, g, beta


def report(name, predicted, observed):
    print(f"[{'as predicted' if observed else 'NOT as predicted'}] {name}: {predicted}")
    if observed:
        REPRODUCED.append(name)


# 1. num_accepted_tokens = 0: sequence 1 enters from index [1, -1] = [0, 1], sequence 0's last
#    column (NaN here: a correct kernel never reads it) instead of rejecting the count.
q, k, v, g, beta = tokens(4)
pool = torch.randn(4, HV, K, V, device=dev)
pool[1] = float("nan")
idx = torch.tensor([[0, 1], [2, 3]], device=dev, dtype=torch.int32)
o, _ = fused_recurrent_gated_delta_rule_fwd(q, k, v, g, beta, K ** -0.5, pool, inplace_final_state=True,
                                            cu_seqlens=torch.tensor([0, 2, 4], device=dev), ssm_state_indices=idx,
                                            num_accepted_tokens=torch.tensor([1, 0], device=dev, dtype=torch.int32))
report("accepted count 0", "sequence 1 reads slot 1 (NaN outputs)", bool(torch.isnan(o[0, 2:4].float()).all()))

# 2. slot index -1 (a padded sequence): reads and writes the slot before the pool's start.
q, k, v, g, beta = tokens(2)
buffer = torch.zeros(4 * HV * K * V, device=dev)
buffer[: HV * K * V] = float("nan")  # slot -1 of the pool view below
pool = buffer[HV * K * V :].view(3, HV, K, V)
before = buffer[: HV * K * V].clone()
o, _ = fused_recurrent_gated_delta_rule_fwd(q, k, v, g, beta, K ** -0.5, pool, inplace_final_state=True,
                                            cu_seqlens=torch.tensor([0, 1, 2], device=dev),
                                            ssm_state_indices=torch.tensor([0, -1], device=dev, dtype=torch.int32))
changed = not torch.equal(buffer[: HV * K * V].isnan(), before.isnan()) or bool(torch.isnan(o[0, 1].float()).all())
report("index -1", "the padded sequence reads slot -1 (NaN output) and writes it", changed)

print(f"{len(REPRODUCED)} of 2 predicted defects present")
sys.exit(1 if REPRODUCED else 0)
