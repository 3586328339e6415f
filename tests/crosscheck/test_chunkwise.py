"""Independent cross-check of the chunkwise KDA stage goldens (kda.chunkwise_*).

Recomputes every stage tensor from the formulas of docs/chunkwise.md in NumPy float64
(a direct matrix inverse for INV, plain cumulative products for the decays, none of the
C++ code's Neumann doubling, forward substitution or pairwise ratios), and o / final_state
with the oracle's recurrence (tests/oracle/).
"""
import pytest

np = pytest.importorskip("numpy")

from oracle import kda_forward, rel_rms, stages  # noqa: E402  (the one NumPy oracle)

# Bound on the relative RMS difference (was 2e-14): measured worst 4.13e-15 over 7 goldens
# (date 2026-12-01); bound 4x (3.88x).
TOLERANCE = 1.6e-14


def accept_op(op):
    return op.startswith("kda.chunkwise_")


def prepared(t, p):
    """The stages with the scale folded into q, as the chunk forms consume them."""
    q, k, v, decay, beta, scale = stages(t, p)
    return q * scale, k, v, decay, beta


def chunk_stages(t, p, form, C):
    q, k, v, decay, beta = prepared(t, p)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    cu = p["cu_seqlens"]
    seqs = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)] if cu else [(b, 0, T) for b in range(B)]
    v_first = p["state_layout"] == "v_first"
    h0 = t.get("initial_state")
    tk, tv, tc = (B, T, HV, K), (B, T, HV, V), (B, T, HV, C)
    out = {n: np.zeros(tk) for n in ("decay", "q_decay", "k_decay", "k_restore")}
    out.update({n: np.zeros(tc) for n in ("L", "INV", "M_qk")})
    out["u"] = np.zeros(tv)
    if form == "flashkda":
        out["k_inv"] = np.zeros(tk)
    else:
        out["w"], out["u_pre"] = np.zeros(tk), np.zeros(tv)
    starts = []
    for n, (b, begin, end) in enumerate(seqs):
        for t0 in range(begin, end, C):
            starts.append((b, t0, min(C, end - t0)))
    nchunks = len(starts)
    chunk_states = np.zeros((nchunks, HV, K, V))
    chunk = 0
    for n, (b, begin, end) in enumerate(seqs):
        first = chunk
        for hv in range(HV):
            h = hv // (HV // H)
            S = np.zeros((K, V))
            if h0 is not None:
                S = h0[n, hv].T.copy() if v_first else h0[n, hv].copy()
            for i, t0 in enumerate(range(begin, end, C)):
                c = min(C, end - t0)
                rows = slice(t0, t0 + c)
                a = np.cumprod(decay[b, rows, hv], axis=0)
                Q, Kc, Vc, bt = q[b, rows, h], k[b, rows, h], v[b, rows, hv], beta[b, rows, hv]
                Kd, Qd, Ki = a * Kc, a * Q, Kc / a
                Kr = a[-1] * Ki
                L = np.tril(bt[:, None] * (Kd @ Ki.T), -1)
                INV = np.linalg.inv(np.eye(c) + L)
                M = np.tril(Qd @ Ki.T)
                chunk_states[first + i, hv] = S
                U = INV @ (bt[:, None] * (Vc - Kd @ S))
                S = a[-1][:, None] * S + Kr.T @ U
                for name, x in (("decay", a), ("q_decay", Qd), ("k_decay", Kd), ("k_restore", Kr), ("u", U)):
                    out[name][b, rows, hv] = x
                for name, x in (("L", L), ("INV", INV), ("M_qk", M)):
                    out[name][b, rows, hv, :c] = x
                if form == "flashkda":
                    out["k_inv"][b, rows, hv] = Ki
                else:
                    out["w"][b, rows, hv] = INV @ (bt[:, None] * Kd)
                    out["u_pre"][b, rows, hv] = INV @ (bt[:, None] * Vc)
        chunk = first + len(range(begin, end, C))
    out["chunk_states"] = chunk_states.transpose(0, 1, 3, 2) if v_first else chunk_states
    out["chunk_starts"] = np.array(starts, dtype=np.int64).reshape(nchunks, 3)
    return out


def test_family_present(family_cases):
    assert family_cases, "no kda.chunkwise_* case in the golden suite"


def test_chunkwise(case, golden, checks):
    tensors, meta = golden
    p = case["params"]  # the KDA keys and the chunk form's, one object (docs/golden-format.md)
    ours = chunk_stages(tensors, p, p["form"], p["chunk_size"])
    ours.update({n: x for n, x in kda_forward(tensors, p).items() if n in ("o", "final_state")})
    names = meta["k3ref.outputs"].split(",") + meta["k3ref.layout"].split(",")  # layout: chunk_starts
    for name in names:
        ref, mine = tensors[name], ours[name]
        if name == "chunk_starts":
            good = np.array_equal(ref, mine)
            rel = 0.0 if good else float("inf")
        else:
            rel = rel_rms(mine, ref)
            good = rel <= TOLERANCE and np.isfinite(mine).all() and ref.shape == mine.shape
        checks.figure(rel)
        checks.expect(good, f"{case['name']} tensor '{name}': relative RMS difference {rel:.3e} > {TOLERANCE}")
    checks.verify()
