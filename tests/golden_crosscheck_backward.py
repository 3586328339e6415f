#!/usr/bin/env python3
"""Independent cross-check of the committed KDA gradient goldens ("kda.backward").

The goldens' gradients come from k3ref's adjoint recurrence. This script never
differentiates by hand: it runs its own NumPy forward of KDA (from DESIGN.md section 3)
in complex arithmetic and takes complex-step derivatives,

    d/de L(x + e E) at e = 0  =  Im L(x + i h E) / h     (h = 1e-30, no cancellation),

exact to rounding for the analytic functions KDA is built of. For every stored gradient
it checks <gradient, E> against that derivative along a random direction E; for the
chunk and context-parallel state gradients it injects i h E into the state at the chunk's
or rank's first token. It also checks the stored forward states (chunk_states,
cp_entering_states) against its own forward. Usage: golden_crosscheck_backward.py DIR
"""
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from golden_crosscheck import load  # noqa: E402  (the independent safetensors reader)

H_STEP = 1e-30
TOLERANCE = 1e-12  # relative to sum |gradient * E|; observed worst 4.3e-16


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def stages(t, p):
    """q, k normalised, decays, activated beta, scale; complex-safe (no abs, no where)."""
    q, k, v, g, beta = (t[n] for n in ("q", "k", "v", "g", "beta"))
    K, HV = q.shape[3], v.shape[2]
    if p["qk_l2norm"]:
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    bias = t["dt_bias"] if "dt_bias" in t else np.zeros((HV, K))
    if p["gate"] == "softplus":
        g = -np.exp(t["A_log"])[:, None] * np.log(1.0 + np.exp(g + bias))
    elif p["gate"] == "lower_bound":
        x = g + bias
        if "A_log" in t:
            x = np.exp(t["A_log"])[:, None] * x
        g = p["lower_bound"] * sigmoid(x)
    decay = np.exp(g) if p["gate_base"] == "e" else np.power(2.0, g / math.log(2.0))
    if p["beta"] == "sigmoid":
        beta = sigmoid(beta)
    elif p["beta"] == "two_sigmoid":
        beta = 2 * sigmoid(beta)
    scale = p["scale"] if p.get("scale") is not None else K ** -0.5
    return q, k, v, decay, beta, scale


def sequences(p, B, T):
    cu = p["cu_seqlens"]
    return [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)] if cu else [(b, 0, T) for b in range(B)]


def forward(t, p, inject=None, record=None):
    """o [B,T,HV,V] and final states [N,HV,K,V] (K-first). inject[(b, s)] = [HV,K,V] is
    added to the state just before token s of the sequence in batch row b; record[(b, s)]
    receives that state (after injection)."""
    q, k, v, decay, beta, scale = stages(t, p)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    v_first = p["state_layout"] == "v_first"
    h0 = t.get("initial_state")
    o = np.zeros((B, T, HV, V), dtype=complex)
    seqs = sequences(p, B, T)
    final = np.zeros((len(seqs), HV, K, V), dtype=complex)
    for n, (b, begin, end) in enumerate(seqs):
        S = np.zeros((HV, K, V), dtype=complex)
        if h0 is not None:
            S = S + (np.swapaxes(h0[n], 1, 2) if v_first else h0[n])
        for s in range(begin, end):
            if inject is not None and (b, s) in inject:
                S = S + inject[(b, s)]
            if record is not None and (b, s) in record:
                record[(b, s)] = S.copy()
            for hv in range(HV):
                h = hv // (HV // H)
                Sh = decay[b, s, hv][:, None] * S[hv]
                Sh = Sh + beta[b, s, hv] * np.outer(k[b, s, h], v[b, s, hv] - k[b, s, h] @ Sh)
                o[b, s, hv] = Sh.T @ (scale * q[b, s, h])
                S[hv] = Sh
        final[n] = S
    if v_first:
        final = np.swapaxes(final, 2, 3)
    return o, final


