"""Independent cross-check of the committed GDN goldens (gdn.recurrent, gdn.chunkwise_fla,
gdn.decode, gdn.verify, gdn.replay_decode).

Written from docs/gdn.md in NumPy (float64), with GDN's own scalar gate: the state of a head
is scaled by one decay a_t (not a per-row diagonal), then the delta rule and the read. The
packed mixed_qkv rows are split by the layout [q heads | k heads | v heads]; the pool is
addressed from its stored geometry (decode: back into the sequence's slot; verify: entering
from column a - 1 of its row, the state after token j into column j); the replay decode rebuilds each row's state from its
checkpoint and ring entries (exp of the later gates' sum on each d k^T), runs the token, and
appends to the ring or, at write position L - 1, folds the state into the checkpoint. Only
the file reader, the comparison (compare_outputs), sigmoid and softplus come from the NumPy
oracle (tests/oracle/); nothing is shared with the C++ generator.
"""
import pytest

np = pytest.importorskip("numpy")

from oracle import compare_outputs, sigmoid, softplus, wide  # noqa: E402  (the one NumPy oracle)

# Bound on the relative RMS difference: measured worst 2.63e-16 over 12 goldens
# (date 2026-12-02); bound 4x (4.2x).
TOLERANCE = 1.1e-15
PADDING_VALUE = 2.0**100


def normalised(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def gdn_stages(q, k, v, g, beta, t, p):
    """q, k normalised if asked; the per-head decays exp(g) (GDN's gating for the softplus
    gate: g = -exp(A_log) softplus(a + dt_bias)); beta activated; the scale."""
    q, k, v, g, beta = (wide(x) for x in (q, k, v, g, beta))
    if p["qk_l2norm"]:
        q, k = normalised(q), normalised(k)
    if p["gate"] == "softplus":
        g = -np.exp(wide(t["A_log"])) * softplus(g + (wide(t["dt_bias"]) if "dt_bias" in t else 0.0))
    decay = g if p["gate"] == "decay_factor" else np.exp(g)
    if p["beta"] == "sigmoid":
        beta = sigmoid(beta)
    scale = p["scale"] if p.get("scale") is not None else q.shape[-1] ** -0.5
    return q, k, v, g, decay, beta, scale


def gdn_token(S, q, k, v, a, beta, scale):
    """One token on one head's K x V state S: S <- a S + beta k (v - a S^T k)^T; o = S^T (scale q)."""
    S = a * S
    d = beta * (v - k @ S)
    S = S + np.outer(k, d)
    return S, S.T @ (scale * q), d


def gdn_sequence(q, k, v, decay, beta, scale, S, tokens, o):
    """Tokens of one sequence (q, k [T, H, K], ...) from S [HV, K, V]; writes o[t]; returns the last state."""
    H, HV = q.shape[1], v.shape[1]
    S = S.copy()
    for t in tokens:
        for hv in range(HV):
            h = hv // (HV // H)
            S[hv], o[t, hv], _ = gdn_token(S[hv], q[t, h], k[t, h], v[t, hv], decay[t, hv], beta[t, hv], scale)
    return S


def forward_case(t, p):
    q, k, v, _, decay, beta, scale = gdn_stages(t["q"], t["k"], t["v"], t["g"], t["beta"], t, p)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    v_first = p["state_layout"] == "v_first"
    cu = p.get("cu_seqlens")
    seqs = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)] if cu else [(b, 0, T) for b in range(B)]
    o = np.zeros((B, T, HV, V))
    final = np.zeros((len(seqs), HV, K, V))
    for n, (b, begin, end) in enumerate(seqs):
        S0 = np.zeros((HV, K, V)) if "initial_state" not in t else wide(t["initial_state"][n])
        if v_first and "initial_state" in t:
            S0 = S0.transpose(0, 2, 1)
        final[n] = gdn_sequence(q[b], k[b], v[b], decay[b], beta[b], scale, S0, range(begin, end), o[b])
    return {"o": o, "final_state": final.transpose(0, 1, 3, 2) if v_first else final}


def unpacked(mixed, H, HV, K, V):
    """mixed_qkv [..., 2 H K + HV V] to q, k [..., H, K] and v [..., HV, V]."""
    lead = mixed.shape[:-1]
    return (mixed[..., : H * K].reshape(lead + (H, K)), mixed[..., H * K : 2 * H * K].reshape(lead + (H, K)),
            mixed[..., 2 * H * K :].reshape(lead + (HV, V)))


def slot_indices(geometry, HV, K, V, s):
    """Buffer positions of slot s as a K-first [HV, K, V] array of indices."""
    _, stride, offset, v_first = (int(x) for x in geometry)
    hv, i, j = np.meshgrid(np.arange(HV), np.arange(K), np.arange(V), indexing="ij")
    return offset + s * stride + hv * K * V + (j * K + i if v_first else i * V + j)


def pool_checks(t, buffer, named, HV, K, V, checks):
    """The pool outside the named slots is the input's, the padding holds 2^100; returns the
    masks of the buffer inside any slot (pool_out is compared there)."""
    before = t["pool"].astype(np.float64)
    slots = int(t["pool_geometry"][0])
    inside, changed = np.zeros(before.size, bool), np.zeros(before.size, bool)
    for s in range(slots):
        inside[slot_indices(t["pool_geometry"], HV, K, V, s).ravel()] = True
    for s in named:
        changed[slot_indices(t["pool_geometry"], HV, K, V, s).ravel()] = True
    checks.expect(np.array_equal(t["pool_out"][~changed], before[~changed]), "pool_out differs outside the named slots")
    checks.expect(np.all(before[~inside] == PADDING_VALUE), "the pool's padding does not hold 2^100")
    t["pool_out"] = t["pool_out"][inside]
    return buffer[inside]


