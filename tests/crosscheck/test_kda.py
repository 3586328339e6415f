"""Independent cross-check of the committed KDA goldens (kda.recurrent).

The KDA recurrence and its stages recomputed by the independent NumPy oracle (tests/oracle/,
written from docs/conventions.md, float64). It shares no code with the C++ generator:
agreement to a few ulps means the goldens are what the docs say, not only what k3ref
computes.
"""
import pytest

np = pytest.importorskip("numpy")

from oracle import kda_forward, rel_rms, worst_element  # noqa: E402  (the one NumPy oracle)

# Bound on the relative RMS difference (was 2.5e-15): measured worst 4.42e-16 over 30 goldens
# (date 2026-12-01), 4.76e-16 over 50 (the goldens inside FlashKDA's and the safe gate's
# domains added, 2026-12-02); the bound is 3.6x that.
TOLERANCE = 1.7e-15

AXES = {"o": ("batch", "token", "head", "channel"), "final_state": ("sequence", "head", "row", "column"),
        "all_states": ("batch", "token", "head", "row", "column")}


def accept_op(op):
    return op == "kda.recurrent"


def test_family_present(family_cases):
    assert family_cases, "no kda.recurrent case in the golden suite"


def test_kda_recurrent(case, golden, checks):
    tensors, meta = golden
    ours = kda_forward(tensors, case["params"])
    for name in meta["k3ref.outputs"].split(","):
        ref, mine = tensors[name], ours[name]
        rel = rel_rms(mine, ref)
        checks.figure(rel)
        checks.expect(rel <= TOLERANCE and np.isfinite(mine).all(),
                      f"{case['name']} tensor '{name}': relative RMS difference {rel:.3e} > {TOLERANCE}; "
                      f"worst at {worst_element(mine, ref, AXES[name])}")
    checks.verify()
