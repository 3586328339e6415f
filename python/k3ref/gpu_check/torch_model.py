"""The KDA recurrence written in PyTorch, in fp64 (docs/conventions.md): a *kernel under test*,
not a reference. The built-in CPU test kernels (`torch.fp64_bf16` and its mutants), the serving
and CP models and the tests' stand-ins are built on it; what they are judged against comes from
references.py (k3ref's compiled references, libk3gc's fp64 kernel for long cases)."""

import torch


def prepare(inputs, params):
    """Applies the optional stages; returns q, k, v, decay (exp of the log gate), beta in fp64."""
    q, k, v, g, beta = (inputs[n].to(torch.float64) for n in ("q", "k", "v", "g", "beta"))
    K = q.shape[-1]
    HV = v.shape[2]
    if params.get("qk_l2norm"):
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    gate = params.get("gate", "log_decay")
    if gate != "log_decay":
        bias = inputs.get("dt_bias")
        x = g + (bias.to(torch.float64).reshape(HV, K) if bias is not None else 0.0)
        A_log = inputs.get("A_log")
        amp = torch.exp(A_log.to(torch.float64)).reshape(HV, 1) if A_log is not None else None
        if gate == "softplus":
            sp = torch.where(x > 0, x + torch.log1p(torch.exp(-x.abs())), torch.log1p(torch.exp(torch.clamp(x, max=0))))
            g = -(amp if amp is not None else 1.0) * sp
        elif gate == "lower_bound":
            g = float(params["lower_bound"]) * torch.sigmoid(amp * x if amp is not None else x)
        else:
            raise ValueError(f"unknown gate {gate}")
    mode = params.get("beta", "as_given")
    if mode == "sigmoid":
        beta = torch.sigmoid(beta)
    elif mode == "two_sigmoid":
        beta = 2 * torch.sigmoid(beta)
    return q, k, v, torch.exp(g), beta


def sequences(inputs):
    B, T = inputs["q"].shape[:2]
    cu = inputs.get("cu_seqlens")
    if cu is not None:
        c = [int(x) for x in cu.tolist()]
        return [(0, c[n], c[n + 1]) for n in range(len(c) - 1)]
    return [(b, 0, T) for b in range(B)]


def kda_forward(inputs, params, state_hook=None):
    """Returns (o [B,T,HV,V] fp64, final_state fp64 in the params' layout). state_hook(position
    in the sequence, S [HV, K, V]) -> S, after each write of the state (its decay, then its
    update): what a stand-in that stores its state differently does to it."""
    q, k, v, d, beta = prepare(inputs, params)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    group = HV // H
    scale = params.get("scale")
    scale = K ** -0.5 if scale is None else float(scale)
    v_first = params.get("state_layout") == "v_first"
    h0 = inputs.get("initial_state")
    seqs = sequences(inputs)
    o = torch.zeros(B, T, HV, V, dtype=torch.float64, device=q.device)
    final = torch.zeros(len(seqs), HV, K, V, dtype=torch.float64, device=q.device)
    heads = torch.arange(HV, device=q.device) // group
    for n, (b, begin, end) in enumerate(seqs):
        S = torch.zeros(HV, K, V, dtype=torch.float64, device=q.device)
        if h0 is not None:
            S = h0[n].to(torch.float64)
            if v_first:
                S = S.transpose(-1, -2)
            S = S.clone()
        for t in range(begin, end):
            kt = k[b, t, heads]  # [HV, K]
            qt = q[b, t, heads] * scale
            S = S * d[b, t].unsqueeze(-1)
            if state_hook is not None:
                S = state_hook(t - begin, S)
            u = v[b, t] - torch.einsum("hk,hkv->hv", kt, S)
            S = S + beta[b, t].reshape(HV, 1, 1) * kt.unsqueeze(-1) * u.unsqueeze(1)
            if state_hook is not None:
                S = state_hook(t - begin, S)
            o[b, t] = torch.einsum("hk,hkv->hv", qt, S)
        final[n] = S
    if v_first:
        final = final.transpose(-1, -2).contiguous()
    return o, final
