"""k3ref.cost (python/k3ref/cost.py, through k3ref._core) and `k3ref report` give the cost
models of docs/cost-models.md: the formulas recomputed here in exact fractions, a uniform
dispatch built here against the uniform formula, and a QB golden's measured routing through
both the package and the command."""
import json
import os
import subprocess
from fractions import Fraction

import pytest

from conftest import GOLDENS, needs_core

np = pytest.importorskip("numpy")


@needs_core
@pytest.mark.parametrize("D", [16, 64, 128])
def test_decode_is_seven_and_eight_d_squared(D):
    from k3ref import cost
    r = cost.decode(head_dim=D, heads=96, tokens=3)
    assert r["flops"] == 7 * D * D * 96 * 3
    assert r["bytes"] == 8 * D * D * 96 * 3


@needs_core
@pytest.mark.parametrize("T,C,D", [(4096, 16, 128), (32768, 16, 128), (100, 16, 64), (64, 64, 128)])
def test_prefill_is_the_chunk_formula_times_the_chunks_plus_the_state(T, C, D):
    from k3ref import cost
    r = cost.prefill(tokens=T, head_dim=D, chunk=C, heads=2)
    chunk_flops = 12 * C**3 + 8 * C**2 * D + 6 * C * D**2
    chunk_bytes = 8 * C**2 + 22 * C * D
    chunks = -(-T // C)
    assert r["per_chunk"]["flops"] == chunk_flops and r["per_chunk"]["bytes"] == chunk_bytes
    assert r["per_head"]["flops"] == chunks * chunk_flops
    assert r["per_head"]["bytes"] == chunks * chunk_bytes + 2 * 8 * D * D
    assert r["total"]["flops"] == 2 * chunks * chunk_flops


def uniform_selection(n, E, k, c):
    """t = E n c tokens, token i on GPU (block) ... laid out so that contiguous blocks of
    t / E tokens each send every expert c k routes: token i = g (n c) + a, experts (a k + r) mod n."""
    t = E * n * c
    sel = np.zeros((t, k), dtype=np.int64)
    for i in range(t):
        a = i % (n * c)
        sel[i] = [(a * k + r) % n for r in range(k)]
    return sel


@needs_core
@pytest.mark.parametrize("n,E,k,c", [(8, 4, 2, 1), (16, 8, 4, 2), (896 // 14, 8, 16, 1)])
def test_a_uniform_dispatch_gives_the_uniform_ratio(n, E, k, c):
    from k3ref import cost
    kw = dict(bytes_per_element=2, flops_per_second=989e12, bytes_per_second=50e9, intermediate=3072)
    r = cost.moe_ratio(uniform_selection(n, E, k, c), experts=n, gpus=E, **kw)
    t = E * n * c
    assert r["routes_in"] == [t * k // E] * E
    assert all(Fraction(x) == Fraction(t * k, E) * (1 - Fraction(1, E)) for x in r["remote_in"])
    assert r["ratio"] == pytest.approx(cost.moe_ratio_uniform(gpus=E, **kw), rel=1e-15)
    assert cost.moe_ratio_uniform(gpus=E, **kw) == pytest.approx(2 * 989e12 / (6 * 3072 * 50e9) * (1 - 1 / E), rel=1e-15)


@needs_core
def test_a_measured_qb_routing_through_the_package_and_the_command():
    from k3ref import _safetensors, cost
    path = GOLDENS / "qb_online_m48_n16_k4_tie_heavy.safetensors"
    t, _ = _safetensors.load(path)
    kw = dict(bytes_per_element=2, flops_per_second=989e12, bytes_per_second=50e9, intermediate=3072)
    mine = [cost.moe_ratio(t["qb_selection"][b], experts=16, gpus=4, **kw) for b in range(t["qb_selection"].shape[0])]
    for r in mine:  # every route counted once; the busiest GPU computes at least the mean
        assert sum(r["routes_in"]) == 48 * 4 and sum(r["remote_in"]) == sum(r["remote_out"])
        assert max(r["routes_in"]) >= 48 * 4 // 4
    exe = os.environ.get("K3REF_EXE")
    if not exe:
        pytest.skip("K3REF_EXE not set")
    out = subprocess.run([exe, "report", "moe", "--flops", "989e12", "--bandwidth", "50e9", "--gpus", "4",
                          "--golden", str(path), "--tensor", "qb_selection", "--json"],
                         capture_output=True, text=True, check=True)
    report = json.loads(out.stdout)
    assert [b["ratio"] for b in report["measured"]["batches"]] == [r["ratio"] for r in mine]
    assert report["uniform_ratio"] == cost.moe_ratio_uniform(gpus=4, **kw)
