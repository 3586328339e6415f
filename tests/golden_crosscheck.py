#!/usr/bin/env python3
"""Independent cross-check of the committed KDA goldens.

The KDA recurrence and its stages recomputed by the independent NumPy oracle (tests/oracle/,
written from docs/conventions.md, float64). It shares no code with the C++ generator:
agreement to a few ulps means the goldens are what the docs say, not only what k3ref
computes. Usage: golden_crosscheck.py GOLDEN_DIR
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from oracle import Tally, golden_cases, kda_forward, rel_rms, worst_element  # noqa: E402  (the one NumPy oracle)

# Bound on the relative RMS difference (was 2.5e-15): measured worst 4.42e-16 over 30 goldens
# (date 2026-12-01); bound 4x (3.85x).
TOLERANCE = 1.7e-15

AXES = {"o": ("batch", "token", "head", "channel"), "final_state": ("sequence", "head", "row", "column"),
        "all_states": ("batch", "token", "head", "row", "column")}


def main(golden_dir):
    tally = Tally()
    for case, tensors, meta in golden_cases(golden_dir, lambda op: op == "kda.recurrent"):
        ours = kda_forward(tensors, case["params"])
        ok = True
        for name in meta["k3ref.outputs"].split(","):
            ref, mine = tensors[name], ours[name]
            rel = rel_rms(mine, ref)
            tally.figure(rel)
            if not (rel <= TOLERANCE and np.isfinite(mine).all()):
                ok = False
                print(f"FAIL {case['name']} tensor '{name}': relative RMS difference {rel:.3e} > {TOLERANCE}; "
                      f"worst at {worst_element(mine, ref, AXES[name])}")
        tally.case(ok)
    return tally.result("relative RMS difference over the suite")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "goldens"))
