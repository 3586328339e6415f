"""Backward checks: a training kernel's gradients (autograd through FLA's chunk_kda)
against k3ref's gradient goldens ("kda.backward", docs/backward.md), on one GPU. The
context-parallel backward, rank by rank over P GPUs, is cp_check.py's cp_backward.

For each case the kernel runs the golden's inputs with requires_grad, and
torch.autograd.backward((o, final_state), (d_o, d_final_state)) gives its gradients.
Each gradient is scored by FLA's own test metric (relative RMS error, `err_ratio` in
fla/utils/_testing.py) against the golden, and by that error over the golden's bf16
rounding floor (the error of merely storing the exact gradient in bf16). The pass
thresholds are the ones FLA's tests assert for its backward: 0.008 for dq, dk, dv and the
state gradient, 0.02 for dg, dbeta, dA_log and ddt_bias (docs/backward.md).

    PYTHONPATH=python python3 -m k3ref.gpu_check.backward --goldens goldens --fla-path DIR --out report/
    PYTHONPATH=python python3 -m k3ref.gpu_check.cp_check --kernel fla --backend nccl --ranks 2,4,8 --fla-path DIR ...
"""
import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from .. import goldens, policy
from .adapters import FlaAdapter, _add_path

# The gradients judged, each under the rule of the policy table's "chunk" policy for
# kda.backward (FLA's own test thresholds, with their reason in policy/policies.json).
GRADIENTS = ("dq", "dk", "dv", "dg", "dbeta", "d_initial_state", "dA_log", "ddt_bias")
POLICY = "chunk"
INPUT_OF = {"dq": "q", "dk": "k", "dv": "v", "dg": "g", "dbeta": "beta", "d_initial_state": "initial_state",
            "dA_log": "A_log", "ddt_bias": "dt_bias"}


def score(case, grads):
    """Per gradient: FLA's err_ratio (the rel RMS), the bf16 floor of the golden, their ratio,
    the threshold and pass/fail, from the one judge (k3ref.policy) under POLICY."""
    names = [g for g in GRADIENTS if g in case.tensors and g in grads]
    v = policy.judge_case(case, {g: grads[g].detach().reshape(case.tensors[g].shape) for g in names}, POLICY,
                          tensors=names)
    return [{"tensor": r.tensor, "err_ratio": r.rel_rms, "bf16_floor": r.floor, "over_floor": r.ratio,
             "threshold": r.bound, "finite": r.first_nonfinite_mismatch < 0 and r.candidate_nan + r.candidate_inf == 0,
             "passed": r.passed} for r in v.results]


def unsupported(params, s):
    if params.get("state_layout") == "v_first":
        return "the golden uses a V-first state (FLA's backward is checked K-first)"
    if s["K"] > 256:
        return "FLA KDA supports K <= 256"
    if params.get("gate") == "softplus" and not params.get("A_log"):
        return "FLA's softplus gate needs A_log"
    return None


def _leaf(t, device, dtype=None):
    t = t.to(device)
    if dtype is not None:
        t = t.to(dtype)
    return t.detach().clone().requires_grad_(True)


def run_single(case, adapter, device, input_dtype=None):
    """Gradients of a kernel (an adapter's run) on one device, by autograd, for the inputs
    the case has. Inputs enter in their stored dtypes (what a kernel takes; the state and
    gate parameters in fp32) unless `input_dtype` says otherwise (fp64 for a reference)."""
    inputs = {}
    for name in ("q", "k", "v", "g", "beta"):
        inputs[name] = _leaf(case.tensors[name], device, input_dtype)
    # Without an initial state the golden still holds dL/d(zero state): pass zeros to get it.
    h0 = case.tensors.get("initial_state", torch.zeros(case.tensors["d_initial_state"].shape))
    inputs["initial_state"] = _leaf(h0, device, input_dtype or torch.float32)
    for name in ("A_log", "dt_bias"):
        if name in case.tensors:
            inputs[name] = _leaf(case.tensors[name], device, input_dtype or torch.float32)
    if "cu_seqlens" in case.tensors:
        inputs["cu_seqlens"] = case.tensors["cu_seqlens"].to(device)
    o, final = adapter.run(inputs, case.params)
    d_o = case.tensors["d_o"].to(device).to(o.dtype)
    d_final = case.tensors["d_final_state"].to(device).to(final.dtype)
    torch.autograd.backward((o, final), (d_o, d_final))
    return {g: inputs[i].grad for g, i in INPUT_OF.items() if i in inputs and inputs[i].grad is not None}


