"""The one independent NumPy oracle of the golden cross-checks (tests/crosscheck/test_*.py).

Deliberately plain, float64 (or complex128 for complex-step derivatives), sharing no code
with the C++ library: one reader (the project's pure-Python safetensors reader,
python/k3ref/_safetensors.py, loaded by path so that nothing of the compiled k3ref module
is imported), one model of KDA's optional stages, one recurrence, written from
docs/conventions.md:

    S_t = Diag(a_t) S_{t-1};  S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T;  o_t = S_t^T (scale q_t)

Every family's cross-check builds on these; a convention changes here, once.
"""
import importlib.util
import math
from pathlib import Path

import numpy as np

_READER_PATH = Path(__file__).resolve().parents[2] / "python" / "k3ref" / "_safetensors.py"
_spec = importlib.util.spec_from_file_location("k3ref_oracle_safetensors", _READER_PATH)
_reader = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_reader)


def load(path):
    """(arrays, metadata) of a safetensors file; BF16 widened exactly to float64."""
    return _reader.load(path)


def rel_rms(mine, ref):
    """||mine - ref|| / ||ref||, or max |mine| when the reference is zero."""
    denom = np.sqrt((ref * ref).sum())
    diff = np.sqrt(((mine - ref) ** 2).sum())
    return float(diff / denom) if denom > 0 else float(np.abs(mine).max(initial=0))


def compare_outputs(tensors, meta, ours, checks, tolerance):
    """Each expected output of a golden (meta's k3ref.outputs) against ours[name]: the same
    shape, finite, relative RMS difference within `tolerance`; the figure recorded. Fails the
    test (checks.verify) with every failed check."""
    for name in meta["k3ref.outputs"].split(","):
        ref, mine = tensors[name], ours[name]
        if not checks.expect(ref.shape == mine.shape, f"tensor '{name}': shape {list(ref.shape)}, recomputed {list(mine.shape)}"):
            continue
        rel = rel_rms(mine, ref)
        checks.figure(rel)
        checks.expect(rel <= tolerance and np.isfinite(mine).all(),
                      f"tensor '{name}': relative RMS difference {rel:.3e} > {tolerance}")
    checks.verify()


