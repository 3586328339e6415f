"""FlashKDA's sigmoid of beta, as its kernel computes it: 0.5 + 0.5 * tanh.approx.f32(x / 2) in
fp32 (csrc/smxx/utils.cuh at 1ce47ea), on the bf16 logits it loads.

For negative logits the sum cancels: 0.5 + 0.5 * t with t near -1 keeps only the bits of t
below 2^-1, so tanh.approx's absolute error (up to 7e-6 measured) becomes a large relative
error of beta. Measured on an H200 (sm_90) for all 65,536 bf16 logits: relative error below
1e-4 for x >= -4, up to 3.2e-3 in [-8, -4), 1.05e-2 (median 3.6e-3) in [-12, -8), beta = 0 for
x <= -16 and 1 for x >= 16. The contract of FlashKDA (contracts.py) takes beta from this table,
since no correctly rounded model reproduces it: with the exact sigmoid the contract missed a
case found by `prop` (T = 2, logits -8.7 and -12) at 2.04x; with the table it equals the
kernel bit for bit.

The table (data/flashkda_sigmoid_sm90.f32.gz: 65,536 little-endian fp32, indexed by the bf16
bit pattern of the logit) is measured, not derived; on a GPU with Triton regenerate it with

    python3 -m k3ref.gpu_check.flashkda_sigmoid --measure FILE
"""
import gzip
import sys
from pathlib import Path

import numpy as np
import torch

TABLE_PATH = Path(__file__).resolve().parent / "data" / "flashkda_sigmoid_sm90.f32.gz"
_TABLE = []


def table():
    """The 65,536 measured values (float32 numpy array), indexed by a bf16 bit pattern."""
    if not _TABLE:
        raw = gzip.decompress(TABLE_PATH.read_bytes())
        if len(raw) != 65536 * 4:
            raise ValueError(f"{TABLE_PATH}: {len(raw)} bytes, expected 262144 (65,536 fp32 values)")
        _TABLE.append(np.frombuffer(raw, dtype="<f4").copy())
    return _TABLE[0]


def sigmoid(logits):
    """FlashKDA's beta for logits that are bf16 values (any float dtype holding them exactly),
    float64 on the CPU, same shape. A logit that is not a bf16 value is an error: the kernel
    loads bf16, so such an input was not what it received."""
    x = logits.detach().cpu()
    b = x.to(torch.bfloat16)
    if not bool(((b.double() == x.double()) | torch.isnan(x.double())).all()):
        raise ValueError("flashkda_sigmoid: beta logits must be bf16 values (the kernel loads bf16)")
    idx = b.view(torch.int16).numpy().astype(np.uint16)
    return torch.from_numpy(table()[idx].astype(np.float64))


def measure(path):
    """Runs tanh.approx.f32 through Triton on every bf16 logit and writes the table to `path`."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, o_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        x = tl.load(x_ptr + i, mask=m, other=0.0)
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x * 0.5], dtype=tl.float32,
                                      is_pure=True, pack=1)
        tl.store(o_ptr + i, t * 0.5 + 0.5, mask=m)

    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float().cuda()
    o = torch.empty_like(x)
    kernel[(64,)](x, o, x.numel(), BLOCK=1024)
    torch.cuda.synchronize()
    with gzip.GzipFile(path, "wb", mtime=0) as f:
        f.write(o.cpu().numpy().astype("<f4").tobytes())


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--measure":
        measure(sys.argv[2])
        sys.exit(0)
    print("usage: python3 -m k3ref.gpu_check.flashkda_sigmoid --measure FILE", file=sys.stderr)
    sys.exit(2)
