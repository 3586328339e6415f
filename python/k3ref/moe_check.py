"""Checks torchtitan's latent MoE layer (`KimiMoE` with `KimiLatentMoEProjection`,
torchtitan/models/kimi_k3/model.py) against the `moe.latent` goldens (docs/latent-moe.md).

    python3 -m k3ref.moe_check --torchtitan-path CHECKOUT [--device cpu] [--golden-dir DIR] [--json OUT]

For every golden the layer can express (its router reads sigmoid(W_r x), it has no capacity):
the layer is built from a `KimiK3Config` of the golden's sizes, its weights set from the
golden's inputs (bf16 values, exact in any dtype), and per batch
- its expert bias set to the golden's (torchtitan's `expert_bias_E` is -beta);
- the router's selection compared with the golden's as sets, outside near-ties (tokens whose
  k-th and (k+1)-th biased scores are within 64 fp32 ulps: torch.topk orders ties its own way);
- the output, the routed output and the shared expert's output compared by relative RMS;
- its load histogram (routes per expert) compared with the golden's, and its MaxVio with the
  golden's and with the exact optimum's, which is 0 (the balanced assignment gives every
  expert exactly q = m k / n routes);
- QB's update, torchtitan's `quantile_balance_bias` on the layer's own router scores (the
  golden's iterations per batch, warm-started, as a trainer steps it), carried to the next
  batch: the state after each step against the golden's next bias.
Returns a table (one row per golden and batch) for measurements/*.json.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

QB_FILE = Path("torchtitan") / "models" / "kimi_k3" / "quantile_balance.py"


def load_torchtitan(path: str | None) -> tuple[Any, Any, str | None]:
    """(kimi_k3.model or None, kimi_k3.quantile_balance, why the model is missing) of the
    checkout at `path`. quantile_balance.py is loaded as a file (it needs only torch); the
    model needs the torchtitan package and its dependencies."""
    root = Path(path).resolve() if path else None
    qb_path = root / QB_FILE if root else None
    if qb_path is None or not qb_path.exists():
        qb = importlib.import_module("torchtitan.models.kimi_k3.quantile_balance")
    else:
        spec = importlib.util.spec_from_file_location("k3ref_torchtitan_quantile_balance", qb_path)
        assert spec is not None and spec.loader is not None
        qb = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(qb)
    model, why = import_model(path)
    return model, qb, why


def import_model(path: str | None) -> tuple[Any, str | None]:
    """(torchtitan.models.kimi_k3.model of the checkout at `path`, None), or (None, why not in
    one line): the model needs the torchtitan package and its dependencies."""
    if path and str(Path(path).resolve()) not in sys.path:
        sys.path.insert(0, str(Path(path).resolve()))
    try:
        return importlib.import_module("torchtitan.models.kimi_k3.model"), None
    except Exception as e:
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def build_layer(model: Any, p: dict[str, Any]) -> Any:
    """KimiMoE of a golden's sizes, through torchtitan's own config translation."""
    f, fs = p["f"], p["shared_f"]
    if fs % f:
        raise ValueError(f"shared expert size {fs} is not a multiple of the expert size {f} (torchtitan: num_shared_experts x f)")
    fields = dict(hidden_size=p["d"], num_experts=p["n"], num_experts_per_token=p["k"], moe_intermediate_size=f,
                  routed_expert_hidden_size=p["l"], latent_moe_use_norm=p["norm"], rms_norm_eps=p["eps"],
                  moe_router_activation_func="sigmoid", moe_renormalize=p["renormalize"],
                  routed_scaling_factor=p["routed_scaling_factor"][0] / p["routed_scaling_factor"][1],
                  num_expert_group=1, topk_group=1, num_shared_experts=fs // f,
                  hidden_act="situ" if p["activation"] == "situ" else "silu",
                  activation_situ_beta=p["situ_beta"], activation_situ_linear_beta=p["situ_linear_beta"],
                  moe_enable_ep=False, moe_enable_tp=False)
    import dataclasses
    known = {fl.name for fl in dataclasses.fields(model.KimiK3Config)}
    config = model.KimiK3Config(**{k: v for k, v in fields.items() if k in known})
    return model.KimiMoE(model.KimiMoE.make_config(config))


def set_weights(layer: Any, t: dict[str, Any], torch: Any) -> None:
    def put(param: Any, value: Any) -> None:
        with torch.no_grad():
            param.copy_(torch.as_tensor(value, dtype=param.dtype))
    moe = layer._moe
    put(layer.latent.down.weight, t["down"])
    put(layer.latent.up.weight, t["up"])
    if layer.latent.norm is not None:
        put(layer.latent.norm.weight, t["norm_weight"])
    put(moe.router.gate.weight, t["router"])
    ex = moe.routed_experts.inner_experts
    put(ex.w1_EFD, t["w1"])
    put(ex.w3_EFD, t["w3"])
    put(ex.w2_EDF, t["w2"])
    if layer.shared_experts is not None:
        put(layer.shared_experts.gate_proj.weight, t["shared_w1"])
        put(layer.shared_experts.up_proj.weight, t["shared_w3"])
        put(layer.shared_experts.down_proj.weight, t["shared_w2"])


def rel_rms(a: Any, b: Any) -> float:
    """The one judge's rel RMS of a against b (k3ref::check::compare, through k3ref.policy)."""
    from . import policy

    return float(policy.measure(a, b, "fp64")["rel_rms"])