def worst_element(mine, ref, axes):
    """'name=i, ...' of the element with the largest |mine - ref|, axes naming the dimensions."""
    if mine.size == 0:
        return "(empty)"
    at = np.unravel_index(int(np.argmax(np.abs(mine - ref))), mine.shape)
    where = ", ".join(f"{a}={int(i)}" for a, i in zip(axes, at))
    return f"{where}: {float(mine[at]):.17g} vs {float(ref[at]):.17g}"


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x):
    """log(1 + e^x) without overflow; analytic in each branch, so complex steps pass through."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.where(np.real(x) > 0, x + np.log1p(np.exp(-x)), np.log1p(np.exp(x)))


def wide(x):
    """x in float64 (complex stays complex): F32 tensors of a golden are computed with in double."""
    x = np.asarray(x)
    return x if np.iscomplexobj(x) else x.astype(np.float64)


def stages(t, p):
    """The optional stages on tensors t (dict) under parameters p: q and k normalised, v, the
    multiplicative decays, beta activated, all [B, T, ...], and the scale."""
    q, k, v, g, beta = (wide(t[n]) for n in ("q", "k", "v", "g", "beta"))
    K, HV = q.shape[3], v.shape[2]
    if p["qk_l2norm"]:
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    bias = wide(t["dt_bias"]) if "dt_bias" in t else np.zeros((HV, K))
    if p["gate"] == "softplus":
        g = -np.exp(wide(t["A_log"]))[:, None] * softplus(g + bias)
    elif p["gate"] == "lower_bound":
        x = g + bias
        if "A_log" in t:
            x = np.exp(wide(t["A_log"]))[:, None] * x
        g = p["lower_bound"] * sigmoid(x)
    decay = g if p["gate"] == "decay_factor" else (np.exp(g) if p["gate_base"] == "e" else np.power(2.0, g / math.log(2.0)))
    if p["beta"] == "sigmoid":
        beta = sigmoid(beta)
    elif p["beta"] == "two_sigmoid":
        beta = 2 * sigmoid(beta)
    scale = p["scale"] if p.get("scale") is not None else K ** -0.5
    return q, k, v, decay, beta, scale


def sequences(p, B, T):
    """(batch row, first token, end token) of each sequence."""
    cu = p.get("cu_seqlens")
    return [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)] if cu else [(b, 0, T) for b in range(B)]


def run(q, k, v, decay, beta, scale, state, tokens, o=None, states=None, inject=None, record=None):
    """The recurrence over `tokens` of one sequence, every value head, from `state` [HV, K, V]
    (K-first; not modified). q, k [T, H, K], v [T, HV, V], decay [T, HV, K], beta [T, HV].
    Writes o[t] [HV, V] and states[t] [HV, K, V] when given; inject[t] is added to the state
    just before token t and record[t] receives it (after injection). Returns the last state."""
    H, HV = q.shape[1], v.shape[1]
    extra = list(inject.values()) if inject else []
    S = np.array(state, dtype=np.result_type(state, q, k, v, decay, beta, 1.0, *extra), copy=True)
    for t in tokens:
        if inject is not None and t in inject:
            S = S + inject[t]
        if record is not None and t in record:
            record[t] = S.copy()
        for hv in range(HV):
            h = hv // (HV // H)
            Sh = decay[t, hv][:, None] * S[hv]
            Sh = Sh + beta[t, hv] * np.outer(k[t, h], v[t, hv] - k[t, h] @ Sh)
            if o is not None:
                o[t, hv] = Sh.T @ (scale * q[t, h])
            S[hv] = Sh
        if states is not None:
            states[t] = S
    return S


def kda_forward(t, p, inject=None, record=None):
    """The KDA forward of a golden's inputs t under its parameters p: {"o", "final_state",
    "all_states"} in the parameters' state layout. inject / record as in run(), keyed by
    (batch row, token)."""
    q, k, v, decay, beta, scale = stages(t, p)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    v_first = p.get("state_layout") == "v_first"
    h0 = t.get("initial_state")
    extra = ([] if h0 is None else [h0]) + (list(inject.values()) if inject else [])
    dtype = np.result_type(q, k, v, decay, beta, 1.0, *extra)
    o = np.zeros((B, T, HV, V), dtype=dtype)
    states = np.zeros((B, T, HV, K, V), dtype=dtype)
    seqs = sequences(p, B, T)
    final = np.zeros((len(seqs), HV, K, V), dtype=dtype)
    for n, (b, begin, end) in enumerate(seqs):
        S0 = np.zeros((HV, K, V)) if h0 is None else wide(np.swapaxes(h0[n], 1, 2) if v_first else h0[n])
        row_inject = None if inject is None else {s: x for (bb, s), x in inject.items() if bb == b}
        row_record = None if record is None else {s: None for (bb, s) in record if bb == b}
        final[n] = run(q[b], k[b], v[b], decay[b], beta[b], scale, S0, range(begin, end), o[b], states[b],
                       row_inject, row_record)
        if record is not None:
            for s, x in row_record.items():
                if x is not None:  # recorded in this sequence
                    record[(b, s)] = x
    if v_first:
        final = np.swapaxes(final, 2, 3)
        states = np.swapaxes(states, 3, 4)
    return {"o": o, "final_state": final, "all_states": states}


def golden_cases(golden_dir, accept):
    """(manifest entry, tensors, metadata) of each case of the suite's MANIFEST.json whose
    operator `accept(op)` takes, in manifest order."""
    import json

    manifest = json.loads((Path(golden_dir) / "MANIFEST.json").read_text())
    for case in manifest["cases"]:
        if accept(case["op"]):
            tensors, meta = load(Path(golden_dir) / case["file"])
            yield case, tensors, meta


class Tally:
    """A cross-check's passing and failing cases and its worst figure; `result` prints them
    and is the exit code: 1 on any failure, and when nothing was checked."""

    def __init__(self):
        self.passed = self.failed = 0
        self.worst = 0.0

    def figure(self, x):
        self.worst = max(self.worst, x)

    def case(self, ok):
        self.passed += bool(ok)
        self.failed += not ok

    def result(self, what):
        print(f"worst {what}: {self.worst:.3e}")
        print(f"{self.passed} passed, {self.failed} failed")
        return 1 if self.failed or self.passed == 0 else 0
