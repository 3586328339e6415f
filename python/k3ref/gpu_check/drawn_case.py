"""The inputs and golden parameters of a case `prop` draws (a dict of the golden generator's
parameters and a seed): shared by prop and by the warm-up, which compiles prop's shapes."""
import math

import torch


def make_inputs(case):
    """Inputs of a drawn case, exactly representable in bf16 (fp32 for A_log, dt_bias),
    deterministic in case['seed']; the scheme of the golden generator (kda_cases.cc)."""
    gen = torch.Generator().manual_seed(case["seed"])

    def uniform(shape, lo, hi, dtype=torch.bfloat16):
        return (torch.rand(shape, generator=gen, dtype=torch.float64) * (hi - lo) + lo).to(dtype)

    B, T, H, HV, K, V = (case[n] for n in ("B", "T", "H", "HV", "K", "V"))
    # Without the in-kernel L2 norm, keys in [-1/sqrt(K), 1/sqrt(K)] keep beta ||k||^2 <= 2.
    kw = 1.0 if case["qk_l2norm"] else 1.0 / math.sqrt(K)
    inputs = {
        "q": uniform((B, T, H, K), -1, 1),
        "k": uniform((B, T, H, K), -kw, kw),
        "v": uniform((B, T, HV, V), -1, 1),
        "g": uniform((B, T, HV, K), *case["g_range"]),
        "beta": uniform((B, T, HV), *case["beta_range"]),
    }
    N = len(case["cu_seqlens"]) - 1 if case["cu_seqlens"] else B
    if case["initial_state"]:
        shape = (N, HV, V, K) if case["state_layout"] == "v_first" else (N, HV, K, V)
        inputs["initial_state"] = uniform(shape, -1, 1).to(torch.float32)
    if case["A_log"]:
        inputs["A_log"] = uniform((HV,), 0, math.log(16.0), torch.float32)
    if case["dt_bias"]:
        inputs["dt_bias"] = uniform((HV, K), -1, 1, torch.float32)
    if case["cu_seqlens"]:
        inputs["cu_seqlens"] = torch.tensor(case["cu_seqlens"], dtype=torch.int64)
    return inputs


def params_of(case):
    """The golden params (kda_cases.cc's KdaParams as JSON)."""
    keys = ("B", "T", "H", "HV", "K", "V", "cu_seqlens", "initial_state", "gate", "gate_base", "g_range",
            "lower_bound", "A_log", "dt_bias", "beta", "beta_range", "qk_l2norm", "scale", "state_layout",
            "all_states")
    p = {k: case[k] for k in keys}
    p["g_range"] = list(p["g_range"])
    p["beta_range"] = list(p["beta_range"])
    return p
