"""Throughput of the comparator against the device copy bandwidth, and the fp64 reference's
time for the K3 shape (96 heads, K = V = 128) over 10^6 tokens (its fast form, precision 2),
with the plain kernel (precision 0, the definition) timed on one shorter segment beside the
fast form and compared bit for bit; with --roofline, the roofline table of the KDA kernels
instead.

python3 -m k3ref.gpu_check.bench [--elements N] [--tokens T] [--chunk C] [--plain-tokens P] [--no-comparator]
python3 -m k3ref.gpu_check.bench --roofline [--heads H] [--json OUT] [--measurement OUT]
python3 -m k3ref.gpu_check.bench --backward T [--heads H]   # the fp64 backward's time on T tokens

The roofline: for FLA's chunk_kda and fused_recurrent_kda and FlashKDA at K = V = 128, prefill
of T in ROOFLINE_PREFILL_T tokens and decode of ROOFLINE_DECODE_BATCH sequences of one token,
the cost model's FLOPs and bytes (k3ref.cost: FlashKDA's chunked-prefill model at the kernel's
chunk size, the decode model per token for the token-by-token kernels), the measured time (CUDA
events, median of warm calls), and the fractions of the device's peaks reached. The peaks are
measured on the device in the same run: bf16 and fp32 FLOP/s by a large matmul, bytes/s by a
large device-to-device copy (bytes read plus bytes written)."""
import argparse
import json
import time

import torch

from . import lib, metrics, references
from .cli import kernel_path_options
from .protocol import RunOptions, kernel_paths_of
from .problems import token_range
from .protocol import bits


def _median_ms(fn, reps=5):
    """Median of `reps` CUDA-event timings of fn(), each on a warm device."""
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


def _k3_gate_inputs(H, K):
    gen = torch.Generator(device="cuda").manual_seed(11)
    return (torch.rand(H, generator=gen, device="cuda") - 0.5), (torch.rand(H, K, generator=gen, device="cuda") - 0.5)


def _timed_forward(inputs, params, precision):
    """(o, final state, kernel ms) of one call, timed by CUDA events on a synchronised device."""
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    o, state = lib.kda_forward(inputs, params, precision=precision)
    b.record()
    b.synchronize()
    return o, state, a.elapsed_time(b)


def long_reference(tokens, chunk, H=96, K=128, V=128, precision=2):
    """fp64 recurrence (the reference's fast form, precision 2, unless told) over `tokens` tokens, in segments of
    `chunk` with the fp64 state carried."""
    params = k3_params()
    A_log, dt_bias = _k3_gate_inputs(H, K)
    state = torch.zeros(1, H, K, V, dtype=torch.float64, device="cuda")
    kernel_ms = 0.0
    t0 = time.time()
    checksum = 0.0
    for seg, begin in enumerate(range(0, tokens, chunk)):
        T = min(chunk, tokens - begin)
        inputs = k3_inputs(T, H, K, V, 1000 + seg)
        inputs.update(A_log=A_log, dt_bias=dt_bias, initial_state=state)
        o, state, ms = _timed_forward(inputs, params, precision)
        kernel_ms += ms
        checksum += float(o[0, -1].abs().sum())
        del o, inputs
    wall = time.time() - t0
    return {"tokens": tokens, "heads": H, "K": K, "V": V, "segment_tokens": chunk, "kernel_seconds": kernel_ms / 1e3,
            "wall_seconds_incl_input_generation": wall, "finite": bool(state.isfinite().all()), "checksum": checksum,
            "kernel": {0: "plain (precision 0)", 2: "fast form (precision 2)"}.get(precision, precision)}