def loss(t, p, inject=None):
    o, final = forward(t, p, inject)
    return (o * t["d_o"]).sum() + (final * t["d_final_state"]).sum()


def check(name, derivative, gradient, direction, failures, worst):
    predicted = (gradient * direction).sum()
    scale = np.abs(gradient * direction).sum()
    rel = abs(derivative - predicted) / scale if scale > 0 else abs(derivative)
    worst[0] = max(worst[0], rel)
    if not rel <= TOLERANCE:
        failures.append(f"{name}: complex-step derivative {derivative:.17g} vs <gradient, E> {predicted:.17g} (rel {rel:.2e})")


def check_case(case, golden_dir, rng, worst):
    t, _ = load(Path(golden_dir) / case["file"])
    p = case["params"]["kda"]
    t = {n: np.asarray(a, dtype=np.float64) if a.dtype != np.int64 else a for n, a in t.items()}
    B, T, HV, V = t["v"].shape
    K = t["q"].shape[3]
    N = len(sequences(p, B, T))
    failures = []
    if "initial_state" not in t:  # the gradient is still defined: perturb a zero state
        t["initial_state"] = np.zeros(t["d_initial_state"].shape)
    pairs = [("dq", "q"), ("dk", "k"), ("dv", "v"), ("dg", "g"), ("dbeta", "beta"),
             ("d_initial_state", "initial_state"), ("dA_log", "A_log"), ("ddt_bias", "dt_bias")]
    for grad_name, input_name in pairs:
        if grad_name not in t:
            continue
        E = rng.choice([-1.0, 1.0], size=t[input_name].shape) * rng.uniform(0.5, 1.0, size=t[input_name].shape)
        moved = dict(t)
        moved[input_name] = t[input_name] + 1j * H_STEP * E
        check(f"{case['name']} {grad_name}", loss(moved, p).imag / H_STEP, t[grad_name], E, failures, worst)

    def state_gradient_checks(label, starts, gradients, states):
        """starts: list of (b, s); gradients/states [len(starts), HV, K, V] K-first."""
        record = {key: None for key in starts}
        forward(t, p, record=record)
        for i, key in enumerate(starts):
            rel = np.abs(record[key].real - states[i]).max() / max(np.abs(states[i]).max(), 1e-300)
            worst[0] = max(worst[0], rel)
            if not rel <= TOLERANCE:
                failures.append(f"{label} {i}: stored forward state differs by {rel:.2e}")
            E = rng.uniform(-1.0, 1.0, size=(HV, K, V))
            derivative = loss(t, p, inject={key: 1j * H_STEP * E}).imag / H_STEP
            check(f"{label} {i}", derivative, gradients[i], E, failures, worst)

    starts = [(int(b), int(s)) for b, s, _ in t["chunk_starts"]]
    state_gradient_checks(f"{case['name']} chunk_state_gradients", starts, t["chunk_state_gradients"], t["chunk_states"])
    if "splits" in t:
        splits = [int(x) for x in t["splits"]]
        ranks = [r for r in range(len(splits) - 1) if splits[r] < splits[r + 1]]  # empty ranks pass through
        state_gradient_checks(f"{case['name']} cp_entering_state_gradients", [(0, splits[r]) for r in ranks],
                              t["cp_entering_state_gradients"][ranks], t["cp_entering_states"][ranks])
    return failures


def main(golden_dir):
    manifest = json.loads((Path(golden_dir) / "MANIFEST.json").read_text())
    rng = np.random.default_rng(20261130)
    passed = failed = 0
    worst = [0.0]
    for case in manifest["cases"]:
        if case["op"] != "kda.backward":
            continue
        failures = check_case(case, golden_dir, rng, worst)
        for f in failures:
            print("FAIL", f)
        passed += not failures
        failed += bool(failures)
    print(f"worst relative difference (complex step vs gradient goldens): {worst[0]:.3e}")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed or passed == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "goldens"))