def decode_case(t, p, checks):
    H, HV, K, V = p["H"], p["HV"], p["K"], p["V"]
    q, k, v = unpacked(t["mixed_qkv"].astype(np.float64), H, HV, K, V)
    q, k, v, _, decay, beta, scale = gdn_stages(q, k, v, t["a"], t["b"], t, p)
    buffer = t["pool"].astype(np.float64).copy()
    source = buffer.copy()  # every sequence reads the pool as it was
    cu = [int(x) for x in t["cu_seqlens"]]
    o = np.zeros(v.shape)
    named = []
    for n in range(len(cu) - 1):
        if "slot_of_sequence" in t:  # decode: enter from and write back into one slot
            entering = int(t["slot_of_sequence"][n])
            writes = [entering] * (cu[n + 1] - cu[n])
        else:  # verify: enter from column a - 1, the state after token j into column j (-1: not stored)
            entering = int(t["state_indices"][n, int(t["num_accepted"][n]) - 1])
            writes = [int(x) for x in t["state_indices"][n, : cu[n + 1] - cu[n]]]
        if cu[n] == cu[n + 1] or entering == -1:
            continue  # no tokens, or padding: nothing read or written, outputs zero
        S = source[slot_indices(t["pool_geometry"], HV, K, V, entering)]
        for j, token in enumerate(range(cu[n], cu[n + 1])):
            S = gdn_sequence(q[0], k[0], v[0], decay[0], beta[0], scale, S, [token], o[0])
            if writes[j] != -1:
                buffer[slot_indices(t["pool_geometry"], HV, K, V, writes[j])] = S
                named.append(writes[j])
    return {"o": o, "pool_out": pool_checks(t, buffer, named, HV, K, V, checks)}


def replay_case(t, p, checks):
    H, HV, K, V = p["H"], p["HV"], p["K"], p["V"]
    q, k, v = unpacked(t["mixed_qkv"].astype(np.float64), H, HV, K, V)
    q, k, v, g, decay, beta, scale = gdn_stages(q, k, v, t["a"], t["b"], t, p)
    buffer = t["pool"].astype(np.float64).copy()
    d_cache, k_cache, g_cache = (t[n].astype(np.float64).copy() for n in ("d_cache", "k_cache", "g_cache"))
    L = g_cache.shape[2]
    checks.expect(L == p["L"], "the ring length is not the parameters'")
    o = np.zeros((q.shape[0], HV, V))
    named = []
    for n, (s, w) in enumerate(zip(t["state_indices"], t["write_pos"])):
        s, w = int(s), int(w)
        if s <= 0:
            continue  # padding: output zero, nothing read or written
        at = slot_indices(t["pool_geometry"], HV, K, V, s)
        S0 = buffer[at]
        for hv in range(HV):
            h = hv // (HV // H)
            gates = g_cache[s, hv, :w]
            S = np.exp(gates.sum()) * S0[hv]
            for c in range(w):  # entry c decays by the gates after it
                S = S + np.exp(gates[c + 1 :].sum()) * np.outer(k_cache[s, h, c], d_cache[s, hv, c])
            S, o[n, hv], d = gdn_token(S, q[n, h], k[n, h], v[n, hv], decay[n, hv], beta[n, hv], scale)
            if w == L - 1:
                S0[hv] = S  # the flush: the state after the token is the new checkpoint
            else:
                d_cache[s, hv, w], g_cache[s, hv, w], k_cache[s, h, w] = d, g[n, hv], k[n, h]
        if w == L - 1:
            buffer[at] = S0
            named.append(s)
    return {"o": o, "pool_out": pool_checks(t, buffer, named, HV, K, V, checks), "d_cache_out": d_cache,
            "k_cache_out": k_cache, "g_cache_out": g_cache}


def accept_op(op):
    return op.startswith("gdn.")


def test_family_present(family_cases):
    assert {c["op"] for c in family_cases} == {"gdn.recurrent", "gdn.chunkwise_fla", "gdn.decode", "gdn.verify",
                                               "gdn.replay_decode"}


def test_replay_goldens_cover_every_write_position(family_cases):
    """Write positions 0, a middle one and L - 1 (the flush), and padded rows 0 and -1."""
    seen = set()
    for c in family_cases:
        if c["op"] == "gdn.replay_decode":
            p = c["params"]
            for s, w in zip(p["state_indices"], p["write_pos"]):
                seen.add("padding" if s <= 0 else ("first" if w == 0 else "flush" if w == p["L"] - 1 else "middle"))
            seen.update("padding " + str(s) for s in p["state_indices"] if s <= 0)
    assert seen >= {"first", "middle", "flush", "padding", "padding 0", "padding -1"}, seen


def test_gdn(case, golden, checks):
    tensors, meta = golden
    p = case["params"]
    if case["op"] in ("gdn.decode", "gdn.verify"):
        ours = decode_case(tensors, p, checks)
    elif case["op"] == "gdn.replay_decode":
        ours = replay_case(tensors, p, checks)
    else:
        ours = forward_case(tensors, p)
    compare_outputs(tensors, meta, ours, checks, TOLERANCE)