def bias_tolerance(scale: float) -> float:
    """The policy table's bound on the bias (latent-moe: 64 fp32 ulps of max(1, max |golden|))."""
    from . import policy

    return float(policy.judge_figures({"max_abs": 0.0}, "moe.latent", "bias", "latent-moe", ulp_scale=scale).bound)


def check_case(path: Path, model: Any, qbmod: Any, device: str, dtype: str = "bfloat16") -> list[dict[str, Any]]:
    """Rows of one golden. Without the model, the QB part alone, on the golden's affinities."""
    import numpy as np
    import torch

    from . import _safetensors
    t, meta = _safetensors.load(path)
    p = json.loads(meta["k3ref.params"])
    name = path.stem
    if p["router"] != "sigmoid" or p["capacity"] > 0:
        return [{"case": name, "skipped": "given affinities or a capacity: torchtitan's layer reads sigmoid(W_r x) and is dropless"}]
    layer = None
    if model is not None:
        layer = build_layer(model, p).to(device)
        set_weights(layer, t, torch)
        # The parameters in the input's dtype (torch._grouped_mm takes one dtype; the golden's
        # weights are bf16 values, exact); the buffers (the expert bias, the load counts) stay
        # fp32, as torchtitan keeps them.
        for prm in layer.parameters():
            prm.data = prm.data.to(getattr(torch, dtype))
        layer.eval()
    k, n, m = p["k"], p["n"], p["m"]
    rows = []
    bias_tt = torch.zeros(n, dtype=torch.float32, device=device)  # torchtitan's QB state (its sign), carried
    for b in range(p["batches"]):
        golden_bias = np.asarray(t["bias"][b], dtype=np.float64)
        scale = max(1.0, float(np.abs(golden_bias).max()))
        row: dict[str, Any] = {"case": name, "batch": b, "device": device,
                               "carried_bias_error": float(np.abs(-bias_tt.double().cpu().numpy() - golden_bias).max()),
                               "bias_tolerance": bias_tolerance(scale)}
        if layer is not None:
            with torch.no_grad():
                layer._moe.expert_bias_E.copy_(torch.as_tensor(-golden_bias, dtype=torch.float32))
                x = torch.as_tensor(t["x"][b], dtype=getattr(torch, dtype), device=device)[None]
                start = time.perf_counter()
                y = layer(x)[0].float().cpu().numpy()
                row["seconds"] = time.perf_counter() - start
                _, _, scores = layer._moe.router(x, layer._moe.expert_bias_E)
            s = scores[0].float()
            row["output_rel_rms"] = rel_rms(y, t["output"][b])
            row["affinity_error"] = float(np.abs(s.double().cpu().numpy() - t["router_affinities"][b]).max())
        else:
            s = torch.as_tensor(t["router_affinities"][b], dtype=torch.float32, device=device)
        # torchtitan's routing of the batch with its own carried bias.
        with torch.no_grad():
            ids, _ = qbmod.topk_with_cutoff(s, bias_tt, k)
        ids = ids.cpu().numpy()
        biased = (s + bias_tt).double().cpu().numpy()
        srt = -np.sort(-biased, axis=1)
        near_tie = (srt[:, k - 1] - srt[:, k]) <= bias_tolerance(max(1.0, float(np.abs(biased).max())))
        same = np.array([set(ids[i].tolist()) == set(t["selection"][b][i].tolist()) for i in range(m)])
        loads = np.bincount(ids.reshape(-1), minlength=n)
        row.update({"selection_differs_outside_ties": int((~same & ~near_tie).sum()), "near_ties": int(near_tie.sum()),
                    "loads_equal": bool(np.array_equal(loads, t["loads"][b])),
                    "max_vio": float(loads.max() * n / loads.sum() - 1), "golden_max_vio": float(t["max_vio"][b]),
                    "optimum_max_vio": 0.0})
        # QB's update on the batch: the golden's iterations, warm-started, carried to the next.
        with torch.no_grad():
            nxt = bias_tt
            for _ in range(p["iterations_per_batch"]):
                _, cutoff = qbmod.topk_with_cutoff(s, nxt, k)
                nxt = qbmod.quantile_balance_bias(s, cutoff, k)
        bias_tt = nxt
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m k3ref.moe_check", description=__doc__.splitlines()[0])
    ap.add_argument("--torchtitan-path", default=os.environ.get("K3REF_TORCHTITAN_PATH"))
    ap.add_argument("--golden-dir", default=os.environ.get("K3REF_GOLDENS", str(Path(__file__).resolve().parents[2] / "goldens")))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16", help="the layer's parameters and input (default bfloat16)")
    ap.add_argument("--json", help="write the rows as JSON to this file")
    ap.add_argument("--measurement", help="write a measurements/ file of the rows to this path")
    a = ap.parse_args(argv)
    try:
        model, qbmod, why = load_torchtitan(a.torchtitan_path)
    except Exception as e:
        print(f"k3ref.moe_check: torchtitan's quantile_balance could not be loaded: {type(e).__name__}: {e}")
        return 2
    if why:
        print(f"k3ref.moe_check: torchtitan's kimi_k3 model could not be imported ({why}): the QB part only")
    rows: list[dict[str, Any]] = []
    for path in sorted(Path(a.golden_dir).glob("latent_moe_*.safetensors")):
        try:
            rows += check_case(path, model, qbmod, a.device, a.dtype)
        except Exception as e:
            rows.append({"case": path.stem, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})
    for r in rows:
        print(json.dumps(r))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    if a.measurement:
        from . import measurement
        notes = [f"torchtitan's kimi_k3 model did not import: {why}"] if why else []
        m = measurement.record(Path(a.measurement).stem, f"torchtitan's latent MoE layer (KimiMoE) and its QB update on "
                               f"the moe.latent goldens, {a.device}", {"layer": measurement_table(rows)},
                               commands=["python3 -m k3ref.moe_check " + " ".join(argv if argv is not None else sys.argv[1:])],
                               notes=notes, device=a.device, torchtitan=None)
        measurement.write(m, a.measurement)
    return 0


