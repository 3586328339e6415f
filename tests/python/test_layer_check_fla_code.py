"""k3ref.layer_check on FLA's and torchtitan's own layer code on the CPU: fla/layers/kda.py and
fla/layers/utils.py of the FLA checkout ($K3REF_FLA_PATH, default .thirdparty/fla_pkg; skipped
without it or without einops), loaded as they are, with PyTorch stand-ins for the four Triton
pieces they call (ShortConvolution, FusedRMSNormGated, chunk_kda / fused_recurrent_kda, the
mask-to-cu_seqlens helpers). The recurrence stand-in is gpu_check's PyTorch KDA kernel
(torch_model.py); the convolution keeps FLA's documented cache, the last W inputs per row.
This checks the adapter against FLA's real glue: its parameter names and shapes, its cache
calls, the unpadding of masks, the rule that explicit cu_seqlens win, GVA, the decode step.
torchtitan's KimiK3Config and KimiDeltaAttention are executed from kimi_k3/model.py's source
($K3REF_TORCHTITAN_PATH, default .thirdparty/torchtitan) over the same stand-ins: its
make_config, parameter names, gate and beta (see the fixture)."""
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
pytest.importorskip("einops")  # or the checkout's .thirdparty/pydeps (conftest.py)

import torch.nn.functional as F  # noqa: E402
from fla_standins import FusedRMSNormGated, ShortConvolution, kda  # noqa: E402

from k3ref import layer_check  # noqa: E402


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


# ---- torchtitan's KimiDeltaAttention, its own class, over the same stand-ins

TORCHTITAN = Path(os.environ.get("K3REF_TORCHTITAN_PATH", ROOT / ".thirdparty" / "torchtitan")) / "torchtitan"


@pytest.fixture(scope="module")
def torchtitan_model():
    """torchtitan's KimiK3Config and KimiDeltaAttention, executed from kimi_k3/model.py's source
    (the package imports torch >= 2 modules this torch lacks), beside its Configurable base
    (config/configurable.py, loaded as a file) and minimal stand-ins for the names they read:
    its Module and Linear bases, the sharding declarations (no-ops without a mesh) and the FLA
    pieces (fla_standins)."""
    import ast
    import contextlib
    import dataclasses
    from typing import Any

    import einops
    import fla_standins
    src = TORCHTITAN / "models" / "kimi_k3" / "model.py"
    if not src.exists():
        pytest.skip(f"no torchtitan checkout ({TORCHTITAN.parent})")
    saved = {n: sys.modules.get(n) for n in ("torchtitan", "torchtitan.observability")}
    for name in saved:
        sys.modules[name] = types.ModuleType(name)
    sys.modules["torchtitan.observability"].structured_logger = types.SimpleNamespace(
        log_trace_span=lambda name: contextlib.nullcontext())
    spec = importlib.util.spec_from_file_location("k3ref_tt_configurable", TORCHTITAN / "config" / "configurable.py")
    configurable = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(configurable)
    Configurable = configurable.Configurable

    class Module(torch.nn.Module, Configurable):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(Configurable.Config):
            param_init: Any = None
            sharding_config: Any = None

    class Linear(torch.nn.Linear, Module):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(Module.Config):
            in_features: int
            out_features: int
            bias: bool = False

        def __init__(self, config):
            super().__init__(config.in_features, config.out_features, bias=config.bias)

    ns = {"torch": torch, "nn": torch.nn, "F": F, "dist": torch.distributed, "dataclass": dataclasses.dataclass,
          "field": dataclasses.field, "Literal": __import__("typing").Literal, "rearrange": einops.rearrange,
          "Module": Module, "Linear": Linear, "DTensor": type("DTensor", (), {}),
          "ShardingConfig": lambda **kw: None, "dense_param_placement": lambda **kw: None,
          "spmd": types.SimpleNamespace(R="R"), "_tp_replicate": lambda: None, "contract_for_mode": lambda mode: None,
          "ShortConvolution": fla_standins.ShortConvolution, "FusedRMSNormGated": fla_standins.FusedRMSNormGated,
          "chunk_kda": fla_standins.kda, "fused_recurrent_kda": fla_standins.kda,
          "fused_kda_gate": fla_standins.fused_kda_gate}
    text = src.read_text()
    tree = ast.parse(text)
    lines = text.splitlines()
    wanted = ("KimiK3Config", "_to_local_if_dtensor", "_local_linear", "KimiDeltaAttention")
    for node in tree.body:
        if getattr(node, "name", None) in wanted:
            start = min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno])
            code = "from __future__ import annotations\n" + "\n".join(lines[start - 1:node.end_lineno])
            exec(compile(code, str(src), "exec"), ns)  # noqa: S102  (torchtitan's own source, as a test double's body)
    yield types.SimpleNamespace(KimiK3Config=ns["KimiK3Config"], KimiDeltaAttention=ns["KimiDeltaAttention"])
    for name, mod in saved.items():
        if mod is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = mod


@needs_core
def test_torchtitan_layer_code_passes_its_golden_and_the_row_check(torchtitan_model):
    a = layer_check.TorchtitanLayer(torchtitan_model, "cpu", torch.float64)
    rows = layer_check.check_goldens(a, str(GOLDENS))
    judged = [r for r in rows if r["status"] != "not applicable"]
    assert [r["case"] for r in judged] == ["kda_layer_torchtitan_b2"], rows
    # float64 but for torchtitan's fp32 gate and beta (fused_kda_gate's output, .float().sigmoid()):
    # 2^-24 / 2^-9 = 2^-15 of a bf16 floor (measured 1.99e-5; bound 2^-14).
    assert judged[0]["status"] == "pass" and judged[0]["ratios"]["y"] < 2**-14, judged
    by = {r["check"]: r for r in layer_check.torchtitan_self_checks(a)}
    assert by["rows"]["status"] == "pass" and by["rows"]["changed_row_differs"], by["rows"]
    assert {by[c]["status"] for c in ("isolation", "mask_cu", "decode", "verify", "pools")} == {"not applicable"}
