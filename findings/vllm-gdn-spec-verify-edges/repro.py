#!/usr/bin/env python3
"""Standalone reproductions (PyTorch, Triton and vLLM's fused_recurrent.py only, no k3ref) of
what vLLM's copy of the GDN fused recurrent kernel does at the edges of its serving arguments,
as read from vllm/model_executor/layers/fla/ops/fused_recurrent.py (03c6dad8): an accepted
count 0 enters from column -1 of the index table (the previous row's last slot), and an index
-1 addresses the slot before the pool. Prints what it observed against the prediction; exits 1
while a predicted defect is present, 0 once none is, 77 without CUDA or the file.
Usage: python3 repro.py <dir holding vllm/model_executor/layers/fla/ops/>
"""
import sys
import types
from pathlib import Path

try:
    import torch
except ImportError:
    print("torch not importable: skipped")
    sys.exit(77)
if not torch.cuda.is_available() or len(sys.argv) < 2:
    print("needs a CUDA device and the directory holding vllm/: skipped")
    sys.exit(77)
root = Path(sys.argv[1])
ops = root / "vllm/model_executor/layers/fla/ops"
if not (ops / "fused_recurrent.py").is_file():
    print(f"no {ops / 'fused_recurrent.py'}: skipped")
    sys.exit(77)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# vLLM's packages without their __init__ files, and the one module the kernel imports from vLLM.
for name in ("vllm", "vllm.model_executor", "vllm.model_executor.layers", "vllm.model_executor.layers.fla",
             "vllm.model_executor.layers.fla.ops"):
    sys.modules[name] = types.ModuleType(name)
    sys.modules[name].__path__ = [str(root.joinpath(*name.split(".")))]
utils = types.ModuleType("vllm.triton_utils")
utils.triton, utils.tl, utils.tldevice = triton, tl, None
sys.modules["vllm.triton_utils"] = utils
from vllm.model_executor.layers.fla.ops.fused_recurrent import fused_recurrent_gated_delta_rule_fwd  # noqa: E402

dev = "cuda"
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
