"""Checks FLA's and torchtitan's `KimiDeltaAttention` layers against the `kda_layer` goldens
and against themselves (docs/kda-layer.md, "Checking FLA's and torchtitan's layers").

    python3 -m k3ref.layer_check --layer fla|torchtitan|both [--fla-path DIR] [--torchtitan-path DIR]
                                 [--device cuda] [--checks golden,self,kcp] [--long]
                                 [--json OUT] [--measurement OUT]

Each layer is built from a golden's sizes and its weights loaded from the golden's tensors
(bf16 values, exact in bf16; A_log and dt_bias fp32), then:

- golden          every golden the layer can express, judged by k3ref's judge under the
                  goldens' policy `kda-layer` (8x the bf16 floor); the others are listed
                  with the option the layer lacks.
- isolation       documents packed with cu_seqlens == each document alone.
- mask_cu         an all-ones mask beside packed cu_seqlens == cu_seqlens alone (FLA's rule:
                  the mask is then not read); a padding mask == the rows' kept tokens packed.
- decode          prefill of a prefix, then one token per call through the cache == the
                  prefill of the whole (outputs and both final states).
- verify          a draft window in one call from a cache snapshot, then rollback to each
                  accepted prefix (the snapshot, then the accepted tokens) == decoding the
                  accepted tokens one at a time.
- rows            one batch row's entering states changed: every other row's outputs and
                  states unchanged, bit for bit (the cache rows are the layer's pool).
- kcp             torchtitan's KCP path on 2 ranks (NCCL with 2 GPUs, else gloo) == its
                  forward on the whole sequence.

Precision policies, each with its reason:
- a golden: `kda-layer` (the goldens' recommendation, docs/kda-layer.md);
- two runs of the same layer that may round differently (different GEMM shapes, kernels or
  splits): relative RMS difference within 2 x 8 = 16 bf16 floors of the second run: each run is
  allowed 8 floors from the exact layer, and the difference of the two is bounded by the sum;
  a real defect (a document boundary crossed: max abs error 0.92 in the published case) is
  O(1), hundreds of floors;
- the same kernels on the same values (mask not read; another row changed): == (no rounding
  differs, so any difference is a defect).
What a layer's API does not expose is reported "not applicable: <reason>".
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

GOLDEN_POLICY = "kda-layer"
PAIR_FLOORS = 16.0  # 2 x the kda-layer multiple: see the module docstring


def _one_line(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}"


# ---------------------------------------------------------------- figures

def floor_ratio(a: Any, b: Any) -> dict[str, Any]:
    """Relative RMS of a - b over b's nominal bf16 floor and whether the one judge's agreement
    rule passes them (check::judge_agreement, PAIR_FLOORS floors), and whether a == b bit for bit."""
    import numpy as np

    from . import policy
    a64 = np.asarray(a.detach().double().cpu() if hasattr(a, "detach") else a, dtype=np.float64)
    b64 = np.asarray(b.detach().double().cpu() if hasattr(b, "detach") else b, dtype=np.float64)
    if a64.shape != b64.shape:  # e.g. one state where there are three documents: a defect, not an error
        return {"rel_rms": math.inf, "floors": math.inf, "bitwise": False, "agrees": False,
                "shapes": [list(a64.shape), list(b64.shape)]}
    m = policy.measure(a64, b64, "fp64")
    v = policy.judge_agreement(m["rel_rms"], m["first_nonfinite_mismatch"], policy.nominal_floor(b64, "bf16"), 0.0,
                               PAIR_FLOORS)
    return {"rel_rms": m["rel_rms"], "floors": v["ratio"],
            "bitwise": bool(np.array_equal(a64, b64)), "agrees": v["passed"]}


def pair_verdict(pairs: dict[str, tuple[Any, Any]], exact: bool = False) -> dict[str, Any]:
    figs = {n: floor_ratio(a, b) for n, (a, b) in pairs.items()}
    worst = max((f["floors"] for f in figs.values()), default=0.0)
    ok = all(f["bitwise"] for f in figs.values()) if exact else all(f["agrees"] for f in figs.values())
    return {"passed": ok, "policy": "==" if exact else f"rel RMS <= {PAIR_FLOORS:g} bf16 floors",
            "worst_floors": worst, "bitwise": all(f["bitwise"] for f in figs.values()), "tensors": figs}


# ---------------------------------------------------------------- weights

def random_weights(p: dict[str, Any], seed: int, torch: Any) -> dict[str, Any]:
    """Weights of a layer of sizes p, drawn as the goldens draw theirs (bf16 values, fan-in
    scaled; A_log, dt_bias fp32), named as the goldens name them."""
    g = torch.Generator().manual_seed(seed)
    D, H, HV, K, V, W = (p[n] for n in ("D", "H", "HV", "K", "V", "conv_size"))

    def lin(o: int, i: int) -> Any:
        return ((torch.rand(o, i, generator=g, dtype=torch.float64) * 2 - 1) / math.sqrt(i)).to(torch.bfloat16).double()

    t = {"q_proj": lin(H * K, D), "k_proj": lin(H * K, D), "v_proj": lin(HV * V, D), "f_a": lin(V, D), "f_b": lin(HV * K, V),
         "b_proj": lin(HV, D), "g_a": lin(V, D), "g_b": lin(HV * V, V), "o_proj": lin(D, HV * V),
         "A_log": (torch.rand(HV, generator=g) * 2 - 1).float(), "dt_bias": (torch.rand(HV * K, generator=g) - 0.5).float(),
         "norm_weight": (1 + 0.25 * (torch.rand(V, generator=g, dtype=torch.float64) * 2 - 1)).to(torch.bfloat16).double()}
    if p.get("g_bias"):
        t["g_bias"] = lin(1, HV * V)[0]
    for n, c in (("q", H * K), ("k", H * K), ("v", HV * V)):
        if W:
            t[f"{n}_conv"] = lin(c, W)
    return t


def hidden(shape: tuple[int, ...], seed: int, torch: Any) -> Any:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(*shape, generator=g, dtype=torch.float64) * 2 - 1).to(torch.bfloat16)


# ---------------------------------------------------------------- adapters

class _Cache:
    """The three calls FLA's layers make on `past_key_values` (len, [layer_idx], update):
    one layer's recurrent and conv states, as given and as the layer leaves them."""

    def __init__(self, state: dict[str, Any] | None = None) -> None:
        self.layers: list[dict[str, Any]] = [state] if state is not None else []

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.layers[i]

    def update(self, layer_idx: int, offset: int = 0, **state: Any) -> dict[str, Any]:
        if layer_idx == len(self.layers):
            self.layers.append({})
        self.layers[layer_idx].update(state)
        return self.layers[layer_idx]


