"""FLA chunk_kda with grouped value heads (HV = 2 H): errors 4-8x those of the same
problem with the query/key heads repeated (HV = H), once T spans more than one 64-chunk.

GVA is, by definition, value head hv using query/key head hv // (HV / H): repeating q and
k along the head axis gives the same mathematical problem, so both calls must agree with
an fp64 recurrence equally well. Usage: python3 repro.py [FLA_DIR]. Exit 0 right, 1 defect."""
import os
import sys

for flag, value in (("FLA_DISABLE_BACKEND_DISPATCH", "1"), ("FLA_FLASH_KDA", "0"), ("FLA_TILELANG", "0")):
    os.environ.setdefault(flag, value)
if len(sys.argv) > 1:
    sys.path.insert(0, sys.argv[1])
import torch
from fla.ops.kda import chunk_kda

def recurrence_fp64(q, k, v, g, beta, scale):  # q, k already have HV heads
    B, T, HV, K = q.shape
    S = torch.zeros(B, HV, K, v.shape[-1], dtype=torch.float64, device=q.device)
    o = torch.zeros(*v.shape, dtype=torch.float64, device=q.device)
    for t in range(T):
        S = S * g[:, t].double().exp()[..., None]
        u = v[:, t].double() - torch.einsum("bhk,bhkv->bhv", k[:, t].double(), S)
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t].double(), beta[:, t].double()[..., None] * u)
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t].double() * scale, S)
    return o, S

def rel(a, b):
    return float((a.double() - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())

dev, H, HV, K, V = "cuda", 1, 2, 128, 64
torch.manual_seed(4)
failed = False
for T in (64, 100, 128):
    bf = lambda lo, hi, *s: (torch.rand(*s, device=dev) * (hi - lo) + lo).to(torch.bfloat16)
    q, k, v = bf(-1, 1, 1, T, H, K), bf(-1, 1, 1, T, H, K), bf(-1, 1, 1, T, HV, V)
    g, beta = bf(-1, 0, 1, T, HV, K), bf(0, 1, 1, T, HV)
    qr, kr = q.repeat_interleave(HV // H, 2), k.repeat_interleave(HV // H, 2)
    ro, rS = recurrence_fp64(qr, kr, v, g, beta, K ** -0.5)
    res = {}
    for name, (qq, kk) in (("GVA     ", (q, k)), ("repeated", (qr, kr))):
        o, S = chunk_kda(qq, kk, v, g, beta, scale=K ** -0.5, output_final_state=True)[:2]
        res[name] = (rel(o, ro), max(rel(S[:, h], rS[:, h]) for h in range(HV)))
        print(f"T={T:3} {name}: o rel RMS {res[name][0]:.2e}, worst head final state rel RMS {res[name][1]:.2e}")
    bad = res["GVA     "][1] > 3 * res["repeated"][1] or res["GVA     "][0] > 3 * res["repeated"][0]
    failed |= bad
print("DEFECT PRESENT" if failed else "no defect")
sys.exit(1 if failed else 0)
