"""Independent cross-check of the committed Stable LatentMoE goldens (latent_moe_*.safetensors).

A second implementation in NumPy float64, written from docs/latent-moe.md and docs/qb.md,
sharing no code with the C++ generator: router affinities sigmoid(x W_r^T) (or the given
ones), the QB bias carried online (batch t routed by the bias solved on batch t-1, warm
start, mean-centred), top-k by the tie rule, capacity in token order, SwiGLU or SiTU-GLU
experts in the latent, the weighted aggregate, RMSNorm before the up projection, the shared
expert. Integer outputs (selection, kept, loads) must be equal; real outputs agree to float64
rounding (the golden is 256-bit, rounded once): the worst relative figure is reported and
bounded by 4e-15 (measured 4.5e-16).
"""
import json
import math

import pytest

np = pytest.importorskip("numpy")

from oracle import load, rel_rms, sigmoid  # noqa: E402
from oracle.qb import route, solver_step  # noqa: E402

golden_glob = "latent_moe_*.safetensors"
BOUND = 4e-15


def accept_op(op):
    return op == "moe.latent"


def glu(gate, up, p):
    if p["activation"] == "situ":
        b, b2 = p["situ_beta"], p["situ_linear_beta"]
        clipped = b2 * np.tanh(up / b2) if b2 > 0 else up
        return b * np.tanh(gate / b) * sigmoid(gate) * clipped
    return gate * sigmoid(gate) * up


def expert(v, w1, w3, w2, p):
    """W2 glu(W1 v, W3 v) for rows v [r, a]; w1, w3 [f, a], w2 [a', f]."""
    return glu(v @ w1.T, v @ w3.T, p) @ w2.T


def capacity_mask(selection, n, capacity):
    kept = np.ones(selection.shape, dtype=np.int64)
    if capacity <= 0:
        return kept
    taken = np.zeros(n, dtype=np.int64)
    for i in range(selection.shape[0]):
        for r in range(selection.shape[1]):
            j = selection[i, r]
            kept[i, r] = 1 if taken[j] < capacity else 0
            taken[j] += 1
    return kept


def layer(x, s, bias, t, p):
    """Every stage of one batch: x [m, d], affinities s [m, n], bias [n]."""
    k, n = p["k"], s.shape[1]
    selection = route(s, bias, k)
    chosen = np.take_along_axis(s, selection, axis=1)
    scale = p["routed_scaling_factor"][0] / p["routed_scaling_factor"][1]
    weights = scale * (chosen / chosen.sum(axis=1, keepdims=True) if p["renormalize"] else chosen)
    kept = capacity_mask(selection, n, p["capacity"])
    latent = x @ t["down"].T
    aggregate = np.zeros_like(latent)
    for j in range(n):
        rows, ranks = np.nonzero((selection == j) & (kept == 1))
        if rows.size:
            out = expert(latent[rows], t["w1"][j], t["w3"][j], t["w2"][j], p)
            aggregate[rows] += weights[rows, ranks][:, None] * out
    if p["norm"]:
        rms = np.sqrt((aggregate ** 2).mean(axis=1, keepdims=True) + p["eps"])
        normalised = t["norm_weight"][None, :] * (aggregate / rms)
    else:
        normalised = aggregate
    routed = normalised @ t["up"].T
    shared = expert(x, t["shared_w1"], t["shared_w3"], t["shared_w2"], p) if p["shared_f"] > 0 else np.zeros_like(routed)
    loads = np.bincount(selection.reshape(-1), minlength=n)
    kept_loads = np.bincount(selection[kept == 1], minlength=n)
    return {"selection": selection, "weights": weights, "kept": kept, "loads": loads, "kept_loads": kept_loads,
            "latent": latent, "aggregate": aggregate, "normalised": normalised, "routed_output": routed,
            "shared_output": shared, "output": routed + shared}


def next_bias(s, bias, p):
    k, (m, n) = p["k"], s.shape
    q = m * k // n
    nxt = bias.copy() if p["warm_start"] else np.zeros(n)
    for _ in range(p["iterations_per_batch"]):
        _, nxt, _ = solver_step(s, nxt, k, q)
    return nxt - math.fsum(nxt) / n if p["center_bias"] else nxt


def check_case(name, t, p, checks):
    B, n = p["batches"], p["n"]
    given = p["router"] == "given"
    bias = np.zeros(n)
    for b in range(B):
        x = t["x"][b]
        s = t["affinities"][b] if given else sigmoid(x @ t["router"].T)
        if not given:
            e = rel_rms(s, t["router_affinities"][b])
            checks.figure(e)
            checks.expect(e < BOUND, f"{name}: router affinities of batch {b}: rel-rms {e:.3e}")
        # The bias: exact for given (dyadic) affinities, float64 rounding otherwise.
        e = float(np.abs(bias - t["bias"][b]).max())
        checks.figure(e)
        checks.expect(e == 0 if given else e < BOUND, f"{name}: bias of batch {b}: max difference {e:.3e}")
        mine = layer(x, s, t["bias"][b], t, p)
        for key in ("selection", "kept", "loads", "kept_loads"):
            checks.expect(np.array_equal(mine[key], t[key][b]), f"{name}: {key} of batch {b}")
        vio = float(mine["loads"].max() * n / mine["loads"].sum() - 1)
        checks.expect(abs(vio - float(np.ravel(t["max_vio"][b])[0])) <= 1e-15, f"{name}: max_vio of batch {b}")
        for key in ("weights", "latent", "aggregate", "normalised", "routed_output", "output") + (
                ("shared_output",) if p["shared_f"] > 0 else ()):
            e = rel_rms(mine[key], t[key][b])
            checks.figure(e)
            checks.expect(e < BOUND, f"{name}: {key} of batch {b}: rel-rms {e:.3e}")
        bias = next_bias(s, bias, p)
    if p["duplicate_pairs"] > 0:  # ties decided by the expert index: the tied pair's lower index first
        sel = t["selection"]
        for r in range(p["duplicate_pairs"]):
            lo, hi = 2 * r, 2 * r + 1
            both = (sel == lo).any(-1) & (sel == hi).any(-1)
            only_hi = (sel == hi).any(-1) & ~(sel == lo).any(-1)
            checks.expect(not only_hi.any(), f"{name}: expert {hi} taken without its tie {lo}")
            checks.expect(both.any(), f"{name}: the tied pair ({lo}, {hi}) is never selected together")
    if p["capacity"] > 0:
        checks.expect((t["kept"] == 0).any(), f"{name}: a capacity case drops no token")


def test_family_present(golden_dir):
    assert sorted(golden_dir.glob(golden_glob)), f"no {golden_glob} in {golden_dir}"


def test_manifest_lists_the_files(golden_dir, family_cases):
    listed = {c["file"] for c in family_cases}
    on_disk = {path.name for path in golden_dir.glob(golden_glob)}
    assert listed == on_disk, f"manifest lists {sorted(listed)}, directory has {sorted(on_disk)}"


def test_latent_moe(golden_file, checks):
    t, meta = load(golden_file)
    checks.expect(meta["k3ref.op"] == "moe.latent", f"{golden_file.name}: unknown op {meta['k3ref.op']}")
    check_case(golden_file.stem, t, json.loads(meta["k3ref.params"]), checks)
    checks.verify()