class _Adapter:
    """What both adapters share: the layer's source (a class or module), device and dtype,
    the options check and the weight loading."""

    def __init__(self, source: Any, device: str, dtype: Any) -> None:
        self.source, self.device, self.dtype = source, device, dtype

    @staticmethod
    def _lacks(p: dict[str, Any], need: dict[str, Any], who: str) -> str | None:
        for k, v in need.items():
            if p.get(k) != v:
                return f"{k} = {p.get(k)!r}: {who} has {k} = {v!r}"
        return None

    def _load(self, layer: Any, sets: dict[str, Any], t: dict[str, Any], p: dict[str, Any]) -> Any:
        import torch
        params = dict(layer.named_parameters())
        with torch.no_grad():
            for n, v in sets.items():
                params[n].copy_(torch.as_tensor(v).to(params[n].dtype))
        # A_log and dt_bias stay fp32, as the goldens (and both layers' initialisations) hold them.
        layer.A_log.data = torch.as_tensor(t["A_log"], dtype=torch.float32, device=self.device).clone()
        layer.dt_bias.data = torch.as_tensor(t["dt_bias"], dtype=torch.float32, device=self.device).clone()
        layer.k3ref_sizes = p
        return layer


class FLALayer(_Adapter):
    """fla.layers.kda.KimiDeltaAttention. States cross the adapter K-first, conv windows as
    [N, C, W - 1] (q, k, v channels); FLA keeps V-first states and one [N, c, W] conv cache
    per projection, whose last W - 1 columns are the window."""

    name = "fla"
    has_cache = True

    @staticmethod
    def expresses(p: dict[str, Any]) -> str | None:
        need = {"f_rank": p["V"], "g_rank": p["V"], "A_log": True, "dt_bias": True, "norm_weight": True,
                "output_norm": True, "activation": "silu", "qk_l2norm": True, "norm_eps": 1e-5}
        lacks = _Adapter._lacks(p, need, "FLA's layer")
        if lacks:
            return lacks
        if p["gate"] not in ("softplus", "lower_bound") or p["beta"] not in ("sigmoid", "two_sigmoid"):
            return f"gate {p['gate']!r} / beta {p['beta']!r}: FLA's layer computes softplus or lower_bound, sigmoid or 2 sigmoid"
        return None

    def build(self, t: dict[str, Any], p: dict[str, Any]) -> Any:
        import torch
        W = p["conv_size"]
        layer = self.source(hidden_size=p["D"], expand_v=p["V"] / p["K"], head_dim=p["K"], num_heads=p["H"],
                         num_v_heads=p["HV"], mode="chunk", use_short_conv=W > 0,
                         allow_neg_eigval=p["beta"] == "two_sigmoid",
                         lower_bound=p["lower_bound"] if p["gate"] == "lower_bound" else None,
                         conv_size=max(W, 1), conv_bias=bool(p.get("conv_bias")), layer_idx=0, norm_eps=p["norm_eps"])
        layer = layer.to(device=self.device, dtype=self.dtype).eval()
        sets = {"q_proj.weight": t["q_proj"], "k_proj.weight": t["k_proj"], "v_proj.weight": t["v_proj"],
                "b_proj.weight": t["b_proj"], "o_proj.weight": t["o_proj"], "f_proj.0.weight": t["f_a"],
                "f_proj.1.weight": t["f_b"], "g_proj.0.weight": t["g_a"], "g_proj.1.weight": t["g_b"],
                "o_norm.weight": t["norm_weight"]}
        for n in ("q", "k", "v"):
            if W:
                sets[f"{n}_conv1d.weight"] = torch.as_tensor(t[f"{n}_conv"])[:, None, :]
                if p.get("conv_bias"):
                    sets[f"{n}_conv1d.bias"] = t[f"{n}_conv_bias"]
        sets["g_proj.1.bias"] = t["g_bias"] if "g_bias" in t else torch.zeros(p["HV"] * p["V"])  # absent: zero, exact
        return self._load(layer, sets, t, p)

    def _split(self, layer: Any) -> list[int]:
        p = layer.k3ref_sizes
        return [p["H"] * p["K"], p["H"] * p["K"], p["HV"] * p["V"]]

    def prefill(self, layer: Any, x: Any, cu: Any = None, mask: Any = None, state: Any = None, conv: Any = None):
        """(y, final states K-first fp32 [N, HV, K, V], final conv windows [N, C, W - 1])."""
        import torch
        p = layer.k3ref_sizes
        W = p["conv_size"]
        cache = _Cache()
        if state is not None or conv is not None:
            n = (state if state is not None else conv).shape[0]
            if state is None:
                state = torch.zeros(n, p["HV"], p["K"], p["V"])
            entry = {"recurrent_state": torch.as_tensor(state).float().transpose(-1, -2).contiguous().to(self.device)}
            if W:
                if conv is None:
                    conv = torch.zeros(n, sum(self._split(layer)), W - 1)
                conv = torch.as_tensor(conv).to(self.device, self.dtype)
                pad = torch.zeros(n, conv.shape[1], 1, dtype=self.dtype, device=self.device)
                full = torch.cat([pad, conv], -1)
                entry["conv_state"] = tuple(c.contiguous() for c in torch.split(full, self._split(layer), 1))
            cache = _Cache(entry)
        kw: dict[str, Any] = {}
        if cu is not None:
            kw["cu_seqlens"] = torch.as_tensor(cu, dtype=torch.int32, device=self.device)
        m = torch.as_tensor(mask, device=self.device) if mask is not None else None
        with torch.no_grad():
            y, _, cache = layer(torch.as_tensor(x).to(self.device, self.dtype), attention_mask=m, past_key_values=cache,
                                use_cache=True, **kw)
        st = cache[0]
        final = st["recurrent_state"].float().transpose(-1, -2).contiguous()
        fconv = (torch.cat([c[..., 1:] for c in st["conv_state"]], 1) if W else
                 torch.zeros(final.shape[0], sum(self._split(layer)), 0, device=self.device))
        return y, final, fconv


