"""Golden checks and the checks that need no golden (docs/gpu_check.md, docs/design.md section 9).

Every check returns CheckResult objects with status pass | fail | skip | error and a
one-line reason that gives the measured figure and the bound."""
import functools
import math
import time
import traceback

import torch

from .. import policy
from . import metrics as M
from .autotune import NOT_APPLICABLE, describe, kernel_name, pinned, recording
from .protocol import CheckResult  # noqa: F401 (checks.CheckResult, as before)
from .protocol import NotSupported, bits
from .problems import P_SPLIT, T_META, make_problem, pick_config, token_range
from .protocol import shapes_of as _shapes


# --------------------------------------------------------------------------- helpers

def _bitwise_equal(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def _first_diff_token(a, b):
    """First token index (axis 1 of [B,T,...]) where a and b differ bitwise, or -1."""
    x = bits(a).reshape(a.shape[0], a.shape[1], -1)
    y = bits(b).reshape(b.shape[0], b.shape[1], -1)
    diff = (x != y).any(dim=2).any(dim=0)
    idx = diff.nonzero()
    return int(idx[0, 0]) if idx.numel() else -1


def _agree(a, b, policy_mult, fmt=torch.bfloat16, least=0.0):
    """(ok, reason) for two runs of one kernel: bitwise equal, or rel RMS of the difference
    within policy_mult x the nominal rounding floor of the values (metrics.nominal_floor), or
    x `least` when that is larger (the difference a correct kernel makes by construction, such
    as carrying its state in bf16)."""
    if _bitwise_equal(a, b):
        return True, "bitwise equal", 0.0
    m = M.compare(a, b.to(a.dtype), fmt)
    # The verdict is the one judge's (check::judge_agreement), on the figure of either comparator.
    v = policy.judge_agreement(m.rel_rms, m.first_nonfinite_mismatch, M.nominal_floor(b, fmt), least, policy_mult)
    return v["passed"], v["reason"], v["ratio"]


def carried_state_error(inputs, params, split, state_dtype):
    """(rel RMS of o, of the final state): the fp64 recurrence run on [0, split) and then on
    the rest from its final state rounded to `state_dtype`, against the whole run (bf16: about
    7.7e-3 of o on the split check's inputs). Zero for fp32 and wider, whose ~1e-8 is far below
    the floor the check compares with."""
    from . import references

    if torch.finfo(state_dtype).eps <= torch.finfo(torch.float32).eps:
        # fp32 or wider: its carry error (~1e-8 of o) is far below every bf16 floor the check
        # compares with, so it needs no reference; narrower formats are computed.
        return 0.0, 0.0
    cpu = {k: v.cpu() for k, v in inputs.items()}
    o, f = references.kda(cpu, params)
    o1, f1 = references.kda(token_range(cpu, 0, split), params)
    second = dict(token_range(cpu, split, None), initial_state=f1.to(state_dtype).to(torch.float64))
    o2, f2 = references.kda(second, params)

    def rel(x, y):
        den = float(torch.linalg.vector_norm(y))
        return float(torch.linalg.vector_norm(x - y)) / den if den > 0 else 0.0

    return rel(torch.cat([o1, o2], dim=1), o), rel(f2, f)


def _multiple(adapter):
    """The floor multiple the checks without a golden allow two runs to differ by: the
    policy's multiple for o (policy table), 4 for policies that are not floor multiples."""
    rule = policy_rule(adapter)
    return rule.multiple if rule is not None and rule.metric == "floor" else 4.0


def _snapshot(inputs):
    return {k: v.clone() for k, v in inputs.items()}


def _run(adapter, inputs, params, out=None):
    o, final = adapter.run(inputs, params, out=out) if adapter.accepts_out else adapter.run(inputs, params)
    if adapter.device_sync:
        torch.cuda.synchronize()
    return o, final


def _metamorphic(name):
    """A metamorphic check `name`: run on the adapter's first supported configuration c
    (pick_config), skipped without one; an exception is the check's error (guard)."""
    def wrap(body):
        @functools.wraps(body)
        def check(adapter, device, *args, **kw):
            c = pick_config(adapter)
            if c is None:
                return CheckResult(adapter.name, name, "-", "skip", "no supported configuration")
            return guard(adapter, name, c["name"], lambda: body(adapter, device, c, *args, **kw))

        check.check_name = name
        return check

    return wrap


def guard(adapter, check, case, fn):
    """fn()'s CheckResult, timed; NotSupported is not applicable, any other exception the check's error."""
    t0 = time.time()
    try:
        res = fn()
    except NotSupported as e:  # the installed version lacks an option or feature: not applicable
        res = CheckResult(adapter.name, check, case, "skip", f"n/a ({e})")
    except Exception as e:
        res = CheckResult(adapter.name, check, case, "error", f"{type(e).__name__}: {e}".splitlines()[0][:300],
                          extra={"traceback": traceback.format_exc()[-2000:]})
    res.seconds = time.time() - t0
    return res


# --------------------------------------------------------------------------- golden checks

def policy_rule(adapter, tensor="o", op="kda.recurrent"):
    """The rule of the policy table (k3ref.policy) for the adapter's policy, or None."""
    try:
        return policy.load_table().rules(adapter.policy, op).get(tensor)
    except (KeyError, ValueError):
        return None


_FIGURES = ("count", "rel_rms", "max_abs", "max_abs_index", "max_ulp", "max_ulp_index", "candidate_nan",
            "candidate_inf", "first_nonfinite_mismatch")


def _figures(r):
    """The report's figures of one judged tensor (a TensorResult of the one judge)."""
    d = {k: getattr(r, k) for k in _FIGURES}
    d["floor_rel_rms"] = r.floor
    d["floor_ratio"] = r.rel_rms / r.floor if r.floor > 0 else (0.0 if r.rel_rms == 0 else math.inf)
    return d


def judge_golden(adapter, case, o, final, window_tokens=8):
    """The verdict of a KDA kernel's o and final state on a golden case: the one judge
    (k3ref.policy, the rules `k3ref compare` applies, same table, same figures) under the
    adapter's policy, or under its precision contract's rules when it declares one
    (docs/contracts.md), plus the error by token window for the report's plot."""
    s = _shapes(case.inputs)
    candidate = {"o": o}
    if final is not None:
        candidate["final_state"] = final
    names = [n for n in ("o", "final_state") if n in case.expected]
    if adapter.contract_name:
        from . import contracts
        try:
            v = contracts.judge(adapter.contract_name, case.inputs, case.params, candidate,
                                {n: case.expected[n] for n in names})
        except ValueError as e:
            return CheckResult(adapter.name, "golden", case.name, "error", str(e))
    else:
        v = policy.judge_case(case, candidate, adapter.policy, tensors=names)
    status = {0: "pass", 1: "fail", 2: "error"}[v.exit_code]
    judged = {r.tensor: r for r in v.results if r.tensor in names}
    reason = "; ".join(f"{n}: {r.reason}" for n, r in judged.items()) or v.reason
    if v.exit_code == 2:
        reason = f"{v.reason} ({reason})" if v.reason not in reason else reason
    # The figure of the cell is the worst over every judged output, named: a failing final
    # state must not hide behind o's ratio.
    ratios = {n: (r.ratio if r.metric in ("floor", "contract") else r.figure) for n, r in judged.items()
              if r.status in ("pass", "fail")}
    worst_tensor = max(ratios, key=lambda n: ratios[n] if ratios[n] == ratios[n] else math.inf, default=None)
    ratio = ratios[worst_tensor] if worst_tensor is not None else None
    o_result = judged.get("o")
    windows = None
    if o_result is not None and o_result.status in ("pass", "fail"):
        windows = M.compare(o, case.expected["o"].to(o.device), window_shape=(s["HV"] * s["V"], s["T"],
                                                                               window_tokens)).window_rel_rms
    res = CheckResult(adapter.name, "golden", case.name, status, reason, ratio=ratio,
                      metrics=_figures(o_result) if windows is not None else {}, windows=windows,
                      window_tokens=window_tokens)
    res.extra["worst_tensor"] = worst_tensor
    res.extra["policy"] = v.policy
    res.extra["verdict"] = v.to_dict()
    for n, r in judged.items():
        if r.worst_index:
            key = "worst_element" if n == "o" else f"{n}_worst_element"
            res.extra[key] = {"index": r.worst_at, "candidate": r.candidate_value, "reference": r.golden_value,
                              "abs_error": r.max_abs}
    fs = judged.get("final_state")
    if fs is not None and fs.status in ("pass", "fail"):
        res.extra["final_state"] = _figures(fs)
        ref_state = case.expected["final_state"].to(final.device).to(torch.float64)
        # Error by (sequence, value head) of the final state, for the report's plot of it.
        err = (final.to(torch.float64) - ref_state).flatten(2).square().sum(-1)
        den = ref_state.flatten(2).square().sum(-1).clamp_min(torch.finfo(torch.float64).tiny)
        res.extra["final_state_rows"] = (err / den).sqrt().cpu().tolist()
        res.extra["final_state_floor"] = fs.floor
    return res


def golden_check(adapter, case, device, window_tokens=8):
    why = adapter.case_unsupported(case)
    if why:
        return CheckResult(adapter.name, "golden", case.name, "skip", why)

    def body():
        inputs = {k: v.to(device) for k, v in case.inputs.items()}
        if "initial_state" in inputs and adapter.kind != "reference":
            inputs["initial_state"] = inputs["initial_state"].float()
        o, final = _run(adapter, inputs, case.params)
        return judge_golden(adapter, case, o, final, window_tokens)

    return guard(adapter, "golden", case.name, body)


# --------------------------------------------------------------------------- metamorphic checks

# Causality perturbs tokens >= 37: inside the 16-token chunk [32, 48) and before its middle
# row 40, so a kernel that anchors a chunk's arithmetic on a later row shows it.
P_CAUSAL = 37


@_metamorphic("causality")
def check_causality(adapter, device, c, seed=1):
    inputs, params = make_problem(c, T_META, seed, device)
    o1, _ = _run(adapter, _snapshot(inputs), params)
    pert = _snapshot(inputs)
    for name in ("q", "k", "v", "g", "beta"):
        fresh, _ = make_problem(c, T_META, seed + 7, device)
        pert[name][:, P_CAUSAL:] = fresh[name][:, P_CAUSAL:]
    o2, _ = _run(adapter, pert, params)
    first = _first_diff_token(o1[:, :P_CAUSAL], o2[:, :P_CAUSAL])
    if first < 0:
        return CheckResult(adapter.name, "causality", c["name"], "pass",
                           f"outputs before token {P_CAUSAL} bitwise unchanged when tokens >= {P_CAUSAL} change")
    return CheckResult(adapter.name, "causality", c["name"], "fail",
                       f"output of token {first} changed when only tokens >= {P_CAUSAL} changed")


@_metamorphic("suffix")
def check_suffix(adapter, device, c, seed=2):
    inputs, params = make_problem(c, T_META + 28, seed, device)
    short = token_range(inputs, 0, T_META)
    o_long, _ = _run(adapter, inputs, params)
    o_short, _ = _run(adapter, short, params)
    ok, reason, ratio = _agree(o_short, o_long[:, :T_META].contiguous(), _multiple(adapter))
    return CheckResult(adapter.name, "suffix", c["name"], "pass" if ok else "fail",
                       f"first {T_META} tokens with 28 appended: " + reason, ratio=ratio)


@_metamorphic("varlen")
def check_varlen(adapter, device, c, seed=3):
    lengths = [37, 1, 62]
    cu = [0, 37, 38, 100]
    inputs, params = make_problem(c, T_META, seed, device, cu_seqlens=cu)
    o_var, f_var = _run(adapter, inputs, params)
    worst = (True, "bitwise equal", 0.0)
    for n, (b, e) in enumerate(zip(cu[:-1], cu[1:])):
        part = token_range(inputs, b, e)
        part.pop("cu_seqlens")
        part["initial_state"] = inputs["initial_state"][n : n + 1].contiguous()
        p = dict(params, cu_seqlens=None)
        o_n, f_n = _run(adapter, part, p)
        for what, x, y in (("o", o_var[:, b:e].contiguous(), o_n), ("final_state", f_var[n : n + 1].contiguous(), f_n)):
            ok, reason, ratio = _agree(x, y, _multiple(adapter))
            if not ok or (worst[0] and ratio > worst[2]):
                worst = (ok, f"sequence {n} ({lengths[n]} tokens) {what}: {reason}", ratio)
            if not ok:
                break
        if not worst[0]:
            break
    return CheckResult(adapter.name, "varlen", c["name"], "pass" if worst[0] else "fail",
                       f"cu_seqlens {cu} vs separate runs: " + worst[1], ratio=worst[2])


@_metamorphic("split")
def check_split(adapter, device, c, seed=4):
    inputs, params = make_problem(c, T_META, seed, device)
    o_full, f_full = _run(adapter, inputs, params)
    first = token_range(inputs, 0, P_SPLIT)
    second = token_range(inputs, P_SPLIT, None)
    o1, f1 = _run(adapter, first, params)
    second["initial_state"] = f1.float().contiguous()
    o2, f2 = _run(adapter, second, params)
    if adapter.contract_name:  # bound: the contract's own split difference on the same inputs
        from . import contracts
        co, cf = contracts.contract_outputs(adapter.contract_name, inputs, params)
        c1o, c1f = contracts.contract_outputs(adapter.contract_name, first, params)
        c2o, c2f = contracts.contract_outputs(adapter.contract_name, dict(second, initial_state=c1f.float()), params)
        m = contracts.multiple(adapter.contract_name)
        ok, reason, ratio = contracts.agreement(torch.cat([o1, o2], dim=1).cpu(), o_full.cpu(),
                                                torch.cat([c1o, c2o], dim=1), co, m)
        okf, reasonf, ratiof = contracts.agreement(f2.float().cpu(), f_full.float().cpu(), c2f, cf, m)
    else:
        # What carrying the state in the kernel's declared state format costs a correct
        # kernel, computed on the fp64 recurrence: bound = multiple x max(nominal floor, it).
        carry_o, carry_f = carried_state_error(inputs, params, P_SPLIT, adapter.state_dtype)
        mult = _multiple(adapter)
        ok, reason, ratio = _agree(torch.cat([o1, o2], dim=1), o_full, mult, least=carry_o)
        okf, reasonf, ratiof = _agree(f2.float(), f_full.float(), mult, least=carry_f)
        if f1.dtype != adapter.state_dtype:
            ok, reason = False, (f"the kernel returned its final state as {f1.dtype}, but declares state_dtype "
                                 f"{adapter.state_dtype}: declare the format it carries; " + reason)
    return CheckResult(adapter.name, "split", c["name"], "pass" if ok and okf else "fail",
                       f"[0,{P_SPLIT}) then [{P_SPLIT},{T_META}) with the state carried: o {reason}; "
                       f"final_state {reasonf}", ratio=max(ratio, ratiof))


@_metamorphic("determinism")
def check_determinism(adapter, device, c, seed=5, runs=3):
    inputs, params = make_problem(c, T_META, seed, device, cu_seqlens=[0, 37, 38, 100])
    first = _run(adapter, inputs, params)
    for r in range(1, runs):
        again = _run(adapter, inputs, params)
        for what, x, y in (("o", first[0], again[0]), ("final_state", first[1], again[1])):
            if not _bitwise_equal(x, y):
                return CheckResult(adapter.name, "determinism", c["name"], "fail",
                                   f"run {r + 1} differs from run 1 in {what}")
    return CheckResult(adapter.name, "determinism", c["name"], "pass", f"{runs} runs bitwise identical")


def _poisoned_copy(t, pad=4096):
    """t inside a larger buffer whose elements before and after it are NaN (or -1 for ints)."""
    flat = t.reshape(-1)
    fill = float("nan") if t.is_floating_point() else -1
    buf = torch.full((flat.numel() + 2 * pad,), fill, dtype=t.dtype, device=t.device)
    buf[pad : pad + flat.numel()] = flat
    return buf[pad : pad + flat.numel()].view(t.shape)


def _poison_allocator(nbytes_list, device):
    """Leaves NaN-filled blocks of these sizes in PyTorch's caching allocator, so that a kernel
    allocating its outputs with torch.empty gets poisoned memory."""
    if not str(device).startswith("cuda"):
        return
    blocks = [torch.full((max(1, n // 4) + 1024,), float("nan"), dtype=torch.float32, device=device) for n in nbytes_list]
    del blocks


@_metamorphic("poisoned_memory")
def check_poison(adapter, device, c, seed=6):
    inputs, params = make_problem(c, T_META, seed, device, cu_seqlens=[0, 37, 38, 100])
    clean_o, _ = _run(adapter, _snapshot(inputs), params)
    poisoned = {k: (_poisoned_copy(v) if k != "cu_seqlens" else v) for k, v in inputs.items()}
    out = None
    if adapter.accepts_out:
        out = torch.full(clean_o.shape, float("nan"), dtype=clean_o.dtype, device=clean_o.device)
    else:
        _poison_allocator([clean_o.numel() * clean_o.element_size()] * 4, device)
    o, final = _run(adapter, poisoned, params, out=out)
    bad_o = int((~o.isfinite()).sum())
    bad_f = int((~final.isfinite()).sum())
    if bad_o or bad_f:
        tok = int((~o.isfinite()).reshape(o.shape[0], o.shape[1], -1).any(2).any(0).nonzero()[0, 0]) if bad_o else -1
        return CheckResult(adapter.name, "poisoned_memory", c["name"], "fail",
                           f"{bad_o} non-finite outputs (first at token {tok}), {bad_f} in the final state, "
                           f"with NaN around the inputs and in the output buffers")
    if not _bitwise_equal(o, clean_o):
        return CheckResult(adapter.name, "poisoned_memory", c["name"], "fail",
                           "outputs changed when the memory around the inputs was poisoned")
    return CheckResult(adapter.name, "poisoned_memory", c["name"], "pass",
                       "inputs inside NaN-filled buffers, outputs pre-filled with NaN: all written, finite, "
                       "bitwise equal to the clean run")


@_metamorphic("inputs_unchanged")
def check_inputs_unchanged(adapter, device, c, seed=7):
    inputs, params = make_problem(c, T_META, seed, device, cu_seqlens=[0, 37, 38, 100])
    before = _snapshot(inputs)
    _run(adapter, inputs, params)
    changed = [k for k in inputs if not _bitwise_equal(inputs[k], before[k])]
    if changed:
        return CheckResult(adapter.name, "inputs_unchanged", c["name"], "fail",
                           "the kernel modified its inputs: " + ", ".join(changed))
    return CheckResult(adapter.name, "inputs_unchanged", c["name"], "pass", "all inputs bitwise unchanged")


METAMORPHIC = [check_causality, check_suffix, check_varlen, check_split, check_determinism, check_poison,
               check_inputs_unchanged]
METAMORPHIC_BY_NAME = {check.check_name: check for check in METAMORPHIC}


def run_all(adapters, cases, device, budget_s=0.0, progress=None):
    """Metamorphic checks first, then the golden cases; past budget_s seconds per adapter
    (0: none) the remaining checks are reported as skipped, with that reason."""
    results = []
    for a in adapters:
        a.device_sync = str(device).startswith("cuda")
        if not a.available():
            results.append(CheckResult(a.name, "all", "-", "skip", "not available: " + a.unavailable_reason))
            continue
        t0 = time.time()
        jobs = [] if a.kind == "reference" else [(check.__name__, lambda check=check: check(a, device)) for check in METAMORPHIC]
        jobs += [("golden:" + case.name, lambda case=case: golden_check(a, case, device)) for case in cases]
        for name, job in jobs:
            if budget_s and time.time() - t0 > budget_s:
                check, _, case = name.partition(":")
                results.append(CheckResult(a.name, check.replace("check_", ""), case or "-", "skip",
                                           f"time budget of {budget_s:g} s for this kernel exhausted"))
                continue
            results.append(job())
            if progress:
                r = results[-1]
                progress(f"{r.adapter} {r.check}[{r.case}] {r.status} {r.seconds:.1f}s: {r.reason[:160]}")
    return results


def run_op_adapters(adapters, cases, device, progress=None):
    """Golden checks of the AttnRes and QB adapters (attnres_check, qb_check) on the cases
    of their operators; an unavailable implementation is one skipped result with the reason."""
    results = []
    for a in adapters:
        if not a.available():
            results.append(CheckResult(a.name, "all", "-", "skip", "not available: " + a.unavailable_reason))
            continue
        for case in cases:
            if not a.supports(case):
                continue
            results.append(a.check(case, device))
            if progress:
                r = results[-1]
                progress(f"{r.adapter} {r.check}[{r.case}] {r.status} {r.seconds:.1f}s: {r.reason[:160]}")
    return results


def golden_all_configs(adapter, case, device, check=None):
    """The golden check of `case` once with the autotuners' winners and then once per
    configuration of every autotuner the call uses. One CheckResult: its extra['configs']
    lists {kernel, index, config, status, reason, ratio} for every configuration run."""
    check = check or golden_check
    with recording() as used:
        winner = check(adapter, case, device)
    rows = []
    for tuner in used:
        name = kernel_name(tuner)
        for i, config in enumerate(list(tuner.configs)):
            with pinned(tuner, config):
                res = check(adapter, case, device)
            status = res.status
            if status == "error" and res.reason.split(":")[0].strip() in NOT_APPLICABLE:
                status = "not applicable"
            rows.append({"kernel": name, "index": i, "config": describe(config), "status": status,
                         "reason": res.reason[:300], "ratio": res.ratio})
    bad = [r for r in rows if r["status"] in ("fail", "error")]
    ran = [r for r in rows if r["status"] in ("pass", "fail")]
    if winner.status in ("pass", "fail", "error") and rows:
        skipped = len(rows) - len(ran) - len([r for r in bad if r["status"] == "error"])
        summary = (f"{len(rows)} configurations of {len(used)} autotuned kernels"
                   + (f" ({skipped} not applicable to this shape)" if skipped else ""))
        if bad:
            first = bad[0]
            winner.status = "fail" if winner.status != "error" else "error"
            winner.reason = (f"{len(bad)} of {summary} fail, first {first['kernel']} config {first['index']} "
                             f"[{first['config']}]: {first['reason']}; with the winners: {winner.reason}")[:600]
        else:
            worst = max((r for r in ran if r["ratio"] is not None), key=lambda r: r["ratio"], default=None)
            winner.reason = (f"{summary} pass" + (f" (worst {worst['ratio']:.3g} at {worst['kernel']} config "
                                                  f"{worst['index']})" if worst else "")
                             + f"; with the winners: {winner.reason}")[:600]
            if worst is not None and winner.ratio is not None:
                winner.ratio = max(winner.ratio, worst["ratio"])
    elif not rows:
        winner.reason = (f"no autotuned Triton kernel in this call (one configuration): {winner.reason}")[:600]
    winner.extra["configs"] = rows
    winner.extra["autotune_configs"] = "all"
    return winner
