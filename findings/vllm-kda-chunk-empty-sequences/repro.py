#!/usr/bin/env python3
"""Standalone reproduction (PyTorch, Triton and vLLM's KDA ops only, no k3ref) of vLLM's chunked
KDA prefill (kda.py chunk_kda / chunk_kda_with_fused_gate) on a varlen batch with empty
sequences: prepare_chunk_indices (index.py) numbers the chunks' sequences with
`indices.eq(0).cumsum(0) - 1`, which counts only the sequences that have chunks, so after an
empty sequence every chunk is given the wrong sequence: a chunk lands on an empty sequence
(T = 0, a no-op) and the last sequences' chunks are never computed. Their outputs keep what
was in v's memory (o is written into v) and their final states are built from torch.empty
w/u/gate buffers; a chunk computed at another position reads that position's chunk state
in the output kernel. Run once with vLLM's table and once with the same kernels given a correct
table (one row per chunk of each sequence, in order): the second must agree with an fp64
reference, the first is wrong on exactly the sequences the table predicts.

Prints what it observed against the prediction; exits 1 while the defect is present, 0 once
it is not, 77 without CUDA or the files.
Usage: python3 repro.py <dir holding vllm/model_executor/layers/fla/ops/kda.py>
       (a directory whose kda/ subdirectory holds that tree is taken as kda/)
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
if not torch.cuda.is_available() or len(sys.argv) < 2:
    print("needs a CUDA device and the directory holding vllm/: skipped")
    sys.exit(77)
root = Path(sys.argv[1])
if (root / "kda" / OPS / "kda.py").is_file():
    root = root / "kda"
if not (root / OPS / "kda.py").is_file():
    print(f"no {root / OPS / 'kda.py'}: skipped")
    sys.exit(77)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# vLLM's packages without their __init__ files, and the modules the ops import from the rest of vLLM.
for name in ("vllm", "vllm.model_executor", "vllm.model_executor.layers", "vllm.model_executor.layers.fla",
             "vllm.model_executor.layers.fla.ops", "vllm.utils"):
    sys.modules[name] = types.ModuleType(name)
    sys.modules[name].__path__ = [str(root.joinpath(*name.split(".")))]
shim = types.ModuleType("vllm.triton_utils")
shim.triton, shim.tl = triton, tl
try:
    from triton.language.extra import libdevice as tldevice
except ImportError:
    tldevice = None
shim.tldevice = tldevice
sys.modules[shim.__name__] = shim


class _Platform:
    @staticmethod
    def is_cuda_alike():
        return True


platforms = types.ModuleType("vllm.platforms")
platforms.current_platform = _Platform()
sys.modules[platforms.__name__] = platforms


class CustomOp(torch.nn.Module):  # kda.py's layer norm class derives from it (not called here)
    @classmethod
    def register(cls, name):
        return lambda op: op


custom_op = types.ModuleType("vllm.model_executor.custom_op")
custom_op.CustomOp = CustomOp
sys.modules[custom_op.__name__] = custom_op
import vllm.model_executor.layers.fla.ops.kda as kda  # noqa: E402
from vllm.model_executor.layers.fla.ops import chunk_delta_h, cumsum, solve_tril  # noqa: E402

VLLM_TABLE = kda.prepare_chunk_indices
# Every module that builds the table itself (kda.py calls solve_tril without its chunk_indices).
USERS = (kda, solve_tril, cumsum, chunk_delta_h)
CHUNK = 64


def correct_table(cu_seqlens, chunk_size):
    """One row (sequence, chunk within it) per chunk, sequences in order, empty ones holding none."""
    counts = (cu_seqlens[1:] - cu_seqlens[:-1] + chunk_size - 1) // chunk_size
    seq = torch.repeat_interleave(torch.arange(len(counts), device=cu_seqlens.device), counts)
    start = torch.cumsum(counts, 0) - counts
    return torch.stack([seq, torch.arange(len(seq), device=cu_seqlens.device) - start[seq]], 1).to(cu_seqlens)


def reference(q, k, v, g, beta, h0, cu, scale):
    """fp64 KDA recurrence, V-first states [N, HV, V, K], q and k L2-normalised, g natural-log decays."""
    q = torch.nn.functional.normalize(q[0].double().cpu(), dim=-1)
    k = torch.nn.functional.normalize(k[0].double().cpu(), dim=-1)
    v, g, beta = v[0].double().cpu(), g[0].double().cpu(), beta[0].double().cpu()
    o = torch.zeros_like(v)
    finals = []
    for n in range(len(cu) - 1):
        S = h0[n].double().clone()
        for t in range(int(cu[n]), int(cu[n + 1])):
            S = S * torch.exp(g[t])[:, None, :]
            u = beta[t][:, None] * (v[t] - torch.einsum("hvk,hk->hv", S, k[t]))
            S = S + u[:, :, None] * k[t][:, None, :]
            o[t] = scale * torch.einsum("hvk,hk->hv", S, q[t])
        finals.append(S)
    return o, torch.stack(finals)


def rel(x, ref):
    x, ref = x.double().cpu(), ref.double().cpu()
    if not torch.isfinite(x).all():
        return float("inf")
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


dev, H, K, V = "cuda", 2, 64, 64
TOL = 3e-2  # bf16 operands: the fixed-table run measures ~1e-3..1e-2
torch.manual_seed(0)
results = []
for lengths in ([3, 0, 4, 0, 0, 5, 0], [100, 0, 70], [0, 70, 0, 3]):
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), device=dev, dtype=torch.int64)
    T, N = int(cu[-1]), len(lengths)
    q = torch.randn(1, T, H, K, device=dev).bfloat16()
    k = torch.randn(1, T, H, K, device=dev).bfloat16()
    v = torch.randn(1, T, H, V, device=dev).bfloat16()
    raw = torch.randn(1, T, H, K, device=dev).bfloat16()
    A_log = torch.rand(H, device=dev)
    dt_bias = 0.1 * torch.randn(H * K, device=dev)
    beta = torch.rand(1, T, H, device=dev)
    h0 = torch.randn(N, H, V, K, device=dev)
    g_log = (-torch.exp(A_log)[None, None, :, None]
             * torch.nn.functional.softplus(raw.float() + dt_bias.view(H, K))).float()
    ref_o, ref_final = reference(q, k, v, g_log, beta, h0.cpu(), cu.cpu(), K ** -0.5)
    vt, ct = VLLM_TABLE(cu, CHUNK), correct_table(cu, CHUNK)
    # A sequence is wrong when one of its chunks is not at its own position in vLLM's table: the
    # chunk is then either never computed (w, u, the gate cumsum left torch.empty, the inverse
    # zero) or computed at another position, where the output kernel reads the chunk state h of
    # that position (h is stored per sequence at chunk_offsets) -- o wrong, final state right.
    predicted = sorted({c[0] for c, w in zip(ct.tolist(), vt.tolist()) if c != w})
    print(f"lengths {lengths}: vLLM's chunk table {vt.tolist()}, correct {ct.tolist()}; "
          f"sequences predicted wrong: {predicted}")
    for entry in ("chunk_kda", "chunk_kda_with_fused_gate"):
        wrong = {}
        for table, label in ((VLLM_TABLE, "vllm"), (correct_table, "fixed")):
            for m in USERS:
                m.prepare_chunk_indices = table
            kw = dict(scale=None, initial_state=h0.clone(), output_final_state=True, use_qk_l2norm_in_kernel=True,
                      cu_seqlens=cu)
            if entry == "chunk_kda":
                o, final = kda.chunk_kda(q, k, v.clone(), g_log, beta, **kw)
            else:
                o, final = kda.chunk_kda_with_fused_gate(q, k, v.clone(), raw, beta, A_log, dt_bias, **kw)
            torch.cuda.synchronize()
            bad = []
            for n in range(N):
                a, b = int(cu[n]), int(cu[n + 1])
                if b == a:
                    if not torch.equal(final[n], h0[n]):
                        bad.append((n, "state of an empty sequence changed"))
                    continue
                eo, es = rel(o[0, a:b], ref_o[a:b]), rel(final[n], ref_final[n])
                if not (eo <= TOL and es <= TOL):
                    bad.append((n, f"o {eo:.2e}, final state {es:.2e}"))
            wrong[label] = bad
            print(f"  {entry:26s} {label:5s} table: " + ("every sequence right" if not bad else
                  "wrong: " + "; ".join(f"sequence {n} ({why})" for n, why in bad)))
        for m in USERS:
            m.prepare_chunk_indices = VLLM_TABLE
        observed = sorted(n for n, _ in wrong["vllm"])
        results.append((lengths, entry, observed == predicted and bool(predicted), observed, wrong["fixed"]))

present = [r for r in results if r[3]]
for lengths, entry, as_predicted, observed, fixed in results:
    print(f"[{'as predicted' if as_predicted else 'NOT as predicted'}] {entry} {lengths}: wrong sequences "
          f"{observed}" + (f"; with a correct table still wrong: {fixed}" if fixed else "; a correct table fixes it"))
print(f"defect present in {len(present)} of {len(results)} runs" if present else "no defect")
sys.exit(1 if present else 0)