class TorchtitanLayer(_Adapter):
    """torchtitan.models.kimi_k3.model.KimiDeltaAttention: forward(x [B, T, D]) only; each
    row one document, no cache, no cu_seqlens, no mask (a training layer)."""

    name = "torchtitan"
    has_cache = False

    @staticmethod
    def expresses(p: dict[str, Any]) -> str | None:
        if p["H"] != p["HV"] or p["K"] != p["V"]:
            return "GVA or K != V: torchtitan's layer has H = HV and K = V = head_dim"
        need = {"f_rank": p["K"], "g_bias": False, "conv_bias": False, "A_log": True, "dt_bias": True,
                "norm_weight": True, "output_norm": True, "activation": "silu", "qk_l2norm": True, "beta": "sigmoid"}
        lacks = _Adapter._lacks(p, need, "torchtitan's layer")
        if lacks:
            return lacks
        if p["g_rank"] not in (0, p["K"]) or not p["conv_size"]:
            return "output gate rank or no short conv: torchtitan's layer has rank head_dim or full rank, and a short conv"
        if p.get("cu_seqlens") or p.get("attention_mask") or p.get("initial_state"):
            return "cu_seqlens, a mask or entering states: torchtitan's forward(x) takes none"
        return None

    @staticmethod
    def config_fields(p: dict[str, Any]) -> dict[str, Any]:
        """KimiK3Config's fields for a golden's sizes (the rest keep their defaults)."""
        return dict(hidden_size=p["D"], kda_num_heads=p["H"], kda_head_dim=p["K"], kda_short_conv_kernel_size=p["conv_size"],
                    kda_gate_lower_bound=p["lower_bound"] if p["gate"] == "lower_bound" else None,
                    kda_use_full_rank_gate=p["g_rank"] == 0, rms_norm_eps=p["norm_eps"], kda_cp_mode="kcp")

    @staticmethod
    def weights(t: dict[str, Any], p: dict[str, Any]) -> dict[str, Any]:
        """{parameter name: the golden's tensor} (the conv weights as [C, 1, W])."""
        import torch
        sets = {"q_proj.weight": t["q_proj"], "k_proj.weight": t["k_proj"], "v_proj.weight": t["v_proj"],
                "b_proj.weight": t["b_proj"], "o_proj.weight": t["o_proj"], "f_a_proj.weight": t["f_a"],
                "f_b_proj.weight": t["f_b"], "o_norm.weight": t["norm_weight"]}
        if p["g_rank"] == 0:
            sets["g_proj.weight"] = t["g_b"]
        else:
            sets.update({"g_a_proj.weight": t["g_a"], "g_b_proj.weight": t["g_b"]})
        for n in ("q", "k", "v"):
            sets[f"{n}_conv1d.weight"] = torch.as_tensor(t[f"{n}_conv"])[:, None, :]
        return sets

    def build(self, t: dict[str, Any], p: dict[str, Any]) -> Any:
        import dataclasses
        model = self.source
        known = {f.name for f in dataclasses.fields(model.KimiK3Config)}
        config = model.KimiK3Config(**{k: v for k, v in self.config_fields(p).items() if k in known})
        layer = model.KimiDeltaAttention(model.KimiDeltaAttention.make_config(config, layer_idx=0))
        layer = layer.to(device=self.device, dtype=self.dtype).eval()
        return self._load(layer, self.weights(t, p), t, p)

    def forward(self, layer: Any, x: Any) -> Any:
        import torch
        with torch.no_grad():
            return layer(torch.as_tensor(x).to(self.device, self.dtype))