COLUMNS = (("case", "golden"), ("batch", "batch"), ("output_rel_rms", "output rel RMS"),
           ("affinity_error", "affinity max error"), ("carried_bias_error", "carried bias, max error"),
           ("selection_differs_outside_ties", "selections differing outside near-ties"), ("loads_equal", "loads equal"),
           ("max_vio", "MaxVio torchtitan"), ("golden_max_vio", "MaxVio golden"), ("note", "skipped / error"))


def measurement_table(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The rows as a measurements/ table (booleans as text: the renderer takes none)."""
    out = []
    for r in rows:
        cell = {k: r.get(k) for k, _ in COLUMNS if k in r}
        cell["case"] = f"`{r['case']}`"
        if "loads_equal" in r:
            cell["loads_equal"] = "yes" if r["loads_equal"] else "no"
        if "skipped" in r or "error" in r:
            cell["note"] = r.get("skipped") or r.get("error")
        out.append(cell)
    return {"caption": "Per golden and batch (output and affinities against the golden's; QB state carried from zero):",
            "columns": [{"key": k, "title": t, **({"format": "{:.2e}"} if k.endswith(("rms", "error")) else {"format": "{:.3g}"} if "vio" in k else {})}
                        for k, t in COLUMNS], "rows": out}


if __name__ == "__main__":
    sys.exit(main())