def _selected(case, only):
    return not only or case.name in only


def _progress(message):
    print(message, flush=True)


def check_single(golden_dir, only=None):
    adapters = [FlaAdapter("chunk_kda"), FlaAdapter("chunk_kda", safe_gate=True)]
    device = torch.device("cuda")
    rows = []
    for case in goldens.load_suite(golden_dir, ops=("kda.backward",)):
        if not _selected(case, only):
            continue
        params = case.params
        if "final_state_gradient" in case.params and not case.params["final_state_gradient"]:
            continue  # the context-parallel case: cp_check.py (cp_backward)
        s = dict(B=params["B"], T=params["T"], H=params["H"], HV=params["HV"], K=params["K"], V=params["V"])
        for adapter in adapters:
            row = {"kernel": adapter.name, "case": case.name}
            if not adapter.available():
                row.update(status="skipped", reason=adapter.unavailable_reason)
            elif unsupported(params, s) or adapter.unsupported(params, s):
                row.update(status="skipped", reason=unsupported(params, s) or adapter.unsupported(params, s))
            else:
                try:
                    start = time.perf_counter()
                    grads = run_single(case, adapter, device)
                    torch.cuda.synchronize()
                    _progress(f"{adapter.name} {case.name}: {time.perf_counter() - start:.1f} s (compilation included)")
                    row["scores"] = score(case, grads)
                    row["status"] = "passed" if all(x["passed"] for x in row["scores"]) else "failed"
                except Exception as e:  # a crash is a failure with its message
                    row.update(status="failed", reason=f"{type(e).__name__}: {e}")
            rows.append(row)
    return rows


def check_context_parallel(golden_dir, only=None):
    """Moved to cp_check.py (per rank fragments, entering states, gradients and wire bytes, P = 2, 4, 8)."""
    raise SystemExit("the context-parallel check is now: python3 -m k3ref.gpu_check.cp_check --kernel fla "
                     "--backend nccl --ranks 2 --fla-path DIR --out DIR (docs/gpu_check.md)")


def print_table(rows):
    print(f"{'kernel':<26} {'case':<44} {'tensor':<16} {'err_ratio':>10} {'floor':>10} {'x floor':>8} {'limit':>7}  result")
    for row in rows:
        if "scores" not in row:
            print(f"{row['kernel']:<26} {row['case']:<44} {'-':<16} {'':>10} {'':>10} {'':>8} {'':>7}  {row['status']}: {row.get('reason', '')}")
            continue
        for x in row["scores"]:
            print(f"{row['kernel']:<26} {row['case']:<44} {x['tensor']:<16} {x['err_ratio']:>10.3e} {x['bf16_floor']:>10.3e} "
                  f"{x['over_floor']:>8.2f} {x['threshold']:>7.3f}  {'pass' if x['passed'] else 'FAIL'}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--goldens", default="goldens")
    ap.add_argument("--fla-path", help="directory holding the fla package (else the installed one)")
    ap.add_argument("--out", help="directory for backward.json")
    ap.add_argument("--cp", action="store_true", help="moved: python3 -m k3ref.gpu_check.cp_check (exits with that line)")
    ap.add_argument("--cases", nargs="*", help="only these golden cases")
    args = ap.parse_args(argv)
    FlaAdapter.fla_path = args.fla_path
    _add_path(args.fla_path)
    rows = check_context_parallel(args.goldens, args.cases) if args.cp else check_single(args.goldens, args.cases)
    if rows is None:
        return 0
    print_table(rows)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / ("backward_cp.json" if args.cp else "backward.json")).write_text(json.dumps(rows, indent=1))
    failed = [r for r in rows if r["status"] == "failed"]
    print(f"{len(rows)} rows: {sum(r['status'] == 'passed' for r in rows)} passed, {len(failed)} failed, "
          f"{sum(r['status'] == 'skipped' for r in rows)} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
