#!/usr/bin/env python3
"""Runs the C++ double recurrence benchmark and, beside it, a plain PyTorch float64 loop
of the same recurrence on the same cores, and prints the throughput ratio.

Usage: bench/compare_with_torch.py [BUILD_DIR] [--threads N] [--torch-tokens T]
Needs PyTorch for the comparison (Debian: python3-torch, run with /usr/bin/python3);
without it only the C++ figure is printed.
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def cpp_throughput(build_dir, threads, name="kda_recurrent_benchmark"):
    exe = Path(build_dir) / "bench" / name
    if not exe.exists():
        return None
    out = subprocess.run(
        [str(exe), f"--benchmark_filter=BM_KdaRecurrentDouble/T:4096/H:4/threads:{threads}/",
         "--benchmark_format=json", "--benchmark_min_time=2"],
        check=True, capture_output=True, text=True).stdout
    runs = json.loads(out)["benchmarks"]
    return runs[0]["token_heads_per_s"], runs[0]["GFLOP_per_s"]


def torch_throughput(threads, tokens, H=4, K=128, V=128):
    import torch
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    q = torch.rand(tokens, H, K, generator=g, dtype=torch.float64) * 2 - 1
    k = torch.rand(tokens, H, K, generator=g, dtype=torch.float64) * 2 - 1
    v = torch.rand(tokens, H, V, generator=g, dtype=torch.float64) * 2 - 1
    gate = -torch.rand(tokens, H, K, generator=g, dtype=torch.float64)
    beta = torch.rand(tokens, H, generator=g, dtype=torch.float64)
    start = time.perf_counter()
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    S = torch.zeros(H, K, V, dtype=torch.float64)
    o = torch.empty(tokens, H, V, dtype=torch.float64)
    scale = K ** -0.5
    for t in range(tokens):  # the plain loop a user would write: all heads at once, one token at a time
        S = S * gate[t].exp()[:, :, None]
        kS = torch.einsum("hk,hkv->hv", k[t], S)
        S = S + beta[t][:, None, None] * k[t][:, :, None] * (v[t] - kS)[:, None, :]
        o[t] = torch.einsum("hk,hkv->hv", q[t] * scale, S)
    return tokens * H / (time.perf_counter() - start)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build_dir", nargs="?", default="build")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--torch-tokens", type=int, default=1024)
    args = ap.parse_args()
    # As built (the project's flags), and with -march=native (the flags of -Dnative=true)
    # when that program was built.
    runs = [("k3ref double recurrence", cpp_throughput(args.build_dir, args.threads)),
            ("  ... with -march=native", cpp_throughput(args.build_dir, args.threads, "kda_recurrent_benchmark_native"))]
    if runs[0][1] is None:
        print(f"{args.build_dir}/bench/kda_recurrent_benchmark not found (configure with -Dbenchmarks=enabled)")
        return 1
    for label, result in runs:
        if result is not None:
            print(f"{label:24s}: {result[0]:12.0f} token-heads/s ({result[1]:.2f} GFLOP/s, {args.threads} threads)")
    try:
        torch_rate = torch_throughput(args.threads, args.torch_tokens)
    except ImportError:
        print("PyTorch not importable: no comparison (Debian: apt-get install python3-torch; run /usr/bin/python3)")
        return 0
    print(f"{'PyTorch float64 loop':24s}: {torch_rate:12.0f} token-heads/s ({args.threads} threads)")
    print(f"{'ratio':24s}: {runs[0][1][0] / torch_rate:12.1f}x")
    if runs[1][1] is not None:
        print(f"{'ratio, -march=native':24s}: {runs[1][1][0] / torch_rate:12.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