def fast_against_plain(tokens, H=96, K=128, V=128):
    """The fp64 reference's fast form (precision 2) and its plain kernel (precision 0) on the
    first segment of long_reference (`tokens` tokens from the zero state): their kernel times,
    the ratio, and whether o and the final state are bit for bit equal."""
    params = k3_params()
    A_log, dt_bias = _k3_gate_inputs(H, K)
    inputs = k3_inputs(tokens, H, K, V, 1000)
    inputs.update(A_log=A_log, dt_bias=dt_bias, initial_state=torch.zeros(1, H, K, V, dtype=torch.float64, device="cuda"))
    o_t, f_t, ms_t = _timed_forward(inputs, params, 2)
    o_p, f_p, ms_p = _timed_forward(inputs, params, 0)
    same = bool(torch.equal(bits(o_t), bits(o_p))) and bool(torch.equal(bits(f_t), bits(f_p)))
    return {"tokens": tokens, "fast_kernel_seconds": ms_t / 1e3, "plain_kernel_seconds": ms_p / 1e3,
            "plain_over_fast": ms_p / ms_t, "bitwise_equal": same}


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
    first = token_range(inputs, 0, 131)
    second = token_range(inputs, 131, None)
    o1, f1 = lib.kda_forward(first, params, precision=0)
    second["initial_state"] = f1
    o2, f2 = lib.kda_forward(second, params, precision=0)
    split_equal = bool(torch.equal(torch.cat([o1, o2], 1), o)) and bool(torch.equal(f2, f))
    return {"gpu_vs_torch_rel_rms": m.rel_rms, "split_bitwise_equal": split_equal}


ROOFLINE_PREFILL_T = (4096, 32768)
ROOFLINE_DECODE_BATCH = (1, 64)
# The chunk each kernel's prefill runs in (the cost model's C): FLA's chunk_kda uses chunks of
# 64, FlashKDA of 16; fused_recurrent_kda is token by token (the decode model per token).
ROOFLINE_KERNELS = {"fla.chunk_kda": 64, "fla.fused_recurrent_kda": None, "flashkda.fwd": 16}


