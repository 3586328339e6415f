#!/usr/bin/env python3
"""Independent cross-check of the committed KDA gradient goldens ("kda.backward").

The goldens' gradients come from k3ref's adjoint recurrence. This script never
differentiates by hand: it runs its own NumPy forward of KDA (from docs/conventions.md)
in complex arithmetic and takes complex-step derivatives,

    d/de L(x + e E) at e = 0  =  Im L(x + i h E) / h     (h = 1e-30, no cancellation),

exact to rounding for the analytic functions KDA is built of. For every stored gradient
it checks <gradient, E> against that derivative along a random direction E; for the
chunk and context-parallel state gradients it injects i h E into the state at the chunk's
or rank's first token. It also checks the stored forward states (chunk_states,
cp_entering_states) against its own forward. Usage: golden_crosscheck_backward.py DIR
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from oracle import Tally, golden_cases, kda_forward, sequences  # noqa: E402  (the one NumPy oracle)

H_STEP = 1e-30
# Relative to sum |gradient * E| (and the stored states' max-relative difference); was 6e-15:
# measured worst 1.177e-15 over 14 goldens (kda_backward_fla_chunk_like; the directions E are
# drawn from the fixed seed below) (date 2026-12-01); bound 4x (3.99x).
TOLERANCE = 4.7e-15


def forward(t, p, inject=None, record=None):
    """o and final states (in the case's layout) by the oracle; inject / record keyed by (b, s)."""
    out = kda_forward(t, p, inject, record)
    return out["o"], out["final_state"]


def loss(t, p, inject=None):
    o, final = forward(t, p, inject)
    return (o * t["d_o"]).sum() + (final * t["d_final_state"]).sum()


def check(name, derivative, gradient, direction, failures, tally):
    predicted = (gradient * direction).sum()
    scale = np.abs(gradient * direction).sum()
    rel = abs(derivative - predicted) / scale if scale > 0 else abs(derivative)
    tally.figure(rel)
    if not rel <= TOLERANCE:
        failures.append(f"{name}: complex-step derivative {derivative:.17g} vs <gradient, E> {predicted:.17g} (rel {rel:.2e})")


def check_case(case, t, rng, tally):
    p = case["params"]  # the KDA keys beside the backward parameters
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
        check(f"{case['name']} {grad_name}", loss(moved, p).imag / H_STEP, t[grad_name], E, failures, tally)

    def state_gradient_checks(label, starts, gradients, states):
        """starts: list of (b, s); gradients/states [len(starts), HV, K, V] K-first."""
        record = {key: None for key in starts}
        forward(t, p, record=record)
        for i, key in enumerate(starts):
            rel = np.abs(record[key].real - states[i]).max() / max(np.abs(states[i]).max(), 1e-300)
            tally.figure(rel)
            if not rel <= TOLERANCE:
                failures.append(f"{label} {i}: stored forward state differs by {rel:.2e}")
            E = rng.uniform(-1.0, 1.0, size=(HV, K, V))
            derivative = loss(t, p, inject={key: 1j * H_STEP * E}).imag / H_STEP
            check(f"{label} {i}", derivative, gradients[i], E, failures, tally)

    starts = [(int(b), int(s)) for b, s, _ in t["chunk_starts"]]
    state_gradient_checks(f"{case['name']} chunk_state_gradients", starts, t["chunk_state_gradients"], t["chunk_states"])
    if "splits" in t:
        splits = [int(x) for x in t["splits"]]
        ranks = [r for r in range(len(splits) - 1) if splits[r] < splits[r + 1]]  # empty ranks pass through
        state_gradient_checks(f"{case['name']} cp_entering_state_gradients", [(0, splits[r]) for r in ranks],
                              t["cp_entering_state_gradients"][ranks], t["cp_entering_states"][ranks])
    return failures


def main(golden_dir):
    rng = np.random.default_rng(20261130)
    tally = Tally()
    for case, tensors, _ in golden_cases(golden_dir, lambda op: op == "kda.backward"):
        failures = check_case(case, tensors, rng, tally)
        for f in failures:
            print("FAIL", f)
        tally.case(not failures)
    return tally.result("relative difference (complex step vs gradient goldens)")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "goldens"))
