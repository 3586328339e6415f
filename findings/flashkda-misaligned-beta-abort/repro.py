"""FlashKDA flash_kda.fwd: a contiguous beta view 4 bytes off 16-byte alignment aborts the
whole process (CUTLASS TMA descriptor assertion) instead of raising or computing.

The view is what slicing one token out of a packed batch gives: beta[:, t:t+1] of a
[1, T, H] bf16 tensor with H = 2 starts 4 t bytes into the allocation and is contiguous.
Expected: the same output as for an aligned copy of the same values, or a Python
exception. Usage: python3 repro.py [FLASHKDA_DIR]. Exit 0 right, 1 defect present."""
import os
import subprocess
import sys

if len(sys.argv) > 1 and sys.argv[1] != "--child":
    sys.path.insert(0, sys.argv[1])
CHILD = "--child" in sys.argv
import torch
import flash_kda


def run(beta_view):
    torch.manual_seed(0)
    dev, T, H, K = "cuda", 1, 2, 128
    q, k, v, g = (torch.randn(1, T, H, K, device=dev, dtype=torch.bfloat16) for _ in range(4))
    out = torch.empty_like(v)
    A_log = torch.zeros(H, device=dev)
    dt_bias = torch.zeros(H, K, device=dev)
    flash_kda.fwd(q, k, v, g, beta_view, K ** -0.5, out, A_log, dt_bias, -5.0)
    torch.cuda.synchronize()
    return out


packed = torch.randn(1, 8, 2, device="cuda", dtype=torch.bfloat16)
view = packed[:, 1:2]  # contiguous, data_ptr % 16 == 4
if CHILD:
    got = run(view)
    want = run(view.clone())  # same values, 16-byte aligned allocation
    print("outputs equal:", torch.equal(got, want))
    sys.exit(0 if torch.equal(got, want) else 3)
print(f"beta view: contiguous={view.is_contiguous()}, data_ptr % 16 = {view.data_ptr() % 16}")
child = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child"], capture_output=True, text=True)
tail = (child.stderr.strip().splitlines() or [""])[-1]
print(f"child exit code {child.returncode}; last stderr line: {tail[:200]}")
ok = child.returncode == 0 or (child.returncode == 1 and "Error" in tail)  # raised: acceptable
print("no defect" if ok else "DEFECT PRESENT: the process died (signal %d)" % -child.returncode
      if child.returncode < 0 else "DEFECT PRESENT")
sys.exit(0 if ok else 1)
