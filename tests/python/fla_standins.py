"""PyTorch stand-ins for the Triton pieces FLA's layers call (docs/kda-layer.md): ShortConvolution
(depthwise causal conv + SiLU; cache [N, D, W], the last W inputs per row, updated in place as
FLA's is), FusedRMSNormGated, chunk_kda / fused_recurrent_kda over gpu_check's PyTorch KDA
kernel (torch_model.py) and fused_kda_gate over its gate stage. Used by the layer_check tests
to run FLA's and torchtitan's own layer code on the CPU."""
import torch
import torch.nn.functional as F

from k3ref.gpu_check import torch_model


class ShortConvolution(torch.nn.Conv1d):
    """FLA's ShortConvolution: depthwise causal conv + SiLU; cache [N, D, W], the last W inputs."""

    def __init__(self, hidden_size, kernel_size, bias=False, activation="silu", **kw):
        super().__init__(hidden_size, hidden_size, kernel_size, groups=hidden_size, bias=bias, padding=kernel_size - 1)
        self.activation = activation

    def forward(self, x, cache=None, output_final_state=False, cu_seqlens=None, **kw):
        B, T, D = x.shape
        W = self.kernel_size[0]
        cu = cu_seqlens.tolist() if cu_seqlens is not None else None
        seqs = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)] if cu else [(b, 0, T) for b in range(B)]
        y = torch.zeros_like(x)
        finals = []
        for n, (b, s, e) in enumerate(seqs):
            past = cache[n, :, 1:] if cache is not None else torch.zeros(D, W - 1, dtype=x.dtype)
            window = torch.cat([past, x[b, s:e].T], 1)  # [D, W - 1 + L]
            if e > s:
                out = F.conv1d(window[None], self.weight, self.bias, groups=D)[0]  # valid: [D, L]
                y[b, s:e] = (F.silu(out) if self.activation else out).T
            finals.append(torch.cat([torch.zeros(D, 1, dtype=x.dtype), window], 1)[:, -W:])
        final = torch.stack(finals)
        if cache is not None:
            cache.copy_(final)  # FLA updates a given cache in place
        return y, (final if output_final_state else None)


class FusedRMSNormGated(torch.nn.Module):
    def __init__(self, hidden_size, activation="sigmoid", eps=1e-5, **kw):
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(torch.ones(hidden_size)), eps

    def forward(self, x, g):
        xf = x.double()
        y = xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + self.eps) * self.weight.double() * torch.sigmoid(g.double())
        return y.to(x.dtype)


def kda(q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, output_final_state=False,
        use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
        allow_neg_eigval=False, lower_bound=None, state_v_first=False, cu_seqlens=None, safe_gate=False, **kw):
    params = {"qk_l2norm": use_qk_l2norm_in_kernel, "gate": ("lower_bound" if lower_bound is not None else "softplus")
              if use_gate_in_kernel else "log_decay", "lower_bound": lower_bound,
              "beta": ("two_sigmoid" if allow_neg_eigval else "sigmoid") if use_beta_sigmoid_in_kernel else "as_given",
              "state_layout": "v_first" if state_v_first else "k_first"}
    inputs = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "A_log": A_log, "dt_bias": dt_bias,
              "initial_state": initial_state, "cu_seqlens": cu_seqlens}
    o, final = torch_model.kda_forward({n: t for n, t in inputs.items() if t is not None}, params)
    return o.to(q.dtype), (final.float() if output_final_state else None)


def fused_kda_gate(g, A_log=None, dt_bias=None, lower_bound=None, output_dtype=torch.float32):
    """The log gate [..., H, K] from raw g, as FLA's fused_kda_gate: torch_model's gate stage."""
    params = {"gate": "lower_bound" if lower_bound is not None else "softplus", "lower_bound": lower_bound}
    zeros = torch.zeros_like(g)
    inputs = {"q": zeros, "k": zeros, "v": zeros, "g": g, "beta": zeros[..., 0], "A_log": A_log, "dt_bias": dt_bias}
    _, _, _, decay, _ = torch_model.prepare({n: t for n, t in inputs.items() if t is not None}, params)
    return torch.log(decay).to(output_dtype)