# ---------------------------------------------------------------- golden checks

def _pool_read(pool: Any, geom: list[int], s: int, p: dict[str, Any]) -> Any:
    slots, stride, offset, v_first = geom
    HV, K, V = p["HV"], p["K"], p["V"]
    block = pool[offset + s * stride: offset + s * stride + HV * K * V]
    return block.reshape(HV, V, K).transpose(-1, -2) if v_first else block.reshape(HV, K, V)


def _pool_write(pool: Any, geom: list[int], s: int, p: dict[str, Any], state: Any) -> None:
    slots, stride, offset, v_first = geom
    pool[offset + s * stride: offset + s * stride + state.numel()] = (state.transpose(-1, -2) if v_first else state).reshape(-1)


def golden_candidate(adapter: Any, case: Any) -> tuple[dict[str, Any], list[str] | None, str | None]:
    """(candidate outputs, the outputs judged or None for all, why some are not judged)."""
    import torch
    t, p, op = case.tensors, case.params, case.op
    layer = adapter.build(t, p)
    if isinstance(adapter, TorchtitanLayer):
        return {"y": adapter.forward(layer, t["hidden_states"])}, ["y"], "final states: torchtitan's forward returns none"
    if op == "layer.kda":
        y, final, conv = adapter.prefill(layer, t["hidden_states"], t.get("cu_seqlens"), t.get("attention_mask"),
                                         t.get("initial_state"), t.get("initial_conv_state"))
        return {"y": y, "final_state": final, "final_conv_state": conv}, None, None
    # Decode / verify over the goldens' pools: FLA's layer has a per-row cache and no pool, so
    # the adapter gathers each live sequence's slot into a cache row and scatters it back.
    geom = [int(g) for g in t["pool_geometry"]]
    pool, conv_pool = t["pool"].double().clone(), t["conv_pool"].double().clone()
    cu = [int(c) for c in t["cu_seqlens"]]
    x = t["hidden_states"]
    if op == "layer.kda_decode":
        enter = [int(s) for s in t["slot_of_sequence"]]
    else:
        idx, acc = t["state_indices"].long(), [int(a) for a in t["num_accepted"]]
        enter = [int(idx[n, acc[n] - 1]) if cu[n + 1] > cu[n] else -1 for n in range(len(cu) - 1)]
    live = [n for n in range(len(cu) - 1) if cu[n + 1] > cu[n] and enter[n] != -1]
    y = torch.zeros(x.shape[0], p["D"], dtype=torch.float64)
    if live:
        rows = torch.cat([torch.arange(cu[n], cu[n + 1]) for n in live])
        lens = [cu[n + 1] - cu[n] for n in live]
        sub_cu = [0]
        for n in lens:
            sub_cu.append(sub_cu[-1] + n)
        S = torch.stack([_pool_read(pool, geom, enter[n], p) for n in live])
        C = torch.stack([conv_pool[enter[n]] for n in live])
        yl, final, fconv = adapter.prefill(layer, x[rows][None], sub_cu, None, S, C)
        y[rows] = yl[0].double().cpu()
        if op == "layer.kda_decode":
            for j, n in enumerate(live):
                _pool_write(pool, geom, enter[n], p, final[j].double().cpu())
                conv_pool[enter[n]] = fconv[j].double().cpu()
    if op == "layer.kda_decode":
        return {"y": y, "pool_out": pool, "conv_pool_out": conv_pool}, None, None
    return {"y": y}, ["y"], "state tapes and in-place columns: FLA's layer returns one final state per call"


