"""Independent cross-check of the committed Quantile Balancing goldens (qb_*.safetensors).

A second implementation, written from docs/qb.md and proofs/qb_dual.md in NumPy and
Python's exact Fraction, with its own safetensors reader; it shares no code with the C++
generator. Every golden value is exact (dyadic scores, exact references), so the checks
are equalities, not tolerances:
  qb.solver  recompute every iterate (alpha, beta, selection by the tie rule, loads,
             MaxVio, dual objective); where the optimum is stored, certify it
             independently: the assignment is balanced and the stored dual (alpha*, beta*)
             has the same objective (weak duality then proves both optimal), with
             complementary slackness; and the duality gap of every iterate.
  qb.online  recompute QB online (bias of batch t routes t+1, warm start, centred) and the
             sign update on the same batches, the gating weights exactly.
The files checked are the directory's qb_*.safetensors (test_manifest_lists_the_files: the
manifest's qb.* cases exactly).
"""
import json
import math
from fractions import Fraction

import pytest

np = pytest.importorskip("numpy")

from oracle import load  # noqa: E402  (the one NumPy oracle's reader)
from oracle.qb import route, solver_step  # noqa: E402

golden_glob = "qb_*.safetensors"


def accept_op(op):
    return op.startswith("qb.")


# ---- the method, from the design ------------------------------------------------------------

def loads_of(selection, n):
    return np.bincount(selection.reshape(-1), minlength=n)


def max_vio(loads):
    return float(Fraction(int(loads.max()) * len(loads), int(loads.sum())) - 1)


def dual_objective(s, alpha, beta, k, q):
    slack = s - alpha[:, None] - beta[None, :]
    terms = [k * float(a) for a in alpha] + [q * float(b) for b in beta] + list(slack[slack > 0])
    return math.fsum(terms)  # correctly rounded; every term is exact for these dyadic inputs


def check_solver(name, t, p, checks):
    m, n, k, q, T = p["m"], p["n"], p["k"], p["q"], p["iterations"]
    s = t["scores"] if "scores" in t else t["x"] @ t["w"].T + t["u"][None, :]
    if not checks.expect(s.shape == (m, n) and q * n == m * k, f"{name}: scores not m x n, or q * n != m * k"):
        return
    beta = np.zeros(n)
    kept = list(t["selection_iterations"])
    for it in range(T):
        alpha, beta, selection = solver_step(s, beta, k, q)
        loads = loads_of(selection, n)
        checks.expect(np.array_equal(alpha, t["alpha"][it]), f"{name}: alpha at iteration {it + 1}")
        checks.expect(np.array_equal(beta, t["beta"][it]), f"{name}: beta at iteration {it + 1}")
        checks.expect(np.array_equal(loads, t["loads"][it]), f"{name}: loads at iteration {it + 1}")
        checks.expect(max_vio(loads) == t["max_vio"][it], f"{name}: max_vio at iteration {it + 1}")
        d = dual_objective(s, alpha, beta, k, q)
        checks.expect(d == t["dual_objective"][it], f"{name}: dual objective at iteration {it + 1}")
        if it + 1 in kept:
            stored = t["selection"][kept.index(it + 1)]
            checks.expect(np.array_equal(selection, stored), f"{name}: selection at iteration {it + 1}")
        if "duality_gap" in t:
            exact_gap = exact_dual(s, alpha, beta, k, q) - Fraction(float(t["lp_optimum"][0]))
            checks.expect(exact_gap >= 0, f"{name}: negative duality gap at iteration {it + 1}")
            checks.expect(float(exact_gap) == t["duality_gap"][it], f"{name}: duality gap at iteration {it + 1}")
    if "lp_optimum" in t:
        chosen = t["optimal_assignment"].astype(np.int64)
        checks.expect(set(np.unique(chosen)) <= {0, 1}, f"{name}: optimal assignment not 0/1")
        checks.expect((chosen.sum(1) == k).all() and (chosen.sum(0) == q).all(), f"{name}: optimal assignment not balanced")
        primal = sum(Fraction(float(x)) for x in s[chosen == 1])
        dual = exact_dual(s, t["optimal_alpha"], t["optimal_beta"], k, q)
        # Weak duality: every balanced assignment is <= D(alpha, beta) for every (alpha, beta);
        # equality certifies that both are optimal.
        checks.expect(primal == dual, f"{name}: optimum not certified (primal {primal} != dual {dual})")
        checks.expect(float(primal) == t["lp_optimum"][0], f"{name}: lp_optimum")
        reduced = s - t["optimal_alpha"][:, None] - t["optimal_beta"][None, :]
        checks.expect(((reduced >= 0) | (chosen == 0)).all() and ((reduced <= 0) | (chosen == 1)).all(),
               f"{name}: complementary slackness")


