#!/usr/bin/env python3
"""Independent cross-check of the committed KDA goldens.

A second implementation of the KDA recurrence and its stages, written from DESIGN.md
section 3 in NumPy (float64), with its own safetensors reader. It shares no code with
the C++ generator: agreement to ~1e-12 means the goldens are what the design says, not
only what k3ref computes. Usage: golden_crosscheck.py GOLDEN_DIR
"""
import json
import math
import struct
import sys
from pathlib import Path

import numpy as np

DTYPES = {"F64": np.float64, "F32": np.float32, "I64": np.int64, "I32": np.int32, "U8": np.uint8, "BOOL": np.bool_}


def load(path):
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        buf = data[begin:end]
        if entry["dtype"] == "BF16":
            bits = np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16
            arr = bits.view(np.float32).astype(np.float64)
        else:
            arr = np.frombuffer(buf, dtype=np.dtype(DTYPES[entry["dtype"]]).newbyteorder("<"))
        out[name] = arr.reshape(entry["shape"])
    return out, header.get("__metadata__", {})


def rel_rms(mine, ref):
    """||mine - ref|| / ||ref||, or max |mine| when the reference is zero."""
    denom = np.sqrt((ref * ref).sum())
    diff = np.sqrt(((mine - ref) ** 2).sum())
    return float(diff / denom) if denom > 0 else float(np.abs(mine).max(initial=0))


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x):
    return np.where(x > 0, x + np.log1p(np.exp(-np.abs(x))), np.log1p(np.exp(np.minimum(x, 0))))


def prepared(t, p):
    """The optional stages: (q, k normalised, v, decays exp(g), beta activated, scale), all [B, T, ...]."""
    q, k, v, g, beta = (t[n].astype(np.float64) for n in ("q", "k", "v", "g", "beta"))
    K, HV = q.shape[3], v.shape[2]
    if p["qk_l2norm"]:
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    bias = t["dt_bias"].astype(np.float64) if "dt_bias" in t else np.zeros((HV, K))
    if p["gate"] == "softplus":
        g = -np.exp(t["A_log"].astype(np.float64))[:, None] * softplus(g + bias)
    elif p["gate"] == "lower_bound":
        x = g + bias
        if "A_log" in t:
            x = np.exp(t["A_log"].astype(np.float64))[:, None] * x
        g = p["lower_bound"] * sigmoid(x)
    decay = np.exp(g) if p["gate_base"] == "e" else np.power(2.0, g / math.log(2.0))
    if p["beta"] == "sigmoid":
        beta = sigmoid(beta)
    elif p["beta"] == "two_sigmoid":
        beta = 2 * sigmoid(beta)
    scale = p["scale"] if p.get("scale") is not None else K ** -0.5
    return q, k, v, decay, beta, scale


def kda_reference(t, p):
    q, k, v, decay, beta, scale = prepared(t, p)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    cu = p["cu_seqlens"]
    seqs = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)] if cu else [(b, 0, T) for b in range(B)]
    v_first = p["state_layout"] == "v_first"
    h0 = t.get("initial_state")
    o = np.zeros((B, T, HV, V))
    final = np.zeros((len(seqs), HV, K, V))
    states = np.zeros((B, T, HV, K, V))
    for n, (b, begin, end) in enumerate(seqs):
        for hv in range(HV):
            h = hv // (HV // H)
            S = np.zeros((K, V))
            if h0 is not None:
                S = h0[n, hv].astype(np.float64)
                S = S.T.copy() if v_first else S.copy()
            for s in range(begin, end):
                S = decay[b, s, hv][:, None] * S
                S = S + beta[b, s, hv] * np.outer(k[b, s, h], v[b, s, hv] - k[b, s, h] @ S)
                o[b, s, hv] = S.T @ (scale * q[b, s, h])
                states[b, s, hv] = S
            final[n, hv] = S
    if v_first:
        final = final.transpose(0, 1, 3, 2)
        states = states.transpose(0, 1, 2, 4, 3)
    return {"o": o, "final_state": final, "all_states": states}


def main(golden_dir):
    manifest = json.loads((Path(golden_dir) / "MANIFEST.json").read_text())
    passed = failed = 0
    worst = 0.0
    for case in manifest["cases"]:
        if case["op"] != "kda.recurrent":
            continue
        tensors, meta = load(Path(golden_dir) / case["file"])
        ours = kda_reference(tensors, case["params"])
        ok = True
        for name in meta["k3ref.outputs"].split(","):
            ref, mine = tensors[name], ours[name]
            rel = rel_rms(mine, ref)
            worst = max(worst, rel)
            if not (rel <= 1e-11 and np.isfinite(mine).all()):
                ok = False
                print(f"FAIL {case['name']} tensor '{name}': relative RMS difference {rel:.3e} > 1e-11")
        passed += ok
        failed += not ok
    print(f"worst relative RMS difference over the suite: {worst:.3e}")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed or passed == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "goldens"))
