"""Independent cross-check of the committed KDA layer goldens (layer.kda, layer.kda_decode,
layer.kda_verify), and the layer's four mutants caught by them.

The layer recomputed by the NumPy oracle (tests/oracle/layer.py, written from
docs/kda-layer.md, float64) from the weights and parameters each golden records: the
projections, the short convolution from each document's entering window, the KDA stages and
recurrence of the oracle, the gated RMSNorm, the output projection; the pools addressed from
their stored geometry. It shares no code with the C++ generator.

The mutants (the oracle's `mutant=`) are the layer defects of docs/kda-layer.md; each must
fail, in its output y, the check a kernel's output goes through (the recommended policy's
relative RMS bound, fla-test's 0.005) on the golden that isolates it.
"""
import pytest

np = pytest.importorskip("numpy")

from oracle import rel_rms, worst_element  # noqa: E402  (the one NumPy oracle)
from oracle.layer import MUTANTS, layer_outputs  # noqa: E402

# Bound on the relative RMS difference: measured worst 3.96e-16 over 9 goldens
# (date 2026-12-02); bound 4x (3.8x).
TOLERANCE = 1.5e-15
# The recommended policy's bound for the layer's outputs (policy/policies.json, fla-test).
POLICY_BOUND = 0.005

# The golden that isolates each mutant: a kernel with that defect fails there.
CAUGHT_BY = {
    "mask_overrides_cu_seqlens": "kda_layer_all_ones_mask_with_cu_seqlens",
    "conv_state_dropped": "kda_layer_decode_gva_pad_lane",
    "gate_not_repeated": "kda_layer_gva_varlen_states",
    "gate_before_norm": "kda_layer_fla_b2",
}


def accept_op(op):
    return op.startswith("layer.kda")


def axes(shape):
    return tuple(f"axis{i}" for i in range(len(shape)))


def test_family_present(family_cases):
    ops = {case["op"] for case in family_cases}
    assert ops == {"layer.kda", "layer.kda_decode", "layer.kda_verify"}, ops


def test_kda_layer(case, golden, checks):
    tensors, meta = golden
    ours = layer_outputs(tensors, case["params"], case["op"])
    for name in meta["k3ref.outputs"].split(","):
        ref, mine = tensors[name], ours[name]
        checks.expect(mine.shape == ref.shape, f"{case['name']} tensor '{name}': shape {mine.shape} vs {ref.shape}")
        if mine.shape != ref.shape:
            continue
        rel = rel_rms(mine, ref)
        checks.figure(rel)
        checks.expect(rel <= TOLERANCE and np.isfinite(mine).all(),
                      f"{case['name']} tensor '{name}': relative RMS difference {rel:.3e} > {TOLERANCE}; "
                      f"worst at {worst_element(mine, ref, axes(ref.shape))}")
    checks.verify()


def output_error(tensors, params, op, mutant):
    """The relative RMS error of the mutant's layer output y (what every kernel returns)."""
    return rel_rms(layer_outputs(tensors, params, op, mutant)["y"], tensors["y"])


@pytest.mark.parametrize("mutant", MUTANTS)
def test_mutant_is_caught(mutant, family_cases, golden_dir, checks):
    from oracle import load

    errors = {}
    for case in family_cases:
        tensors, meta = load(golden_dir / case["file"])
        errors[case["name"]] = output_error(tensors, case["params"], case["op"], mutant)
    isolating = CAUGHT_BY[mutant]
    checks.expect(isolating in errors, f"golden {isolating} is not in the suite")
    checks.expect(errors.get(isolating, 0.0) > POLICY_BOUND,
                  f"mutant {mutant}: golden {isolating} error {errors.get(isolating, 0.0):.3e} "
                  f"within the policy bound {POLICY_BOUND}: not caught")
    print(f"{mutant}: " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()))
    checks.verify()