def exact_dual(s, alpha, beta, k, q):
    total = k * sum(Fraction(float(a)) for a in alpha) + q * sum(Fraction(float(b)) for b in beta)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            r = Fraction(float(s[i, j])) - Fraction(float(alpha[i])) - Fraction(float(beta[j]))
            if r > 0:
                total += r
    return total


def check_online(name, t, p, checks):
    B, m, n, k = p["batches"], p["m"], p["n"], p["k"]
    q = m * k // n
    scale = Fraction(*p["routed_scaling_factor"])
    gamma = Fraction(*p["sign_gamma"])
    A = t["affinities"]

    def routed(prefix, b, s, bias):
        selection = route(s, bias, k)
        loads = loads_of(selection, n)
        # The goldens' one convention: the expert bias beta, subtracted, as the algorithm's state.
        checks.expect(np.array_equal(bias, t[prefix + "_beta"][b]), f"{name}: {prefix} beta of batch {b}")
        checks.expect(np.array_equal(selection, t[prefix + "_selection"][b]), f"{name}: {prefix} selection of batch {b}")
        checks.expect(np.array_equal(loads, t[prefix + "_loads"][b]), f"{name}: {prefix} loads of batch {b}")
        checks.expect(max_vio(loads) == t[prefix + "_max_vio"][b], f"{name}: {prefix} max_vio of batch {b}")
        for i in range(m):
            chosen = [Fraction(float(s[i, j])) for j in selection[i]]
            total = sum(chosen)
            w = [float(scale * c / total) for c in chosen]  # unbiased affinities, exactly rounded
            checks.expect(w == list(t[prefix + "_weights"][b][i]), f"{name}: {prefix} weights of batch {b} token {i}")
        return loads

    bias = np.zeros(n)
    for b in range(B):
        s = A[b]
        routed("qb", b, s, bias)
        nxt = bias.copy() if p["warm_start"] else np.zeros(n)
        for _ in range(p["iterations_per_batch"]):
            _, nxt, _ = solver_step(s, nxt, k, q)
        if p["center_bias"]:
            nxt = nxt - math.fsum(nxt) / n
        bias = nxt  # computed on batch b, used from batch b + 1 on

    beta = np.zeros(n)
    for b in range(B):
        loads = routed("sign", b, A[b], beta)
        beta = beta + float(gamma) * np.sign(loads * n - m * k)


def test_family_present(golden_dir):
    assert sorted(golden_dir.glob(golden_glob)), f"no {golden_glob} in {golden_dir}"


def test_manifest_lists_the_files(golden_dir, family_cases):
    listed = {c["file"] for c in family_cases}
    on_disk = {path.name for path in golden_dir.glob(golden_glob)}
    assert listed == on_disk, f"manifest lists {sorted(listed)}, directory has {sorted(on_disk)}"


def test_qb(golden_file, checks):
    t, meta = load(golden_file)
    p = json.loads(meta["k3ref.params"])
    if meta["k3ref.op"] == "qb.solver":
        check_solver(golden_file.stem, t, p, checks)
    elif meta["k3ref.op"] == "qb.online":
        check_online(golden_file.stem, t, p, checks)
    checks.expect(meta["k3ref.op"] in ("qb.solver", "qb.online"), f"{golden_file.name}: unknown op {meta['k3ref.op']}")
    checks.verify()