def device_peaks(matmul_n=8192, copy_elements=1 << 28):
    """The device's peaks, measured: {"bf16_flops", "fp32_flops", "copy_bytes"} per second."""
    out = {}
    for name, dtype in (("bf16_flops", torch.bfloat16), ("fp32_flops", torch.float32)):
        a = torch.randn(matmul_n, matmul_n, device="cuda", dtype=dtype)
        b = torch.randn(matmul_n, matmul_n, device="cuda", dtype=dtype)
        a @ b  # warm: cuBLAS picks its kernel
        out[name] = 2 * matmul_n**3 / (_median_ms(lambda: a @ b, reps=10) / 1e3)
    src = torch.empty(copy_elements, device="cuda", dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    out["copy_bytes"] = 2 * src.numel() * 4 / (_median_ms(lambda: dst.copy_(src), reps=10) / 1e3)
    out["tf32_allowed"] = bool(torch.backends.cuda.matmul.allow_tf32)
    return out


def _roofline_case(adapter, chunk, mode, size, H, K=128, V=128, reps=10):
    from .. import cost
    params = k3_params()
    if mode == "prefill":
        inputs = k3_inputs(size, H, K, V, 21)
        model = (cost.prefill(tokens=size, head_dim=K, chunk=chunk, heads=H)["total"] if chunk else
                 cost.decode(head_dim=K, heads=H, tokens=size))
    else:
        inputs = {n: t.expand(size, *t.shape[1:]).contiguous() for n, t in k3_inputs(1, H, K, V, 22).items()}
        inputs["initial_state"] = torch.rand(size, H, K, V, device="cuda", dtype=torch.float32) * 0.1
        model = cost.decode(head_dim=K, heads=H, tokens=size)
    gen = torch.Generator(device="cuda").manual_seed(23)
    inputs["A_log"] = torch.rand(H, generator=gen, device="cuda") - 0.5
    inputs["dt_bias"] = torch.rand(H, K, generator=gen, device="cuda") - 0.5
    for _ in range(3):  # autotuning and compilation happen here, outside the timing
        adapter.run(inputs, params)
    torch.cuda.synchronize()
    ms = _median_ms(lambda: adapter.run(inputs, params), reps=reps)
    return {"model": "prefill C=%d" % chunk if chunk and mode == "prefill" else "decode per token",
            "flops": model["flops"], "bytes": model["bytes"], "ms": ms}


def roofline(H=96, reps=10, on_row=None, options=None):
    """Rows of the roofline table (a failing kernel or shape is a row with its error);
    on_row(result so far) after each row, so a run cut short keeps what it measured.
    `options`: the run's RunOptions (the kernels' checkout paths)."""
    from . import registry
    peaks = device_peaks()
    rows = []
    for name, chunk in ROOFLINE_KERNELS.items():
        try:
            adapter = registry.kernel_by_name(name, options=options)  # the built-in adapter, as prop --kernel finds it
            adapter.load()
        except Exception as e:
            rows.append({"kernel": name, "error": f"not loaded: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})
            continue
        for mode, sizes in (("prefill", ROOFLINE_PREFILL_T), ("decode", ROOFLINE_DECODE_BATCH)):
            for size in sizes:
                row = {"kernel": name, "mode": mode, ("T" if mode == "prefill" else "batch"): size, "heads": H, "K": 128, "V": 128}
                try:
                    row.update(_roofline_case(adapter, chunk, mode, size, H, reps=reps))
                    sec = row["ms"] / 1e3
                    row.update({"flops_per_second": row["flops"] / sec, "bytes_per_second": row["bytes"] / sec,
                                "fraction_bf16_peak": row["flops"] / sec / peaks["bf16_flops"],
                                "fraction_fp32_peak": row["flops"] / sec / peaks["fp32_flops"],
                                "fraction_copy_bandwidth": row["bytes"] / sec / peaks["copy_bytes"]})
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                rows.append(row)
                torch.cuda.empty_cache()
                if on_row:
                    on_row({"device": torch.cuda.get_device_name(), "heads": H, "peaks": peaks, "rows": rows})
    return {"device": torch.cuda.get_device_name(), "heads": H, "peaks": peaks, "rows": rows}


def roofline_table(res):
    lines = [f"peaks: bf16 {res['peaks']['bf16_flops'] / 1e12:.0f} TFLOP/s, fp32 {res['peaks']['fp32_flops'] / 1e12:.1f} "
             f"TFLOP/s, copy {res['peaks']['copy_bytes'] / 1e9:.0f} GB/s",
             f"{'kernel':<24} {'shape':<12} {'GFLOP':>9} {'GB':>8} {'ms':>9} {'%bf16':>7} {'%fp32':>7} {'%copy':>7}"]
    for r in res["rows"]:
        shape = f"T={r['T']}" if "T" in r else (f"batch={r['batch']}" if "batch" in r else "")
        if "error" in r:
            lines.append(f"{r['kernel']:<24} {shape:<12} {r['error'][:80]}")
            continue
        lines.append(f"{r['kernel']:<24} {shape:<12} {r['flops'] / 1e9:9.2f} {r['bytes'] / 1e9:8.3f} {r['ms']:9.4f} "
                     f"{100 * r['fraction_bf16_peak']:6.2f}% {100 * r['fraction_fp32_peak']:6.2f}% "
                     f"{100 * r['fraction_copy_bandwidth']:6.2f}%")
    return "\n".join(lines)


def roofline_measurement(res, command):
    from .. import measurement
    fmt = lambda k, f: {"key": k, "title": f[0], "format": f[1]}  # noqa: E731
    cols = [{"key": "kernel", "title": "kernel"}, {"key": "shape", "title": "shape"}, {"key": "model", "title": "cost model"},
            fmt("gflop", ("GFLOP", "{:.3g}")), fmt("gb", ("GB", "{:.3g}")), fmt("ms", ("ms (median)", "{:.4g}")),
            fmt("bf16", ("of bf16 peak", "{:.2%}")), fmt("fp32", ("of fp32 peak", "{:.2%}")),
            fmt("copy", ("of copy bandwidth", "{:.2%}"))]
    table_rows = []
    for r in res["rows"]:
        shape = f"T = {r['T']}" if "T" in r else (f"batch {r['batch']}" if "batch" in r else None)
        if "error" in r:
            table_rows.append({"kernel": r["kernel"], "shape": shape, "model": r["error"]})
            continue
        table_rows.append({"kernel": r["kernel"], "shape": shape, "model": r["model"], "gflop": r["flops"] / 1e9,
                           "gb": r["bytes"] / 1e9, "ms": r["ms"], "bf16": r["fraction_bf16_peak"],
                           "fp32": r["fraction_fp32_peak"], "copy": r["fraction_copy_bandwidth"]})
    p = res["peaks"]
    return measurement.record(
        "h200_roofline_kda", "Roofline of the KDA kernels at K = V = 128: the cost models' FLOPs and bytes against the "
        "measured time and the device's measured peaks",
        {"roofline": {"caption": f"{res['heads']} heads; peaks measured in the same run: bf16 matmul "
                      f"{p['bf16_flops'] / 1e12:.0f} TFLOP/s, fp32 matmul {p['fp32_flops'] / 1e12:.1f} TFLOP/s "
                      f"(TF32 {'on' if p['tf32_allowed'] else 'off'}), copy {p['copy_bytes'] / 1e9:.0f} GB/s:",
                      "columns": cols, "rows": table_rows}},
        commands=[command], notes=["peaks and times: CUDA events, median of warm calls (3 untimed calls first)"])


def backward_reference(tokens, H=96, K=128, V=128):
    """The fp64 backward (lib.kda_backward) on one sequence of `tokens` tokens at the K3 shape:
    its time (CUDA events around the call, allocation included) and its peak device memory."""
    params = k3_params()
    A_log, dt_bias = _k3_gate_inputs(H, K)
    inputs = k3_inputs(tokens, H, K, V, 1000)
    inputs.update(A_log=A_log, dt_bias=dt_bias, initial_state=torch.zeros(1, H, K, V, dtype=torch.float64, device="cuda"))
    d_o = k3_inputs(tokens, H, K, V, 1001)["v"]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    grads = lib.kda_backward(inputs, params, d_o)
    b.record()
    b.synchronize()
    seconds = a.elapsed_time(b) / 1e3
    return {"tokens": tokens, "heads": H, "K": K, "V": V, "seconds": seconds,
            "token_heads_per_second": tokens * H / seconds,
            "peak_torch_bytes_above_inputs": torch.cuda.max_memory_allocated() - base,
            "finite": all(bool(g.isfinite().all()) for g in grads.values())}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--elements", type=int, default=1 << 31)
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--chunk", type=int, default=125_000)
    ap.add_argument("--plain-tokens", type=int, default=125_000,
                    help="tokens of the fast-against-plain fp64 run (0: none)")
    ap.add_argument("--no-comparator", action="store_true", help="skip the comparator's throughput")
    ap.add_argument("--roofline", action="store_true", help="the roofline table of the KDA kernels only")
    ap.add_argument("--heads", type=int, default=96)
    ap.add_argument("--backward", type=int, default=0, metavar="T",
                    help="time only the fp64 backward on one sequence of T tokens at --heads heads")
    ap.add_argument("--json", help="--roofline: write the rows and peaks as JSON here")
    ap.add_argument("--measurement", help="--roofline: write a measurements/ file here")
    kernel_path_options(ap)
    args = ap.parse_args(argv)
    opts = RunOptions(kernel_paths=kernel_paths_of(vars(args)))
    lib.use(opts.kernel_path("lib"))
    if args.roofline:
        def save(res):
            print(json.dumps(res["rows"][-1]), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(res, f, indent=1)
            if args.measurement:
                from .. import measurement
                measurement.write(roofline_measurement(res, "python3 -m k3ref.gpu_check.bench --roofline --heads "
                                                       f"{args.heads}"), args.measurement)
        res = roofline(args.heads, on_row=save, options=opts)
        save(res)
        print(roofline_table(res))
        return
    assert lib.available(), lib.load_error()
    if args.backward:
        backward_reference(min(args.backward, 256), args.heads)  # CUDA's and the library's first-call costs
        print(json.dumps(backward_reference(args.backward, args.heads)), flush=True)
        return
    res = {"device": torch.cuda.get_device_name()}
    res["reference_agreement"] = reference_agreement()
    print(json.dumps(res), flush=True)
    if not args.no_comparator:
        res["comparator"] = comparator(args.elements)
        print(json.dumps(res["comparator"]), flush=True)
        torch.cuda.empty_cache()
    res["long_reference"] = long_reference(args.tokens, args.chunk)
    torch.cuda.empty_cache()
    if args.plain_tokens > 0:
        res["fast_against_plain"] = fast_against_plain(args.plain_tokens)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
