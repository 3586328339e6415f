"""The backward check of the matrix: a kernel's gradients against k3ref's gradient goldens
("kda.backward", docs/backward.md), one test per adapter and golden (`backward` among the
adapter's checks). The context-parallel backward, rank by rank over P GPUs, is cp_check.py's
cp_backward.

An adapter gives gradients by `run_backward(inputs, params, d_o, d_final_state)` (the
protocol's optional backward; by default autograd through its `run` when it declares
`gradients = "autograd"`): the golden's inputs enter as leaves, and
torch.autograd.backward((o, final_state), (d_o, d_final_state)) gives dq, dk, dv, dg, dbeta,
the initial state's gradient and, where the case has them, dA_log and ddt_bias. A kernel whose
outputs carry no autograd graph has no backward in that version: not applicable, with that
reason. Each gradient is judged by the one judge (k3ref.policy) under the adapter's
`backward_policy`, by default the policy table's "chunk" rules for kda.backward: FLA's own
test thresholds (relative RMS, `err_ratio` in fla/utils/_testing.py: 0.008 for dq, dk, dv and
the state gradient, 0.02 for dg, dbeta, dA_log and ddt_bias), reported with each gradient's
ratio to its bf16 rounding floor (the error of merely storing the exact gradient in bf16).
"""
import torch

from .. import policy
from .protocol import CheckResult, NotSupported

# The gradients judged, by default under the rules of the policy table's "chunk" policy for
# kda.backward (FLA's own test thresholds, with their reason in policy/policies.json).
GRADIENTS = ("dq", "dk", "dv", "dg", "dbeta", "d_initial_state", "dA_log", "ddt_bias")
POLICY = "chunk"
INPUT_OF = {"dq": "q", "dk": "k", "dv": "v", "dg": "g", "dbeta": "beta", "d_initial_state": "initial_state",
            "dA_log": "A_log", "ddt_bias": "dt_bias"}


def score(case, grads, policy_name=POLICY):
    """Per gradient: FLA's err_ratio (the rel RMS), the bf16 floor of the golden, their ratio,
    the threshold and pass/fail, from the one judge (k3ref.policy) under `policy_name`."""
    names = [g for g in GRADIENTS if g in case.tensors and g in grads]
    v = policy.judge_case(case, {g: grads[g].detach().reshape(case.tensors[g].shape) for g in names}, policy_name,
                          tensors=names)
    return [{"tensor": r.tensor, "err_ratio": r.rel_rms, "bf16_floor": r.floor, "over_floor": r.ratio,
             "threshold": r.bound, "finite": r.first_nonfinite_mismatch < 0 and r.candidate_nan + r.candidate_inf == 0,
             "passed": r.passed} for r in v.results]


def _leaf(t, device, dtype=None):
    t = t.to(device)
    if dtype is not None:
        t = t.to(dtype)
    return t.detach().clone().requires_grad_(True)


def gradient_inputs(case, device, input_dtype=None):
    """The case's inputs as leaves that require grad, in their stored dtypes (what a kernel
    takes; the state and gate parameters in fp32) unless `input_dtype` says otherwise (fp64
    for a reference). Without an initial state the golden still holds dL/d(zero state), so
    zeros are passed to get it."""
    inputs = {name: _leaf(case.tensors[name], device, input_dtype) for name in ("q", "k", "v", "g", "beta")}
    h0 = case.tensors.get("initial_state", torch.zeros(case.tensors["d_initial_state"].shape))
    inputs["initial_state"] = _leaf(h0, device, input_dtype or torch.float32)
    for name in ("A_log", "dt_bias"):
        if name in case.tensors:
            inputs[name] = _leaf(case.tensors[name], device, input_dtype or torch.float32)
    if "cu_seqlens" in case.tensors:
        inputs["cu_seqlens"] = case.tensors["cu_seqlens"].to(device)
    return inputs


def autograd_gradients(run, inputs, params, d_o, d_final_state):
    """The gradients of `run(inputs, params) -> (o, final_state)` by autograd, for the leaves
    of `inputs` (gradient_inputs). NotSupported when the outputs carry no graph."""
    o, final = run(inputs, params)
    if not (o.requires_grad or (final is not None and final.requires_grad)):
        raise NotSupported("no backward in this version: the kernel's outputs carry no autograd graph")
    outs, grads_out = [o], [d_o.to(o.device, o.dtype)]
    if final is not None and final.requires_grad:
        outs.append(final)
        grads_out.append(d_final_state.to(final.device, final.dtype))
    torch.autograd.backward(outs, grads_out)
    return {g: inputs[i].grad for g, i in INPUT_OF.items() if i in inputs and inputs[i].grad is not None}


def run_single(case, adapter, device, input_dtype=None):
    """Gradients of an adapter's `run` on one case by autograd (the adapters' default backward)."""
    inputs = gradient_inputs(case, device, input_dtype)
    return autograd_gradients(adapter.run, inputs, case.params, case.tensors["d_o"], case.tensors["d_final_state"])


def is_context_parallel(case):
    """The context-parallel gradient case (no final-state gradient: its ranks' slices are judged by cp_check)."""
    return "final_state_gradient" in case.params and not case.params["final_state_gradient"]


def cases(adapter, suite):
    """(case id, case, None or why not applicable) for each gradient golden of the suite."""
    for case in suite:
        if case.op != "kda.backward":
            continue
        if is_context_parallel(case):
            yield case.name, case, "n/a (the context-parallel gradient case: cp_check's cp_backward judges it per rank)"
            continue
        s = {k: case.params[k] for k in ("B", "T", "H", "HV", "K", "V")}
        why = adapter.backward_unsupported(case.params, s)
        yield case.name, case, (f"n/a ({why})" if why else None)


def backward_check(adapter, case, device):
    """One gradient golden through the adapter's backward, judged under its backward policy."""
    device = torch.device(device)
    inputs = gradient_inputs(case, device)
    grads = adapter.run_backward(inputs, case.params, case.tensors["d_o"], case.tensors["d_final_state"])
    if adapter.device_sync:
        torch.cuda.synchronize()
    missing = [g for g in GRADIENTS if g in case.tensors and g not in grads]
    scores = score(case, grads, adapter.backward_policy)
    failed = [x for x in scores if not x["passed"]]
    worst = max(scores, key=lambda x: x["err_ratio"] / x["threshold"] if x["threshold"] else 0.0, default=None)
    if worst is None:
        return CheckResult(adapter.name, "backward", case.name, "error", "the backward returned none of the gradients")
    ratio = worst["err_ratio"] / worst["threshold"] if worst["threshold"] else None
    floors = ", ".join(f"{x['tensor']} {x['over_floor']:.2g}x" for x in scores)
    reason = (f"worst {worst['tensor']}: rel RMS {worst['err_ratio']:.2e} of {worst['threshold']:g} "
              f"({adapter.backward_policy}); x bf16 floor: {floors}")
    if failed:
        reason = "failed " + ", ".join(f"{x['tensor']} ({x['err_ratio']:.2e} of {x['threshold']:g}"
                                        + ("" if x["finite"] else ", non-finite") + ")" for x in failed) + "; " + reason
    if missing:
        reason = f"no gradient for {', '.join(missing)}; " + reason
    res = CheckResult(adapter.name, "backward", case.name, "fail" if failed or missing else "pass", reason, ratio=ratio)
    res.extra["worst_tensor"] = worst["tensor"]
    res.extra["policy"] = adapter.backward_policy
    res.extra["gradients"] = scores
    return res
