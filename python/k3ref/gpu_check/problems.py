"""The problems the KDA checks without a golden run on: the configurations they draw from
(CONFIGS), their inputs by seed (make_problem), the sequence length and split point of the
metamorphic checks, and the token slices of a problem. Shared by the checks, the shape plan
and the warm-up (which compile these shapes ahead) and the version probe (which runs one)."""
import torch


def _bf16_uniform(gen, shape, lo, hi):
    return (torch.rand(shape, generator=gen, dtype=torch.float64) * (hi - lo) + lo).to(torch.bfloat16)


# The configurations the metamorphic checks draw from, first one an adapter supports wins.
CONFIGS = [
    # odd sizes: K not a power of two, T not a multiple of 16 or 64, GVA, log-decay gate
    dict(name="generic_k100", H=1, HV=2, K=100, V=64, gate="log_decay", g_range=(-1.0, 0.0), beta="as_given",
         qk_l2norm=False, state_layout="k_first", lower_bound=None),
    # the FlashKDA / K3 shape: lower-bound gate in kernel, sigmoid beta, L2 norm, V-first state
    dict(name="k3_lower_bound", H=2, HV=2, K=128, V=128, gate="lower_bound", g_range=(-4.0, 4.0), beta="sigmoid",
         qk_l2norm=True, state_layout="v_first", lower_bound=-5.0),
]


def make_problem(config, T, seed, device, cu_seqlens=None, initial_state=True):
    """Random inputs exactly representable in bf16, deterministic in the seed."""
    gen = torch.Generator().manual_seed(seed)
    c = config
    B = 1
    H, HV, K, V = c["H"], c["HV"], c["K"], c["V"]
    inputs = {
        "q": _bf16_uniform(gen, (B, T, H, K), -1, 1),
        "k": _bf16_uniform(gen, (B, T, H, K), -1, 1),
        "v": _bf16_uniform(gen, (B, T, HV, V), -1, 1),
        "g": _bf16_uniform(gen, (B, T, HV, K), *c["g_range"]),
        "beta": _bf16_uniform(gen, (B, T, HV), *((0.0, 1.0) if c["beta"] == "as_given" else (-4.0, 4.0))),
    }
    if c["gate"] != "log_decay":
        inputs["A_log"] = (torch.rand(HV, generator=gen, dtype=torch.float64) - 0.5).float()
        inputs["dt_bias"] = (torch.rand(HV, K, generator=gen, dtype=torch.float64) - 0.5).float()
    N = len(cu_seqlens) - 1 if cu_seqlens else B
    if initial_state:
        shape = (N, HV, V, K) if c["state_layout"] == "v_first" else (N, HV, K, V)
        inputs["initial_state"] = (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1).float()
    if cu_seqlens:
        inputs["cu_seqlens"] = torch.tensor(cu_seqlens, dtype=torch.int64)
    params = dict(gate=c["gate"], lower_bound=c["lower_bound"], beta=c["beta"], qk_l2norm=c["qk_l2norm"],
                  scale=None, state_layout=c["state_layout"], A_log=c["gate"] != "log_decay",
                  cu_seqlens=cu_seqlens, initial_state=initial_state)
    return {k: v.to(device) for k, v in inputs.items()}, params


def pick_config(adapter):
    chosen = getattr(adapter, "metamorphic_config", None)  # set by shapes.choose_all
    if chosen is not None:
        return chosen
    for c in CONFIGS:
        params = dict(gate=c["gate"], lower_bound=c["lower_bound"], beta=c["beta"], qk_l2norm=c["qk_l2norm"],
                      state_layout=c["state_layout"], A_log=c["gate"] != "log_decay")
        shapes = dict(B=1, T=100, H=c["H"], HV=c["HV"], K=c["K"], V=c["V"])
        if adapter.unsupported(params, shapes) is None:
            return c
    return None


# The metamorphic checks' sequence length and split point (checks.py; the shape plan compiles their runs).
T_META = 100      # not a multiple of 16, 32 or 64: partial final chunks everywhere
P_SPLIT = 41      # a split point inside a chunk

# The inputs with a token axis (axis 1); the rest are per sequence or per head.
TOKEN_INPUTS = ("q", "k", "v", "g", "beta")


def token_range(inputs, start, stop):
    """The inputs of tokens [start, stop) (contiguous copies); per-sequence and per-head
    inputs (initial state, A_log, dt_bias, cu_seqlens) as they are."""
    return {k: (v[:, start:stop].contiguous() if k in TOKEN_INPUTS else v) for k, v in inputs.items()}
