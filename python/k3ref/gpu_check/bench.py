"""Throughput of the comparator against the device copy bandwidth, and the fp64 reference's
time for the K3 shape (96 heads, K = V = 128) over 10^6 tokens.

python3 -m k3ref.gpu_check.bench [--elements N] [--tokens T] [--chunk C]"""
import argparse
import json
import time

import torch

from . import checks, lib, metrics, references


def _median_ms(fn, reps=5):
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def comparator(n):
    out = {}
    # Device copy bandwidth: a large device-to-device copy, bytes read plus bytes written.
    src = torch.rand(n, dtype=torch.float64, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    ms = _median_ms(lambda: dst.copy_(src))
    out["copy_GBps"] = 2 * n * 8 / ms / 1e6
    del dst
    ref = src
    cand = (ref * (1 + 1e-3 * torch.randn(n, device="cuda", dtype=torch.float32))).to(torch.bfloat16)
    lib.compare(cand, ref, torch.bfloat16)  # warm-up
    window = (96 * 128, n // (96 * 128), 1024)
    for name, ws in (("no_windows", None), ("windows", window)):
        ms = _median_ms(lambda: lib.compare(cand, ref, torch.bfloat16, window_shape=ws))
        gbps = n * (2 + 8) / ms / 1e6
        out[f"compare_bf16_vs_f64_{name}_ms"] = ms
        out[f"compare_bf16_vs_f64_{name}_GBps"] = gbps
        out[f"compare_bf16_vs_f64_{name}_fraction_of_copy"] = gbps / out["copy_GBps"]
    ref32 = ref.float()
    del ref
    ms = _median_ms(lambda: lib.compare(cand, ref32, torch.bfloat16))
    out["compare_bf16_vs_f32_GBps"] = n * 6 / ms / 1e6
    out["compare_bf16_vs_f32_fraction_of_copy"] = out["compare_bf16_vs_f32_GBps"] / out["copy_GBps"]
    # The GPU comparator against k3ref::check's on a slice: same figures.
    m1 = metrics.compare(cand[: 1 << 22], ref32[: 1 << 22].double(), torch.bfloat16, backend="cuda")
    m2 = metrics.compare(cand[: 1 << 22].cpu(), ref32[: 1 << 22].double().cpu(), torch.bfloat16)
    out["compare_cuda_vs_k3ref_rel_rms"] = [m1.rel_rms, m2.rel_rms]
    out["compare_cuda_vs_k3ref_max_ulp"] = [m1.max_ulp, m2.max_ulp, m1.max_ulp_index, m2.max_ulp_index]
    out["compare_cuda_vs_k3ref_floor"] = [m1.floor_rel_rms, m2.floor_rel_rms]
    out["elements"] = n
    return out


def k3_params():
    return dict(gate="lower_bound", lower_bound=-5.0, beta="sigmoid", qk_l2norm=True, scale=None,
                state_layout="k_first")


def k3_inputs(T, H, K, V, gen_seed, device="cuda"):
    g = torch.Generator(device=device).manual_seed(gen_seed)
    r = lambda *s: (torch.rand(*s, generator=g, device=device) * 2 - 1).to(torch.bfloat16)
    return {"q": r(1, T, H, K), "k": r(1, T, H, K), "v": r(1, T, H, V), "g": r(1, T, H, K) * 4, "beta": r(1, T, H) * 4}


def long_reference(tokens, chunk, H=96, K=128, V=128):
    """fp64 recurrence over `tokens` tokens, in segments of `chunk` with the fp64 state carried."""
    params = k3_params()
    gen = torch.Generator(device="cuda").manual_seed(11)
    A_log = (torch.rand(H, generator=gen, device="cuda") - 0.5)
    dt_bias = (torch.rand(H, K, generator=gen, device="cuda") - 0.5)
    state = torch.zeros(1, H, K, V, dtype=torch.float64, device="cuda")
    kernel_ms = 0.0
    t0 = time.time()
    checksum = 0.0
    for seg, begin in enumerate(range(0, tokens, chunk)):
        T = min(chunk, tokens - begin)
        inputs = k3_inputs(T, H, K, V, 1000 + seg)
        inputs.update(A_log=A_log, dt_bias=dt_bias, initial_state=state)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        o, state = lib.kda_forward(inputs, params, precision=0)
        b.record()
        b.synchronize()
        kernel_ms += a.elapsed_time(b)
        checksum += float(o[0, -1].abs().sum())
        del o, inputs
    wall = time.time() - t0
    return {"tokens": tokens, "heads": H, "K": K, "V": V, "segment_tokens": chunk, "kernel_seconds": kernel_ms / 1e3,
            "wall_seconds_incl_input_generation": wall, "finite": bool(state.isfinite().all()), "checksum": checksum}


def reference_agreement(T=300, H=2, K=128, V=128):
    """The fp64 GPU recurrence against k3ref's compiled reference in double (K3 options), and itself split in two."""
    params = k3_params()
    inputs = k3_inputs(T, H, K, V, 5)
    inputs["A_log"] = torch.rand(H, device="cuda") - 0.5
    inputs["dt_bias"] = torch.rand(H, K, device="cuda") - 0.5
    inputs["initial_state"] = torch.rand(1, H, K, V, dtype=torch.float64, device="cuda")
    o, f = lib.kda_forward(inputs, params, precision=0)
    o_t, f_t = references.kda({k: v.cpu() for k, v in inputs.items()}, params)
    o_t, f_t = o_t.to(o.device), f_t.to(o.device)
    m = metrics.compare(o.cpu(), o_t.cpu(), torch.float64)
    first = checks.token_range(inputs, 0, 131)
    second = checks.token_range(inputs, 131, None)
    o1, f1 = lib.kda_forward(first, params, precision=0)
    second["initial_state"] = f1
    o2, f2 = lib.kda_forward(second, params, precision=0)
    split_equal = bool(torch.equal(torch.cat([o1, o2], 1), o)) and bool(torch.equal(f2, f))
    return {"gpu_vs_torch_rel_rms": m.rel_rms, "split_bitwise_equal": split_equal}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--elements", type=int, default=1 << 31)
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--chunk", type=int, default=125_000)
    args = ap.parse_args(argv)
    assert lib.available(), lib.load_error()
    res = {"device": torch.cuda.get_device_name()}
    res["reference_agreement"] = reference_agreement()
    print(json.dumps(res), flush=True)
    res["comparator"] = comparator(args.elements)
    print(json.dumps(res["comparator"]), flush=True)
    torch.cuda.empty_cache()
    res["long_reference"] = long_reference(args.tokens, args.chunk)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