def check_goldens(adapter: Any, golden_dir: str) -> list[dict[str, Any]]:
    from . import goldens, policy
    rows = []
    for name in goldens.case_names(golden_dir, ops={"layer.kda", "layer.kda_decode", "layer.kda_verify"}):
        case = goldens.load_case(name, golden_dir)
        row: dict[str, Any] = {"layer": adapter.name, "check": "golden", "case": name}
        why = adapter.expresses(case.params)
        if why is None and case.op != "layer.kda" and not adapter.has_cache:
            why = "decode and verify: torchtitan's layer has no cache"
        if why:
            rows.append({**row, "status": "not applicable", "reason": why})
            continue
        try:
            start = time.perf_counter()
            cand, judged, note = golden_candidate(adapter, case)
            v = policy.judge(case.expected, {n: c.detach().double().cpu() for n, c in cand.items()}, case.op,
                             GOLDEN_POLICY, tensors=judged, known=list(case.tensors))
            row.update({"status": "pass" if v.exit_code == 0 else "fail", "seconds": time.perf_counter() - start,
                        "reason": v.reason, "policy": GOLDEN_POLICY,
                        "ratios": {r.tensor: r.ratio for r in v.results if r.ratio is not None}})
            if note:
                row["not_judged"] = note
        except Exception as e:
            row.update({"status": "error", "reason": _one_line(e)})
        rows.append(row)
    return rows


# ---------------------------------------------------------------- self-consistency checks

def _sizes() -> dict[str, Any]:
    """The layer of the self-consistency checks: FLA's defaults with GVA and K3's gate, at
    sizes its kernels accept (K = V = 64: chunk mode needs K >= 16)."""
    return {"D": 128, "H": 2, "HV": 4, "K": 64, "V": 64, "conv_size": 4, "conv_bias": False, "f_rank": 64, "g_rank": 64,
            "g_bias": True, "A_log": True, "dt_bias": True, "norm_weight": True, "output_norm": True, "gate": "lower_bound",
            "lower_bound": -5.0, "beta": "sigmoid", "qk_l2norm": True, "activation": "silu", "norm_eps": 1e-5}


def _run(rows: list[dict[str, Any]], layer_name: str, check: str, fn: Callable[[], dict[str, Any]]) -> None:
    row: dict[str, Any] = {"layer": layer_name, "check": check}
    try:
        start = time.perf_counter()
        out = fn()
        row.update(out)
        if "passed" in out:
            row["status"] = "pass" if out.pop("passed") else "fail"
        row["seconds"] = time.perf_counter() - start
    except Exception as e:
        row.update({"status": "error", "reason": _one_line(e), "trace": traceback.format_exc(limit=3).splitlines()[-3:]})
    rows.append(row)


