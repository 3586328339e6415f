"""A KDA kernel of your own, checked by k3ref: a plain PyTorch recurrence in fp32 (bf16 out).

    python3 -m pytest -p k3ref.pytest_plugin --k3ref-adapter examples/torch_kda_adapter.py:TorchKda examples
    python3 -m k3ref.gpu_check run --no-builtin --adapter examples/torch_kda_adapter.py:TorchKda
"""
import torch

from k3ref.gpu_check.adapters import KdaAdapter


class TorchKda(KdaAdapter):
    name = "example.torch_kda"
    contract = "PyTorch; fp32 state and arithmetic on bf16 inputs, output rounded once to bf16"
    policy = "recurrent"  # rel RMS of o and of the final state <= 1.5 x the bf16 output-rounding floor
    policy_reason = "an fp32 recurrence is at the bf16 floor; 1.5x leaves room for fp32 accumulation"

    def unsupported(self, params, shapes):  # None, or why a case is outside this kernel's scope
        return None if params.get("gate", "log_decay") == "log_decay" else "only the log-decay gate (g = log decay)"

    def run(self, inputs, params, out=None):  # (o [B,T,HV,V], final state [N,HV,K,V] or [N,HV,V,K])
        q, k, v, g, beta = (inputs[n].float() for n in ("q", "k", "v", "g", "beta"))
        (B, T, H, K), HV, dev = q.shape, v.shape[2], q.device
        q, k = q.repeat_interleave(HV // H, 2), k.repeat_interleave(HV // H, 2)  # grouped value heads
        if params.get("qk_l2norm"):
            q, k = (x / (x.square().sum(-1, keepdim=True) + 1e-6).sqrt() for x in (q, k))
        if params.get("beta", "as_given") != "as_given":
            beta = beta.sigmoid() * (2.0 if params["beta"] == "two_sigmoid" else 1.0)
        q = q * (params.get("scale") or K ** -0.5)
        cu, h0, v_first = inputs.get("cu_seqlens"), inputs.get("initial_state"), params.get("state_layout") == "v_first"
        seqs = [(0, int(a), int(b)) for a, b in zip(cu[:-1], cu[1:])] if cu is not None else [(b, 0, T) for b in range(B)]
        o, finals = torch.zeros(v.shape, device=dev), []
        for n, (b, begin, end) in enumerate(seqs):
            S = torch.zeros(HV, K, v.shape[3], device=dev) if h0 is None else h0[n].float().clone()
            S = S.transpose(-1, -2) if v_first and h0 is not None else S
            for t in range(begin, end):  # S <- diag(exp g) S;  S <- S + beta k (v - k S);  o = q S
                S = S * g[b, t].exp()[..., None]
                S = S + beta[b, t][:, None, None] * k[b, t][..., None] * (v[b, t] - torch.einsum("hk,hkv->hv", k[b, t], S))[:, None]
                o[b, t] = torch.einsum("hk,hkv->hv", q[b, t], S)
            finals.append(S.transpose(-1, -2) if v_first else S)
        return o.to(torch.bfloat16), torch.stack(finals)
