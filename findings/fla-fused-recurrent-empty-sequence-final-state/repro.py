"""FLA fused_recurrent_kda, varlen: the final state of an empty sequence is never written.

Expected: a sequence with no tokens leaves its state unchanged, so its final state equals
its initial state (zero when no initial state is given). Usage: python3 repro.py [FLA_DIR]
Exit 0 when the kernel is right, 1 when the defect is present."""
import os
import sys

os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")
os.environ.setdefault("FLA_FLASH_KDA", "0")
os.environ.setdefault("FLA_TILELANG", "0")
if len(sys.argv) > 1:
    sys.path.insert(0, sys.argv[1])
import torch
from fla.ops.kda import fused_recurrent_kda

torch.manual_seed(0)
dev, H, K, V = "cuda", 2, 64, 64
cu = torch.tensor([0, 5, 5, 9], device=dev)  # sequence 1 is empty
T, N = int(cu[-1]), cu.numel() - 1
q, k = (torch.randn(1, T, H, K, device=dev, dtype=torch.bfloat16) for _ in range(2))
v = torch.randn(1, T, H, V, device=dev, dtype=torch.bfloat16)
g = (-torch.rand(1, T, H, K, device=dev)).to(torch.bfloat16)
beta = torch.rand(1, T, H, device=dev).to(torch.bfloat16)
failed = False
for with_h0 in (True, False):
    h0 = torch.randn(N, H, K, V, device=dev) if with_h0 else None
    # Leave NaN in the caching allocator's free block that the final state will reuse.
    junk = torch.full((N, H, K, V), float("nan"), device=dev)
    del junk
    _, ht = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                cu_seqlens=cu)
    want = h0[1] if with_h0 else torch.zeros(H, K, V, device=dev)
    got = ht[1]
    bad = not torch.equal(got, want)
    failed |= bad
    print(f"initial_state={'given' if with_h0 else 'none '}: empty sequence's final state "
          f"{'WRONG' if bad else 'right'}: NaN {int(got.isnan().sum())}/{got.numel()}, "
          f"max |got - want| {float((got - want).abs().nan_to_num(float('inf')).max()):.3g}")
print("DEFECT PRESENT" if failed else "no defect")
sys.exit(1 if failed else 0)