def _row(layer_name: str, check: str, fn: Callable[[], dict[str, Any]]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    _run(rows, layer_name, check, fn)
    return rows


def _na(rows: list[dict[str, Any]], layer_name: str, check: str, reason: str) -> None:
    rows.append({"layer": layer_name, "check": check, "status": "not applicable", "reason": reason})


# Documents of the self-consistency checks: 51 tokens in all, so FLA's layer (chunk mode only
# above 64 tokens in a call) runs fused_recurrent throughout and the device run autotunes no
# chunk kernel (40-160 s per new shape); --long takes 128 (the 90-token document and the
# packed batch in chunk mode, the decode against a chunked prefill).
SHORT_DOCUMENTS, LONG_DOCUMENTS = (20, 1, 30), (37, 1, 90)


def fla_self_checks(a: FLALayer, lengths: tuple[int, ...] = SHORT_DOCUMENTS) -> list[dict[str, Any]]:
    import torch
    p = _sizes()
    layer = a.build(random_weights(p, 7, torch), p)
    D = p["D"]
    total = sum(lengths)
    x = hidden((1, total, D), 8, torch)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    rows: list[dict[str, Any]] = []

    def isolation() -> dict[str, Any]:
        y, S, C = a.prefill(layer, x, cu)
        pairs = {}
        for n in range(len(lengths)):
            yn, Sn, Cn = a.prefill(layer, x[:, cu[n]:cu[n + 1]])
            pairs.update({f"y[{n}]": (y[0, cu[n]:cu[n + 1]], yn[0]), f"state[{n}]": (S[n], Sn[0]), f"conv[{n}]": (C[n], Cn[0])})
        return {**pair_verdict(pairs), "documents": list(lengths)}

    def mask_cu() -> dict[str, Any]:
        y, S, C = a.prefill(layer, x, cu)
        ym, Sm, Cm = a.prefill(layer, x, cu, mask=torch.ones(1, total, dtype=torch.long))
        exact = pair_verdict({"y": (ym, y), "state": (Sm, S), "conv": (Cm, C)}, exact=True)
        # A padding mask: rows of the first two documents, right-padded, against them packed.
        T = max(lengths[0], lengths[2])
        xs = torch.zeros(2, T, D, dtype=x.dtype)
        mask = torch.zeros(2, T, dtype=torch.long)
        for r, n in enumerate((0, 2)):
            xs[r, :lengths[n]] = x[0, cu[n]:cu[n + 1]]
            mask[r, :lengths[n]] = 1
        yp, Sp, Cp = a.prefill(layer, xs, mask=mask)
        pad = pair_verdict({"y[0]": (yp[0, :lengths[0]], y[0, cu[0]:cu[1]]), "y[1]": (yp[1, :lengths[2]], y[0, cu[2]:cu[3]]),
                            "state": (Sp, S[[0, 2]]), "padding_zero": (yp[0, lengths[0]:], torch.zeros_like(yp[0, lengths[0]:]))})
        return {"passed": exact["passed"] and pad["passed"], "all_ones_mask_with_cu": exact, "padding_mask": pad}

    def decode() -> dict[str, Any]:
        L, P = lengths[2], lengths[2] - 4
        xd = x[:, cu[2]:cu[3]]
        yw, Sw, Cw = a.prefill(layer, xd)
        _, S, C = a.prefill(layer, xd[:, :P])
        ys = []
        for j in range(P, L):
            yj, S, C = a.prefill(layer, xd[:, j:j + 1], state=S, conv=C)
            ys.append(yj)
        return pair_verdict({"y": (torch.cat(ys, 1), yw[:, P:]), "state": (S, Sw), "conv": (C, Cw)})

    def verify() -> dict[str, Any]:
        Lw = 4
        xd = x[:, cu[2]:cu[3]]
        P = xd.shape[1] - Lw
        _, S0, C0 = a.prefill(layer, xd[:, :P])
        window, _, _ = a.prefill(layer, xd[:, P:], state=S0, conv=C0)
        pairs = {}
        for acc in range(1, Lw + 1):
            _, Sr, Cr = a.prefill(layer, xd[:, P:P + acc], state=S0, conv=C0)  # rollback: snapshot + accepted
            S, C, ys = S0, C0, []
            for j in range(acc):
                yj, S, C = a.prefill(layer, xd[:, P + j:P + j + 1], state=S, conv=C)
                ys.append(yj)
            pairs.update({f"y[:{acc}]": (window[:, :acc], torch.cat(ys, 1)), f"state@{acc}": (Sr, S), f"conv@{acc}": (Cr, C)})
        return {**pair_verdict(pairs), "rollback": "re-run of the accepted prefix from the snapshot (no state tape)"}

    def rows_isolated() -> dict[str, Any]:
        N = 3
        xr = hidden((N, 1, D), 9, torch)
        g = torch.Generator().manual_seed(10)
        S = torch.rand(N, p["HV"], p["K"], p["V"], generator=g) * 0.2
        C = hidden((N, 2 * p["H"] * p["K"] + p["HV"] * p["V"], 3), 11, torch).float()
        y1, S1, C1 = a.prefill(layer, xr, state=S, conv=C)
        S2, C2 = S.clone(), C.clone()
        S2[1] += 0.5
        C2[1] = -C2[1]
        y2, S2o, C2o = a.prefill(layer, xr, state=S2, conv=C2)
        keep = [0, 2]
        v = pair_verdict({"y": (y2[keep], y1[keep]), "state": (S2o[keep], S1[keep]), "conv": (C2o[keep], C1[keep])}, exact=True)
        changed = not torch.equal(y2[1], y1[1])
        v["passed"] = v["passed"] and changed
        return {**v, "changed_row_differs": changed}

    _run(rows, a.name, "isolation", isolation)
    _run(rows, a.name, "mask_cu", mask_cu)
    _run(rows, a.name, "decode", decode)
    _run(rows, a.name, "verify", verify)
    _run(rows, a.name, "rows", rows_isolated)
    _na(rows, a.name, "pools", "FLA's layer has no slot pool: one cache row per sequence (the rows check); the "
        "decode goldens' pools are gathered and scattered by this adapter")
    return rows


def _torchtitan_layer(a: TorchtitanLayer) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    import torch
    p = _sizes()
    p.update(HV=p["H"], g_bias=False)
    t = random_weights(p, 7, torch)
    return a.build(t, p), t, p


def torchtitan_self_checks(a: TorchtitanLayer, T: int = 40) -> list[dict[str, Any]]:
    """T = 40: fused_recurrent (torchtitan's layer runs chunk mode above 64 tokens)."""
    import torch
    layer, t, p = _torchtitan_layer(a)
    rows: list[dict[str, Any]] = []

    def rows_isolated() -> dict[str, Any]:
        x = hidden((3, T, p["D"]), 12, torch)
        y1 = a.forward(layer, x)
        x2 = x.clone()
        x2[1] = -x2[1]
        y2 = a.forward(layer, x2)
        v = pair_verdict({"y": (y2[[0, 2]], y1[[0, 2]])}, exact=True)
        changed = not torch.equal(y2[1], y1[1])
        return {**v, "passed": v["passed"] and changed, "changed_row_differs": changed}

    _run(rows, a.name, "rows", rows_isolated)
    for check in ("isolation", "mask_cu"):
        _na(rows, a.name, check, "forward(x) takes no cu_seqlens or mask: each row is one document (its kcp.py "
            "says packed documents carry state across their boundaries)")
    for check in ("decode", "verify", "pools"):
        _na(rows, a.name, check, "forward(x) has no cache: a training layer")
    return rows


# ---------------------------------------------------------------- KCP over 2 ranks

def _gloo_accepts_stacked_all_gather(dist: Any) -> None:
    """FLA's CP exchange gathers into an output of shape (world, *input) (fla/ops/cp/comm.py);
    NCCL takes any output of world x the input's elements, gloo only the concatenation along
    the first axis, (world * n, ...), and raises on the stacked form. The two have the same
    memory, so a view of the output lets the KCP path run on gloo (one GPU, two ranks) with
    FLA's code unchanged."""
    gather = dist.all_gather_into_tensor

    def concatenated(out: Any, inp: Any, group: Any = None, async_op: bool = False) -> Any:
        if inp.dim() > 0 and out.dim() == inp.dim() + 1 and out.is_contiguous():
            out = out.view(-1, *inp.shape[1:])
        return gather(out, inp, group=group, async_op=async_op)

    dist.all_gather_into_tensor = concatenated


def _kcp_rank(rank: int, world: int, backend: str, device: str, model_path: str | None, t: dict[str, Any],
              p: dict[str, Any], x: Any, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dev = f"cuda:{rank % max(torch.cuda.device_count(), 1)}" if device.startswith("cuda") else "cpu"
    if dev.startswith("cuda"):
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, rank=rank, world_size=world)
    if backend == "gloo":
        _gloo_accepts_stacked_all_gather(dist)
    try:
        from .moe_check import import_model
        model, why = import_model(model_path)
        if model is None:
            raise RuntimeError(why)
        a = TorchtitanLayer(model, dev, torch.bfloat16)
        layer = a.build(t, p)
        layer._cp_group = dist.group.WORLD
        T = x.shape[1]
        shard = x[:, rank * T // world:(rank + 1) * T // world]
        y = a.forward(layer, shard)
        torch.save(y.cpu(), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def kcp_check(a: TorchtitanLayer, model_path: str | None, world: int = 2, T: int = 256) -> dict[str, Any]:
    """The whole sequence (chunk mode: T > 64) against KCP's shards, T / world tokens each."""
    import tempfile

    import torch
    import torch.multiprocessing as mp
    layer, t, p = _torchtitan_layer(a)
    x = hidden((1, T, p["D"]), 13, torch)
    whole = a.forward(layer, x)
    backend = "nccl" if a.device.startswith("cuda") and torch.cuda.device_count() >= world else "gloo"
    os.environ["MASTER_PORT"] = str(29500 + os.getpid() % 1000)
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_kcp_rank, args=(world, backend, a.device, model_path, t, p, x, d),
                           nprocs=world, join=True, start_method="spawn")
        y = torch.cat([torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(world)], 1)
    return {**pair_verdict({"y": (y, whole)}), "backend": backend, "ranks": world, "T": T}


# ---------------------------------------------------------------- loading

def import_fla(path: str | None) -> tuple[Any, str | None]:
    if path:
        sys.path.insert(0, str(Path(path).resolve()))
    try:
        return importlib.import_module("fla.layers.kda").KimiDeltaAttention, None
    except Exception as e:
        return None, _one_line(e)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m k3ref.layer_check", description=__doc__.splitlines()[0])
    ap.add_argument("--layer", choices=("fla", "torchtitan", "both"), default="both")
    ap.add_argument("--fla-path", default=os.environ.get("K3REF_FLA_PATH"))
    ap.add_argument("--torchtitan-path", default=os.environ.get("K3REF_TORCHTITAN_PATH"))
    ap.add_argument("--golden-dir", default=os.environ.get("K3REF_GOLDENS", str(Path(__file__).resolve().parents[2] / "goldens")))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--checks", default="golden,self", help="of golden, self, kcp (torchtitan's KCP path on 2 ranks)")
    ap.add_argument("--long", action="store_true", help="the FLA self-checks on 128 tokens (chunk mode) instead of 51")
    ap.add_argument("--json", help="write the rows as JSON to this file (rewritten after each stage)")
    ap.add_argument("--measurement", help="write a measurements/ file (tools/render_measurements.py) to this path")
    args = ap.parse_args(argv)
    import torch
    if args.torchtitan_path:  # the spawned ranks import the model from it
        args.torchtitan_path = str(Path(args.torchtitan_path).resolve())
    rows: list[dict[str, Any]] = []
    adapters: list[Any] = []
    from .moe_check import import_model
    for name, cls, load, path in (("fla", FLALayer, import_fla, args.fla_path),
                                  ("torchtitan", TorchtitanLayer, import_model, args.torchtitan_path)):
        if args.layer in (name, "both"):
            source, why = load(path)
            if source is None:
                rows.append({"layer": name, "check": "import", "status": "error", "reason": why})
            else:
                adapters.append(cls(source, args.device, torch.bfloat16))
    checks = set(args.checks.split(","))
    if checks - {"golden", "self", "kcp"}:
        ap.error(f"--checks: unknown {sorted(checks - {'golden', 'self', 'kcp'})}")
    command = "python3 -m k3ref.layer_check " + " ".join(argv if argv is not None else sys.argv[1:])
    save(rows, args, command)
    for a in adapters:
        stages: list[tuple[str, Callable[[], list[dict[str, Any]]]]] = []
        if "golden" in checks:
            stages.append(("golden", lambda: check_goldens(a, args.golden_dir)))
        if "self" in checks:
            stages.append(("self", lambda: fla_self_checks(a, LONG_DOCUMENTS if args.long else SHORT_DOCUMENTS)
                           if isinstance(a, FLALayer) else torchtitan_self_checks(a)))
        if "kcp" in checks and isinstance(a, TorchtitanLayer):
            stages.append(("kcp", lambda: _row(a.name, "kcp", lambda: kcp_check(a, args.torchtitan_path))))
        for stage, run in stages:
            try:
                new = run()
            except Exception as e:  # the layer could not be built at the checks' sizes
                new = [{"layer": a.name, "check": stage, "status": "error", "reason": _one_line(e)}]
            for r in new:
                print(json.dumps(r, default=str), flush=True)
            rows += new
            save(rows, args, command)
    print(summary(rows))
    bad = [r for r in rows if r.get("status") in ("fail", "error")]
    return 1 if bad else 0


def save(rows: list[dict[str, Any]], args: Any, command: str) -> None:
    """The rows so far to --json and --measurement (a run cut short keeps what it checked)."""
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str) + "\n")
    if args.measurement:
        from . import measurement
        m = measurement.record(Path(args.measurement).stem, "FLA's and torchtitan's KimiDeltaAttention layers: goldens and "
                               "self-consistency checks", {"layers": measurement_table(rows)}, commands=[command])
        measurement.write(m, args.measurement)


def _cell(r: dict[str, Any]) -> str:
    if r.get("status") == "not applicable":
        return f"not applicable: {r['reason']}"
    if r.get("status") == "error":
        return f"error: {r['reason']}"
    if "ratios" in r:
        return r["status"] + " (" + ", ".join(f"{n} {v:.2g}x" for n, v in r["ratios"].items()) + ")"
    if "all_ones_mask_with_cu" in r:
        ones, pad = r["all_ones_mask_with_cu"], r["padding_mask"]
        return (f"{r['status']} (all-ones mask with cu_seqlens: {'==' if ones['bitwise'] else 'differs'}; padding mask: "
                f"worst {pad['worst_floors']:.3g} floors of 16)")
    if "worst_floors" in r:
        return f"{r['status']} ({r['policy']}; worst {r['worst_floors']:.3g} floors{', bitwise' if r.get('bitwise') else ''})"
    return str(r.get("status"))


def measurement_table(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"caption": "Per layer and check: the verdict and the figure (golden: each output's error in bf16 floors, "
                       "policy kda-layer, 8x; pairs of runs: relative RMS difference in bf16 floors, bound 16, or ==):",
            "columns": [{"key": "layer", "title": "layer"}, {"key": "check", "title": "check"},
                        {"key": "case", "title": "golden"}, {"key": "result", "title": "result"}],
            "rows": [{"layer": r["layer"], "check": r["check"], "case": f"`{r['case']}`" if r.get("case") else None,
                      "result": _cell(r)} for r in rows]}


def summary(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'layer':<11} {'check':<10} {'golden':<42} result"]
    for r in rows:
        lines.append(f"{r['layer']:<11} {r['check']:<10} {r.get('case', '') or '':<42} {_cell(r)[:110]}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
