"""FLA chunk_kda(safe_gate=True): outputs depend on later tokens.

Causality: o_t is a function of tokens 0..t only, so changing the inputs of tokens >= 37
must leave o_0 .. o_36 bit-for-bit unchanged (every kernel without safe_gate does so).
With safe_gate=True the intra-chunk kernel subtracts the gate of an anchor row (the middle
of each 16-token sub-chunk) before exp2, so tokens 32..36 see the gate of token 40.
Usage: python3 repro.py [FLA_DIR]. Exit 0 right, 1 defect present."""
import os
import sys

os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")
os.environ.setdefault("FLA_FLASH_KDA", "0")
os.environ.setdefault("FLA_TILELANG", "0")
if len(sys.argv) > 1:
    sys.path.insert(0, sys.argv[1])
import torch
from fla.ops.kda import chunk_kda

dev, T, H, K, V, P = "cuda", 64, 2, 128, 128, 37
gen = torch.Generator(device=dev).manual_seed(0)
def r(*s, lo=-1.0, hi=1.0):
    return (torch.rand(*s, device=dev, generator=gen) * (hi - lo) + lo).to(torch.bfloat16)
q, k, v = r(1, T, H, K), r(1, T, H, K), r(1, T, H, V)
g, beta = r(1, T, H, K, lo=-4, hi=4), r(1, T, H, lo=-4, hi=4)
A_log, dt_bias = torch.zeros(H, device=dev), torch.zeros(H * K, device=dev)

def run(safe_gate, g_in):
    o, _ = chunk_kda(q, k, v, g_in, beta, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True,
                     lower_bound=-5.0, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                     safe_gate=safe_gate, output_final_state=True)
    return o.float()

g2 = g.clone()
g2[:, P:] = r(1, T - P, H, K, lo=-4, hi=4)  # only tokens >= P change
failed = False
for safe in (False, True):
    a, b = run(safe, g), run(safe, g2)
    d = (a[:, :P] - b[:, :P]).abs().amax(dim=(2, 3))[0]
    changed = [t for t in range(P) if d[t] > 0]
    print(f"safe_gate={safe}: tokens < {P} whose output changed: {changed or 'none'}; "
          f"max |delta| {float(d.max()):.3g} (output scale {float(a.abs().max()):.3g})")
    failed |= safe and bool(changed)
print("DEFECT PRESENT" if failed else "no defect")
sys.exit(1 if failed else 0)
