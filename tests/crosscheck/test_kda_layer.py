"""Independent cross-check of the committed KDA layer goldens (layer.kda, layer.kda_decode,
layer.kda_verify), and the layer's four mutants caught by them.

The layer recomputed by the NumPy oracle (tests/oracle/layer.py, written from
docs/kda-layer.md, float64) from the weights and parameters each golden records: the
projections, the short convolution from each document's entering window, the KDA stages and
recurrence of the oracle, the gated RMSNorm, the output projection; the pools addressed from
their stored geometry. It shares no code with the C++ generator.

The recommended policy (`kda-layer`: every output within a multiple of its bf16 floor) is
checked from both sides: the oracle with a bf16 kernel's roundings (every projection, the
convolution's output, the recurrence's output, the norm's output, y) passes it on every
golden, and each mutant (the oracle's `mutant=`, the layer defects of docs/kda-layer.md)
fails it, in y, on the golden that isolates it.
"""
import json
from pathlib import Path

import pytest

np = pytest.importorskip("numpy")

from oracle import rel_rms, worst_element  # noqa: E402  (the one NumPy oracle)
from oracle.layer import MUTANTS, layer_outputs  # noqa: E402

# Bound on the relative RMS difference: measured worst 3.96e-16 over 10 goldens
# (date 2026-12-02); bound 4x (3.8x).
TOLERANCE = 1.5e-15
# The recommended policy's floor multiple for the layer's outputs, read from the table.
POLICY = "kda-layer"
_TABLE = json.loads((Path(__file__).resolve().parents[2] / "policy" / "policies.json").read_text())
FLOOR_MULTIPLE = _TABLE["policies"][POLICY]["rules"]["layer.kda"]["output"]["multiple"]
# The bf16 emulation's worst ratio to the bf16 floor: measured 3.80x (y of
# kda_layer_decode_chunked_prefill; states at most 2.5x) over the 10 goldens (date 2026-12-02).
EMULATION_WORST_RATIO = 3.8


def bf16(x):
    """x rounded to bf16 (8 significant bits, to nearest, ties to even), directly from float64."""
    m, e = np.frexp(np.asarray(x, dtype=np.float64))
    return np.ldexp(np.rint(m * 256.0) / 256.0, e)


def floor_ratio(mine, ref):
    """The policy's figure: relative RMS error over the bf16 floor (0 when every value is equal)."""
    err = rel_rms(mine, ref)
    if err == 0:
        return 0.0
    floor = rel_rms(bf16(ref), ref)
    return err / floor if floor > 0 else float("inf")

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


def test_bf16_emulation_passes_the_recommended_policy(case, golden, checks):
    tensors, meta = golden
    ours = layer_outputs(tensors, case["params"], case["op"], rounding=bf16)
    assert all(p == POLICY for p in json.loads(meta["k3ref.policies"]).values())
    for name in meta["k3ref.outputs"].split(","):
        ratio = floor_ratio(ours[name], tensors[name])
        checks.figure(ratio)
        checks.expect(ratio <= EMULATION_WORST_RATIO * 1.01,
                      f"{case['name']} tensor '{name}': {ratio:.2f}x the bf16 floor, measured at most "
                      f"{EMULATION_WORST_RATIO}x")
        checks.expect(ratio <= FLOOR_MULTIPLE, f"{case['name']} tensor '{name}': {ratio:.2f}x the bf16 floor "
                      f"fails policy {POLICY} ({FLOOR_MULTIPLE}x)")
    checks.verify()


def output_ratio(tensors, params, op, mutant):
    """The mutant's layer output y (what every kernel returns) over its bf16 floor."""
    return floor_ratio(layer_outputs(tensors, params, op, mutant)["y"], tensors["y"])


@pytest.mark.parametrize("mutant", MUTANTS)
def test_mutant_is_caught(mutant, family_cases, golden_dir, checks):
    from oracle import load

    errors = {}
    for case in family_cases:
        tensors, meta = load(golden_dir / case["file"])
        errors[case["name"]] = output_ratio(tensors, case["params"], case["op"], mutant)
    isolating = CAUGHT_BY[mutant]
    checks.expect(isolating in errors, f"golden {isolating} is not in the suite")
    checks.expect(errors.get(isolating, 0.0) > FLOOR_MULTIPLE,
                  f"mutant {mutant}: golden {isolating} at {errors.get(isolating, 0.0):.1f}x the bf16 floor, "
                  f"within policy {POLICY} ({FLOOR_MULTIPLE}x): not caught")
    print(f"{mutant}: " + ", ".join(f"{n} {e:.1f}x" for n, e in errors.items()))
    checks.verify()
