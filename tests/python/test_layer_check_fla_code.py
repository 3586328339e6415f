"""k3ref.layer_check on FLA's own layer code on the CPU: fla/layers/kda.py and
fla/layers/utils.py of the FLA checkout ($K3REF_FLA_PATH, default .thirdparty/fla_pkg; skipped
without it or without einops), loaded as they are, with PyTorch stand-ins for the four Triton
pieces they call (ShortConvolution, FusedRMSNormGated, chunk_kda / fused_recurrent_kda, the
mask-to-cu_seqlens helpers). The recurrence stand-in is gpu_check's PyTorch KDA kernel
(torch_model.py); the convolution keeps FLA's documented cache, the last W inputs per row.
This checks the adapter against FLA's real glue: its parameter names and shapes, its cache
calls, the unpadding of masks, the rule that explicit cu_seqlens win, GVA, the decode step."""
import importlib.util
import os
import sys
import types
from pathlib import Path

import pytest

from conftest import GOLDENS, ROOT, needs_core

torch = pytest.importorskip("torch")
FLA = Path(os.environ.get("K3REF_FLA_PATH", ROOT / ".thirdparty" / "fla_pkg")) / "fla"
if not (FLA / "layers" / "kda.py").exists():
    pytest.skip(f"no FLA checkout at {FLA.parent}", allow_module_level=True)
if importlib.util.find_spec("einops") is None:
    pydeps = ROOT / ".thirdparty" / "pydeps"
    if (pydeps / "einops").exists():
        sys.path.append(str(pydeps))
    pytest.importorskip("einops")

import torch.nn.functional as F  # noqa: E402

from k3ref import layer_check  # noqa: E402
from k3ref.gpu_check import torch_model  # noqa: E402


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


def _tensor_cache(fn):
    return fn


@pytest.fixture(scope="module")
def fla_layer_class():
    """FLA's KimiDeltaAttention class, its own code, over the stand-ins (sys.modules restored after)."""
    saved = {n: m for n, m in sys.modules.items() if n == "fla" or n.startswith("fla.")}
    for n in saved:
        del sys.modules[n]
    made = {}
    for name in ("fla", "fla.layers", "fla.modules", "fla.ops", "fla.ops.kda", "fla.ops.utils", "fla.ops.utils.index", "fla.utils"):
        made[name] = sys.modules[name] = types.ModuleType(name)
        made[name].__path__ = []
    made["fla.modules"].ShortConvolution, made["fla.modules"].FusedRMSNormGated = ShortConvolution, FusedRMSNormGated
    made["fla.ops.kda"].chunk_kda = made["fla.ops.kda"].fused_recurrent_kda = kda
    made["fla.utils"].tensor_cache = _tensor_cache
    idx = made["fla.ops.utils.index"]
    idx.prepare_lens_from_mask = lambda mask: mask.sum(dim=-1, dtype=torch.int32)
    idx.prepare_cu_seqlens_from_mask = lambda mask, dtype=torch.int32: F.pad(mask.sum(-1).cumsum(0, dtype=dtype), (1, 0))
    for name in ("utils", "kda"):
        spec = importlib.util.spec_from_file_location(f"fla.layers.{name}", FLA / "layers" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[f"fla.layers.{name}"] = mod
        spec.loader.exec_module(mod)
    yield sys.modules["fla.layers.kda"].KimiDeltaAttention
    for n in [n for n in sys.modules if n == "fla" or n.startswith("fla.")]:
        del sys.modules[n]
    sys.modules.update(saved)


@needs_core
def test_fla_layer_code_passes_the_goldens_it_expresses(fla_layer_class):
    a = layer_check.FLALayer(fla_layer_class, "cpu", torch.float64)
    rows = layer_check.check_goldens(a, str(GOLDENS))
    judged = [r for r in rows if r["status"] != "not applicable"]
    assert len(judged) == 9, rows
    assert all(r["status"] == "pass" for r in judged), [r for r in judged if r["status"] != "pass"]


@needs_core
def test_fla_layer_code_passes_the_self_checks(fla_layer_class):
    a = layer_check.FLALayer(fla_layer_class, "cpu", torch.float64)
    rows = layer_check.fla_self_checks(a, lengths=(9, 1, 12))
    assert {r["check"]: r["status"] for r in rows} == {"isolation": "pass", "mask_cu": "pass", "decode": "pass",
                                                       "verify": "pass", "rows": "pass", "pools": "not applicable"}, rows
