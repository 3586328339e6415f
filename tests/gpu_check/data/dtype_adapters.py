"""Two CPU kernels that differ only in how they carry their state, for test_state_dtype.py:

- `Bf16Carry`: the fp64 recurrence, o and the final state returned in bf16 (a correct kernel
  that computes in fp32 or better and stores its state in bf16), declaring state_dtype bf16;
- `Bf16EveryToken`: the same recurrence with the state rounded to bf16 after every token (a
  kernel whose running state lives in bf16: wrong).
"""
import torch

from k3ref.gpu_check import torch_model as reference  # the PyTorch recurrence, a kernel model
from k3ref.gpu_check.adapters import KdaAdapter


class Bf16Carry(KdaAdapter):
    name = "dtype.bf16_carry"
    state_dtype = torch.bfloat16

    def run(self, inputs, params, out=None):
        o, final = reference.kda_forward(inputs, params)
        return o.to(torch.bfloat16), final.to(torch.bfloat16)


class Bf16EveryToken(Bf16Carry):
    name = "dtype.bf16_every_token"

    def run(self, inputs, params, out=None):
        q, k, v, d, beta = reference.prepare(inputs, params)
        B, T, H, K = q.shape
        HV = v.shape[2]
        heads = torch.arange(HV) // (HV // H)
        scale = params.get("scale") or K ** -0.5
        v_first = params.get("state_layout") == "v_first"
        h0 = inputs.get("initial_state")
        o = torch.zeros(v.shape, dtype=torch.float64)
        finals = []
        for n, (b, begin, end) in enumerate(reference.sequences(inputs)):
            S = torch.zeros(HV, K, v.shape[3], dtype=torch.float64) if h0 is None else h0[n].double()
            S = S.transpose(-1, -2).clone() if v_first and h0 is not None else S
            for t in range(begin, end):
                kt = k[b, t, heads]
                S = S * d[b, t].unsqueeze(-1)
                u = v[b, t] - torch.einsum("hk,hkv->hv", kt, S)
                S = (S + beta[b, t].reshape(HV, 1, 1) * kt.unsqueeze(-1) * u.unsqueeze(1)).to(torch.bfloat16).double()
                o[b, t] = torch.einsum("hk,hkv->hv", q[b, t, heads] * scale, S)
            finals.append(S.transpose(-1, -2) if v_first else S)
        return o.to(torch.bfloat16), torch.stack(finals).to(torch.bfloat16)


def adapters():
    return [Bf16Carry(), Bf16EveryToken()]
