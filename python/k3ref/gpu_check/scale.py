"""The scale tier (`pytest -p k3ref.pytest_plugin --k3ref-tier scale`, or its front end
`python3 -m k3ref.gpu_check run --tier scale`; docs/gpu_check.md): each KDA kernel at K3's
production shapes and at the sizes where indexing breaks, against libk3gc's fp64 recurrence
computed on the device (on a CPU, k3ref's compiled reference in double, for the tests'
scaled-down limits). The plugin runs each case of each kernel as one test (run_case) and
writes scale.json (state) from pytest's results; this module holds the cases, their judging,
the kernels' selection and the summary.

Cases (`Limits` sets their sizes; FULL is the tier, K = V = 128, HV = 64 value heads over 16
query heads, or 64 over 64 for a kernel without GVA):

- reference_vs_goldens: the device reference against every KDA golden inside its domain
  (the 256-bit goldens judge the judge);
- ragged_tail: T = 64 + r for every r in 0..63, one sequence, the inputs inside NaN-filled
  buffers (64 tokens of NaN after them) and the outputs pre-filled with NaN;
- long_sequence: one sequence of 65,536 tokens, the error of o judged per 4,096-token window;
- packed_documents: about 4,000 documents of 1-32 tokens packed into 65,536;
- many_sequences: N * HV > 65,535 (sequence, head) pairs, more than a grid's y or z extent;
- index_limit: v, g and o past 2^31 elements (documents of 4,000 tokens); only the documents
  that straddle element 2^31, the one before it, the last one and the first one (where wrapped
  offsets land) are judged, against the recurrence of those documents alone;
- gradients: a kernel with a backward, on 16,384 tokens in three documents (one long, one of a
  token, one of 64) with an initial state (K-first) and cotangents of o and the final state:
  dq, dk, dv, dg, dbeta, d_initial_state, dA_log and ddt_bias against libk3gc's fp64 backward
  (k3ref.kda_backward in double on a CPU), each judged by the one judge under the kernel's
  backward policy (the policy table's kda.backward rules).

Every verdict is the kernel's contract (docs/contracts.md): rel RMS <= m x max(bf16 floor,
the contract's own rel RMS), per window where there are windows, m the multiple of its policy
table rule; a kernel without a contract has a floor rule (m x floor). The contract is
evaluated on the CPU on two value heads (the first and the last) of the judged tokens (of a
single long sequence, its first L.contract_tokens): its error there stands for the kernel's
on all of them. A non-finite output where the reference is finite fails.

The four scale mutants of libk3gc (lib.SCALE_MUTANTS) must each fail at least one case;
`python3 -m k3ref.gpu_check run --no-builtin --adapter k3ref.gpu_check.adapters:scale_mutants`
runs the default tier on them, which they pass (gpu_check/device_scale.sh shows both).
"""
import math
import os
import time
from dataclasses import asdict, dataclass, replace

import torch

from .. import policy
from . import checks, lib, problems
from . import metrics as M
from .protocol import CheckResult, UsageError, shapes_of


@dataclass(frozen=True)
class Limits:
    """The sizes of the tier's cases (FULL: the H200's; the tests scale them down)."""

    index: int = 2**31           # elements: a 32-bit signed offset's range
    grid: int = 65535            # a CUDA grid's y and z extent
    long_T: int = 65536
    window: int = 4096
    H: int = 16
    HV: int = 64
    K: int = 128
    V: int = 128
    packed_T: int = 65536
    doc_max: int = 32
    index_doc: int = 4000        # the index-limit case's document length (2^31 falls inside one)
    chunk: int = 64              # ragged_tail: T = chunk + r for r in range(chunk)
    sample_heads: int = 2        # value heads the contract is evaluated on
    contract_tokens: int = 8192  # of one long sequence: the CPU contract's cost (0.8 ms a token and head)
    threads: int = 0             # CPU threads for the contract (0: all)
    grad_T: int = 16384          # the gradients case's tokens


FULL = Limits()


def limits_from(text, base=FULL):
    """Limits from "name=value,..." ($K3REF_SCALE_LIMITS: a smaller tier for a first look on a
    new machine); unknown names and non-integers are a one-line ValueError."""
    fields = {f: type(v) for f, v in asdict(base).items()}
    changes = {}
    for item in filter(None, (x.strip() for x in (text or "").split(","))):
        name, _, value = item.partition("=")
        if name not in fields:
            raise ValueError(f"scale limits: unknown name {name!r} (names: {', '.join(fields)})")
        try:
            changes[name] = int(value, 0)
        except ValueError:
            raise ValueError(f"scale limits: {name}={value!r} is not an integer") from None
    return replace(base, **changes)
# In this order (each one pytest test, run in a worker process that a crash or a CUDA error ends
# and pytest-xdist replaces: the cases after it still run).
CASES = ("reference_vs_goldens", "ragged_tail", "long_sequence", "packed_documents", "many_sequences", "index_limit",
         "gradients")
# Raw gate inputs of the lower-bound gate, -5 sigmoid(exp(A_log)(x + dt_bias)) with A_log and
# dt_bias in [-0.5, 0.5]: decays from exp(-3.47) to 1 - 5.7e-4, so that the slowest channels
# remember about 1,750 tokens (an e-fold), and a correct kernel's error is stationary past the
# first 4,096-token window: the contract on a long sequence's first 8,192 tokens bounds the rest.
GATE_RANGE = (-5.0, 0.0)


def k3_params(cu_seqlens=None, initial_state=True):
    """K3's KDA options (the configuration FlashKDA and FLA share): lower-bound gate in kernel,
    beta = sigmoid(logits), q and k L2-normalised, state [N, HV, V, K]."""
    c = problems.CONFIGS[1]
    return dict(gate=c["gate"], lower_bound=c["lower_bound"], beta=c["beta"], qk_l2norm=c["qk_l2norm"], scale=None,
                state_layout=c["state_layout"], A_log=True, cu_seqlens=cu_seqlens, initial_state=initial_state)


def heads_for(adapter, L):
    """(H, HV) at which the adapter runs: HV = L.HV over L.H query heads, or over HV without GVA."""
    for H in (L.H, L.HV):
        shapes = dict(B=1, T=L.chunk, H=H, HV=L.HV, K=L.K, V=L.V)
        if adapter.unsupported(k3_params(), shapes) is None:
            return H, L.HV
    return None


def _uniform(gen, shape, lo, hi, device):
    x = torch.rand(shape, generator=gen, dtype=torch.float32, device=device)
    return x.mul_(hi - lo).add_(lo).to(torch.bfloat16)


def make_inputs(T, H, HV, L, seed, device, cu_seqlens=None, initial_state=True):
    """Random bf16 inputs (drawn on `device`, deterministic in the seed there) of one sequence
    of T tokens, or of the documents `cu_seqlens` (a list) gives."""
    gen = torch.Generator(device=device).manual_seed(seed)
    K, V = L.K, L.V
    inputs = {"q": _uniform(gen, (1, T, H, K), -1, 1, device), "k": _uniform(gen, (1, T, H, K), -1, 1, device),
              "v": _uniform(gen, (1, T, HV, V), -1, 1, device), "g": _uniform(gen, (1, T, HV, K), *GATE_RANGE, device),
              "beta": _uniform(gen, (1, T, HV), -4, 4, device)}
    inputs["A_log"] = (torch.rand(HV, generator=gen, device=device, dtype=torch.float64) - 0.5).float()
    inputs["dt_bias"] = (torch.rand(HV, K, generator=gen, device=device, dtype=torch.float64) - 0.5).float()
    N = len(cu_seqlens) - 1 if cu_seqlens else 1
    if initial_state:
        inputs["initial_state"] = torch.rand((N, HV, V, K), generator=gen, device=device).mul_(2).sub_(1)
    if cu_seqlens:
        inputs["cu_seqlens"] = torch.tensor(cu_seqlens, dtype=torch.int64, device=device)
    return inputs, k3_params(cu_seqlens, initial_state)


def doc_lengths(total, longest, seed):
    """Lengths in [1, longest] drawn until they sum to `total` (the last one cut to fit)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < total:
        lengths.append(min(int(torch.randint(1, longest + 1, (1,), generator=gen)), total - sum(lengths)))
    return lengths


def cumulative(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def index_layout(H, HV, L):
    """(cu_seqlens, judged documents) of the index-limit case: documents of L.index_doc tokens,
    enough that v, g and o pass L.index elements with element L.index inside one document."""
    per_token = HV * max(L.K, L.V)
    boundary = -(-L.index // per_token)  # the first token whose elements are all past the limit
    straddle = (L.index // per_token) // L.index_doc
    if (L.index // per_token) % L.index_doc == 0:
        raise ValueError("scale: the index limit falls on a document boundary; change index_doc")
    n_docs = straddle + 2
    cu = cumulative([L.index_doc] * n_docs)
    assert cu[-1] > boundary
    return cu, sorted({0, straddle - 1, straddle, n_docs - 1})


# --------------------------------------------------------------------------- reference and judge

def reference(inputs, params, device):
    """(o, final_state) in fp64: libk3gc's fp64 kernel on a CUDA device (its fast form, bit for bit
    the plain kernel), else k3ref in double."""
    if str(device).startswith("cuda"):
        if not lib.available():
            raise RuntimeError("the scale tier's reference is libk3gc's fp64 kernel: " + lib.load_error())
        return lib.kda_forward(inputs, params, precision=2, output_dtype=torch.float64, state_dtype=torch.float64)
    from . import references

    return references.module_reference(inputs, params)


def documents(inputs, params, ns):
    """The inputs and params of documents `ns` alone, packed in that order (their tokens, their
    initial states), and their cu_seqlens (a list)."""
    cu = [int(x) for x in inputs["cu_seqlens"].tolist()]
    part = {k: torch.cat([inputs[k][:, cu[n] : cu[n + 1]] for n in ns], dim=1).contiguous() for k in problems.TOKEN_INPUTS}
    for k in ("A_log", "dt_bias"):
        part[k] = inputs[k]
    if "initial_state" in inputs:
        part["initial_state"] = inputs["initial_state"][list(ns)].contiguous()
    sub_cu = cumulative([cu[n + 1] - cu[n] for n in ns])
    part["cu_seqlens"] = torch.tensor(sub_cu, dtype=torch.int64, device=inputs["cu_seqlens"].device)
    return part, dict(params, cu_seqlens=sub_cu), sub_cu


def sampled_heads(inputs, HV, count):
    """Value heads the contract is evaluated on: the first and the last (then evenly between)."""
    if count >= HV:
        return list(range(HV))
    return sorted({round(i * (HV - 1) / max(count - 1, 1)) for i in range(count)})


def head_slice(inputs, heads):
    """The inputs of these value heads alone, each with its query head (GVA ratio 1 after)."""
    H, HV = inputs["q"].shape[2], inputs["v"].shape[2]
    idx = torch.tensor(heads, device=inputs["v"].device)
    qidx = idx // (HV // H)
    out = {}
    for name, t in inputs.items():
        if name in ("q", "k"):
            out[name] = t.index_select(2, qidx).contiguous()
        elif name in ("v", "g", "beta"):
            out[name] = t.index_select(2, idx).contiguous()
        elif name in ("A_log", "dt_bias", "initial_state"):
            out[name] = t.index_select(0 if name != "initial_state" else 1, idx).contiguous()
        else:
            out[name] = t
    return out


def rule_policy(adapter, tensor):
    """The policy whose rule for `tensor` the tier judges the adapter by: its precision
    contract's (contracts.policy_of), else its own where that is a floor rule, else floor:4."""
    if adapter.contract_name:
        from . import contracts

        return contracts.policy_of(adapter.contract_name)
    rule = checks.policy_rule(adapter, tensor)
    return adapter.policy if rule is not None and rule.metric == "floor" else "floor:4"


def contract_errors(adapter, inputs, params, ref_o, ref_f, L, window=None):
    """The contract's rel RMS of o and of the final state (and of o per window) on the sampled
    heads; zeros for an adapter without a contract (its rule is a floor multiple)."""
    if not adapter.contract_name:
        return 0.0, 0.0, None
    from . import contracts

    heads = sampled_heads(inputs, inputs["v"].shape[2], L.sample_heads)
    sub = head_slice(inputs, heads)
    idx = torch.tensor(heads, device=ref_o.device)
    T = inputs["q"].shape[1]
    cut = L.contract_tokens if inputs.get("cu_seqlens") is None and T > L.contract_tokens else None
    if cut:
        # One long sequence: the contract on its first `cut` tokens; the windows past them are
        # bounded with the largest contract error of the windows it covers.
        sub = problems.token_range(sub, 0, cut)
        ro, rf = (t.cpu() for t in reference(sub, params, ref_o.device))
    else:
        ro, rf = ref_o.index_select(2, idx).cpu(), ref_f.index_select(1, idx).cpu()
    sub = {k: v.cpu() for k, v in sub.items()}
    co, cf = contracts.contract_outputs(adapter.contract_name, sub, dict(params, threads=L.threads or os.cpu_count()))
    m_o = M.compare(co, ro, torch.bfloat16, window_shape=(len(heads) * L.V, ro.shape[1], window) if window else None)
    m_f = M.compare(cf, rf, torch.bfloat16)
    windows = m_o.window_rel_rms
    if window and cut:
        windows = windows + [max(windows)] * (-(-T // window) - len(windows))
    return m_o.rel_rms, m_f.rel_rms, windows


@dataclass
class TensorVerdict:
    tensor: str
    ok: bool
    figure: float
    floor: float
    contract: float
    multiple: float
    bound: float
    ratio: float
    nonfinite: int = 0
    worst_window: int = -1
    window_ratios: list = None
    reason: str = ""


def judge_tensor(name, cand, ref, rule, contract=0.0, window=None, contract_windows=None, op="kda.recurrent"):
    """cand against ref (same element order) by the one judge (policy.judge_figures) under the
    rule of policy `rule` for the tensor `name` names ("o[doc 3]": o): m x max(bf16 floor,
    contract) for a contract rule, m x the floor for a floor rule; so in every window of
    `window` tokens when given (axis 1 of a [B, T, HV, V] tensor). The figures are the
    comparator's where the tensors lie (libk3gc's on the device)."""
    tensor = name.partition("[")[0]
    shape = (ref[0, 0].numel(), ref.shape[1], window) if window else None
    mt = M.compare(cand, ref, torch.bfloat16, window_shape=shape)
    r = policy.judge_figures(mt.to_dict(), op, tensor, rule, contract_error=contract)
    m = policy.load_table().rules(rule, op)[tensor].multiple
    nonfinite = (mt.candidate_nan + mt.candidate_inf) - (mt.reference_nan + mt.reference_inf)
    finite = mt.first_nonfinite_mismatch < 0
    v = TensorVerdict(name, r.passed, mt.rel_rms, mt.floor_rel_rms, contract, m, r.bound, r.ratio if finite else math.inf,
                      max(nonfinite, 0))
    if not finite:
        v.reason = (f"{name}: {v.nonfinite or 'some'} non-finite values where the reference is finite "
                    f"(first at flat index {mt.first_nonfinite_mismatch})")
        return v
    v.reason = f"{name}: {r.reason}"
    if window:
        floors = M.compare(ref.to(torch.bfloat16), ref, torch.bfloat16, window_shape=shape).window_rel_rms
        cw = contract_windows or [0.0] * len(floors)
        judged = [policy.judge_figures({"rel_rms": e, "floor_rel_rms": f}, op, tensor, rule, contract_error=c)
                  for e, f, c in zip(mt.window_rel_rms, floors, cw)]
        v.window_ratios = [w.ratio for w in judged]
        v.worst_window = max(range(len(judged)), key=lambda i: v.window_ratios[i])
        w_ok = all(w.passed for w in judged)
        v.ok = v.ok and w_ok
        w, ratios = v.worst_window, v.window_ratios
        v.reason += (f"; per {window}-token window {'all' if w_ok else 'not all'} within {m:g}x, worst window {w} "
                     f"(tokens {w * window}-{min((w + 1) * window, ref.shape[1]) - 1}) {ratios[w]:.3g}x, "
                     f"first {ratios[0]:.3g}x, last {ratios[-1]:.3g}x")
    return v


def _poison_outputs(adapter, like_o, device):
    """A NaN-filled output buffer for a kernel that takes one; else NaN left in the allocator."""
    if adapter.accepts_out:
        return torch.full(like_o, float("nan"), dtype=adapter.output_dtype, device=device)
    n = math.prod(like_o) * torch.tensor([], dtype=adapter.output_dtype).element_size()
    checks._poison_allocator([n] * 2, device)
    return None


def _free(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- cases

def _verdict(adapter, case, verdicts, extra=None):
    ok = all(v.ok for v in verdicts)
    worst = max(verdicts, key=lambda v: v.ratio if v.ratio == v.ratio else math.inf)
    res = CheckResult(adapter.name, "scale", case, "pass" if ok else "fail", "; ".join(v.reason for v in verdicts),
                      ratio=worst.ratio, metrics={v.tensor: asdict(v) for v in verdicts})
    res.extra.update(extra or {})
    res.extra["figure"], res.extra["bound"], res.extra["tensor"] = worst.figure, worst.bound, worst.tensor
    return res


def _whole(adapter, case, inputs, params, L, device, window=None, extra=None):
    """The kernel on the inputs (outputs poisoned first), judged on o and the final state."""
    s = shapes_of(inputs)
    out = _poison_outputs(adapter, (s["B"], s["T"], s["HV"], s["V"]), device)
    o, final = checks._run(adapter, inputs, params, out=out)
    ref_o, ref_f = reference(inputs, params, device)
    c_o, c_f, c_w = contract_errors(adapter, inputs, params, ref_o, ref_f, L, window)
    vs = [judge_tensor("o", o, ref_o, rule_policy(adapter, "o"), c_o, window, c_w),
          judge_tensor("final_state", final, ref_f, rule_policy(adapter, "final_state"), c_f)]
    return _verdict(adapter, case, vs, extra)


def case_long_sequence(adapter, H, HV, L, device, seed=11):
    inputs, params = make_inputs(L.long_T, H, HV, L, seed, device)
    return _whole(adapter, "long_sequence", inputs, params, L, device, window=L.window,
                  extra={"T": L.long_T, "H": H, "HV": HV})


def case_packed_documents(adapter, H, HV, L, device, seed=12):
    lengths = doc_lengths(L.packed_T, L.doc_max, seed)
    inputs, params = make_inputs(L.packed_T, H, HV, L, seed, device, cu_seqlens=cumulative(lengths), initial_state=False)
    return _whole(adapter, "packed_documents", inputs, params, L, device,
                  extra={"documents": len(lengths), "T": L.packed_T, "H": H, "HV": HV})


def case_many_sequences(adapter, H, HV, L, device, seed=13):
    n = L.grid // HV + 64
    lengths = doc_lengths(n * (L.doc_max + 1) // 2, L.doc_max, seed)
    lengths = (lengths + [1] * n)[:n]
    cu = cumulative(lengths)
    inputs, params = make_inputs(cu[-1], H, HV, L, seed, device, cu_seqlens=cu, initial_state=False)
    return _whole(adapter, "many_sequences", inputs, params, L, device,
                  extra={"sequences": n, "pairs": n * HV, "grid_limit": L.grid, "H": H, "HV": HV})


def case_ragged_tail(adapter, H, HV, L, device, seed=14):
    """One sequence of T = chunk + r tokens for every r, inside NaN (L.chunk tokens of it after)."""
    worst, fails = None, []
    for r in range(L.chunk):
        T = L.chunk + r
        inputs, params = make_inputs(T, H, HV, L, seed + r, device)
        pad = L.chunk * HV * max(L.K, L.V)
        poisoned = {k: (checks._poisoned_copy(v, pad) if k in problems.TOKEN_INPUTS else v) for k, v in inputs.items()}
        try:
            res = _whole(adapter, "ragged_tail", poisoned, params, L, device)
        except Exception as e:  # one residue's exception is that residue's failure
            res = CheckResult(adapter.name, "scale", "ragged_tail", "error",
                              f"{type(e).__name__}: {e}".splitlines()[0][:300], ratio=math.inf)
        if res.status != "pass":
            fails.append(r)
        key = (res.status == "pass", -(res.ratio if res.ratio == res.ratio else math.inf))
        if worst is None or key < worst[0]:
            worst = (key, r, res)
    _, r, res = worst
    res.reason = (f"T mod {L.chunk} = 0..{L.chunk - 1} ({L.chunk} runs, NaN after the inputs): "
                  + (f"{len(fails)} fail (residues {fails[:16]}{' ...' if len(fails) > 16 else ''}); " if fails else "all pass; ")
                  + f"worst at T = {L.chunk + r}: {res.reason}")
    res.status = ("error" if res.status == "error" else "fail") if fails else "pass"
    res.extra.update(worst_T=L.chunk + r, failing_residues=fails, H=H, HV=HV)
    return res


def case_index_limit(adapter, H, HV, L, device, seed=15):
    cu, judged = index_layout(H, HV, L)
    inputs, params = make_inputs(cu[-1], H, HV, L, seed, device, cu_seqlens=cu)
    s = shapes_of(inputs)
    out = _poison_outputs(adapter, (s["B"], s["T"], s["HV"], s["V"]), device)
    o, final = checks._run(adapter, inputs, params, out=out)
    # The judged documents alone, packed: one reference run (the recurrence of those documents
    # only) and one contract run for them all.
    part, p, sub_cu = documents(inputs, params, judged)
    ref_o, ref_f = reference(part, p, device)
    c_o, c_f, _ = contract_errors(adapter, part, p, ref_o, ref_f, L)
    vs = []
    for i, n in enumerate(judged):
        got_o = o[:, cu[n] : cu[n + 1]].contiguous()
        want_o = ref_o[:, sub_cu[i] : sub_cu[i + 1]].contiguous()
        vs.append(judge_tensor(f"o[doc {n}]", got_o, want_o, rule_policy(adapter, "o"), c_o))
        vs.append(judge_tensor(f"final_state[doc {n}]", final[n : n + 1].contiguous(), ref_f[i : i + 1].contiguous(),
                               rule_policy(adapter, "final_state"), c_f))
    elements = {k: inputs[k].numel() for k in ("q", "v")}
    return _verdict(adapter, "index_limit", vs, extra={
        "documents": len(cu) - 1, "T": cu[-1], "judged_documents": judged, "elements": elements,
        "o_elements": o.numel(), "limit": L.index, "H": H, "HV": HV})


def case_gradients(adapter, H, HV, L, device, seed=16):
    """The kernel's backward against the reference gradients (module docstring)."""
    from .. import policy
    from . import backward, references

    T = L.grad_T
    cu = [0, T - 65, T - 64, T]
    inputs, params = make_inputs(T, H, HV, L, seed, device, cu_seqlens=cu)
    params = dict(params, state_layout="k_first")
    inputs["initial_state"] = inputs["initial_state"].transpose(-1, -2).contiguous()  # [N, HV, K, V]
    s = shapes_of(inputs)
    why = adapter.backward_unsupported(params, s) if adapter.has_backward() else "the kernel has no backward"
    if why:
        return CheckResult(adapter.name, "scale", "gradients", "skip", f"n/a ({why})")
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    d_o = _uniform(gen, (1, T, HV, L.V), -1, 1, device)
    d_final = torch.rand(inputs["initial_state"].shape, generator=gen, device=device).mul_(2).sub_(1)
    leaves = {n: (t if n == "cu_seqlens" else t.detach().clone().requires_grad_(True)) for n, t in inputs.items()}
    grads = adapter.run_backward(leaves, params, d_o, d_final)
    if adapter.device_sync:
        torch.cuda.synchronize()
    want = references.gradients(inputs, params, d_o, d_final, device)
    names = [g for g in backward.GRADIENTS if g in want]
    missing = [g for g in names if g not in grads]
    v = policy.judge({g: want[g] for g in names}, {g: grads[g].detach().reshape(want[g].shape) for g in names if g in grads},
                     "kda.backward", adapter.backward_policy, tensors=names, cu_seqlens=cu, state_layout="k_first")
    verdicts = [TensorVerdict(r.tensor, r.passed, r.rel_rms, r.floor, 0.0, 1.0, r.bound,
                              r.rel_rms / r.bound if r.bound > 0 else math.inf, r.candidate_nan + r.candidate_inf,
                              reason=f"{r.tensor}: rel RMS {r.rel_rms:.3e} {'<=' if r.passed else '>'} {r.bound:g} "
                                     f"({adapter.backward_policy}; {r.ratio:.3g}x its bf16 floor)")
                for r in v.results]
    res = _verdict(adapter, "gradients", verdicts, extra={"T": T, "H": H, "HV": HV, "documents": len(cu) - 1,
                                                          "policy": adapter.backward_policy})
    if missing:
        res.status, res.reason = "fail", f"no gradient for {', '.join(missing)}; " + res.reason
    return res


CASE_FUNCTIONS = {"ragged_tail": case_ragged_tail, "long_sequence": case_long_sequence,
                  "packed_documents": case_packed_documents, "many_sequences": case_many_sequences,
                  "index_limit": case_index_limit, "gradients": case_gradients}
assert tuple(CASE_FUNCTIONS) == CASES[1:]  # the order they run in


def reference_vs_goldens(device, goldens=None, reference=None, options=None):
    """The tier's reference (reference_adapter(device), or the adapter given) on every KDA
    golden inside its domain, judged as the default tier judges it (rel RMS <= 1e-12 against
    the 256-bit goldens)."""
    from .. import goldens as G

    ref = reference or reference_adapter(device, options)
    if not ref.available():
        return [CheckResult(ref.name, "scale", "reference_vs_goldens", "error", "not available: " + ref.unavailable_reason)]
    ref.device_sync = str(device).startswith("cuda")
    suite = G.load_suite(G.directory(goldens))
    results = [checks.golden_check(ref, case, device) for case in suite if case.op in ref.golden_ops]
    ran = [r for r in results if r.status != "skip"]
    bad = [r for r in ran if r.status != "pass"]
    figure = max((r.metrics.get("rel_rms", 0.0) for r in ran if r.metrics), default=0.0)
    res = CheckResult(ref.name, "scale", "reference_vs_goldens", "fail" if bad or not ran else "pass",
                      (f"{len(ran) - len(bad)}/{len(ran)} KDA goldens within its policy ({ref.policy}); worst rel RMS "
                       f"of o {figure:.3e}") + ("" if not bad else "; failing: " + ", ".join(r.case for r in bad[:8])),
                      ratio=None)
    res.extra.update(figure=figure, bound=1e-12, goldens=len(ran), failing=[r.case for r in bad])
    return [res]


def run_case(adapter, case, L=FULL, device="cuda"):
    """One case (of CASE_FUNCTIONS) of one kernel: its CheckResult (skip with the reason when the
    kernel is unavailable or the case is outside its domain; error with the exception)."""
    adapter.device_sync = str(device).startswith("cuda")
    if not adapter.available():
        return CheckResult(adapter.name, "scale", case, "skip", "not available: " + adapter.unavailable_reason,
                           extra={"unavailable": True})
    hv = heads_for(adapter, L)
    if hv is None:
        return CheckResult(adapter.name, "scale", case, "skip", "n/a (outside the kernel's domain: K3's "
                           f"configuration at K = {L.K}, V = {L.V}, HV = {L.HV})")
    t0 = time.time()
    res = checks.guard(adapter, "scale", case, lambda: CASE_FUNCTIONS[case](adapter, *hv, L, device))
    res.seconds = time.time() - t0
    _free(device)
    return res


def reference_adapter(device, options=None):
    """The tier's reference as an adapter (reference_vs_goldens judges it on the goldens): the one
    reference() computes with, libk3gc's fp64 kernel on a CUDA device, else k3ref's compiled
    reference in double."""
    from . import registry

    return registry.resolve(registry.SCALE_REFERENCE_CUDA if str(device).startswith("cuda")
                            else registry.SCALE_REFERENCE_HOST, options)[0]


def select_kernels(opts, conftest_objects=()):
    """(kernels, requested names) of a scale run (the plugin's options, RunOptions): the
    built-in kernels and the scale mutants, then the KDA forward kernels among the adapters
    given (--k3ref-adapter, conftest.py's k3ref_adapters); --k3ref-only picks among them (each
    must exist), --k3ref-no-mutants leaves out the mutants not named. Named kernels are asked
    for (one that is not available fails). Raises UsageError (one line)."""
    from . import registry

    kernels = registry.resolve(registry.SCALE_KERNELS, opts)
    try:
        given, _ = registry.discover(specs=opts.adapters, conftest_specs=conftest_objects, entry_points=False,
                                     options=opts)
    except registry.AdapterSpecError as e:
        raise UsageError(str(e)) from e
    given = [a for a in given if getattr(a, "family", "") == "kda" and hasattr(a, "unsupported")]  # KdaAdapter.run
    requested = {a.name for a in given}
    clash = sorted({a.name for a in kernels} & requested)
    if clash:
        raise UsageError(f"adapter {clash[0]!r}: a built-in kernel of the scale tier has that name; names must "
                         f"be unique")
    kernels += given
    if opts.only:
        unknown = [n for n in opts.only if n not in {a.name for a in kernels}]
        if unknown:
            raise UsageError(f"--only: unknown kernel {unknown[0]!r} (scale tier kernels: "
                             f"{', '.join(a.name for a in kernels)})")
        kernels = [a for a in kernels if a.name in opts.only]
        requested |= set(opts.only)
    if opts.no_mutants:
        kernels = [a for a in kernels if a.kind != "mutant" or a.name in requested]
    return kernels, requested


def cases_of(names):
    """The cases a --k3ref-cases list names, in CASES' order (all without one); an unknown name
    is a one-line UsageError naming the valid ones."""

    if not names:
        return CASES
    bad = [c for c in names if c not in CASES]
    if bad:
        raise UsageError(f"--cases: unknown scale case {bad[0]!r} (cases: {', '.join(CASES)})")
    return tuple(c for c in CASES if c in names)


def limits_of(opts):
    """The Limits of a run (RunOptions.scale_limits: --k3ref-scale-limits, else
    $K3REF_SCALE_LIMITS; FULL without either); a bad value is a one-line UsageError."""
    try:
        return limits_from(opts.scale_limits)
    except ValueError as e:
        raise UsageError(f"--k3ref-scale-limits {opts.scale_limits!r}: {str(e).removeprefix('scale limits: ')}") from None


def mutant_verdict(results):
    """(caught | missed | could not run, the cases that caught it) of a scale mutant from its
    cases' results: caught when one failed or erred (a crash of its process included); a case
    that gave no result, or ran past its time limit, is neither a catch nor a run."""
    counted = [r for r in results if not ((r.extra or {}).get("no_result") or (r.extra or {}).get("timed_out"))]
    caught = [r.case for r in counted if r.status in ("fail", "error")]
    ran = [r for r in counted if r.status != "skip"]
    return ("caught" if caught else ("missed" if ran else "could not run")), caught


def summarize(results, kinds, asked=()):
    """{verdict, failures, mutants: {name: caught | missed | could not run}} of a tier run
    (kinds: kernel name -> kernel | mutant | reference); a kernel in `asked` (named with --only
    or given) that is not available fails it."""
    failures, of_mutant = [], {}
    for r in results:
        if kinds.get(r.adapter) == "mutant":
            of_mutant.setdefault(r.adapter, []).append(r)
        elif r.status in ("fail", "error") or (r.adapter in asked and r.reason.startswith("not available")):
            failures.append(f"{r.adapter} {r.case}: {r.reason[:300]}")
    if not any(r.status != "skip" for r in results if kinds.get(r.adapter) in ("kernel", "mutant")):
        failures.append("no kernel ran a case: nothing is vouched for")
    judged = {n: mutant_verdict(rs) for n, rs in of_mutant.items()}
    verdict = {n: v for n, (v, _) in judged.items()}
    ok = not failures and all(v == "caught" for v in verdict.values())
    return {"verdict": "PASS" if ok else "FAIL", "failures": failures, "mutants": verdict,
            "mutant_catches": {n: by for n, (_, by) in judged.items()}}


def state(results, kinds, asked, limits, device, gpu, wall_s):
    """What scale.json holds: {tier, limits, device, gpu, results (rows), summary, wall_s}."""
    return {"tier": "scale", "limits": limits if isinstance(limits, dict) else asdict(limits), "device": str(device),
            "gpu": gpu, "results": [result_row(r) for r in results], "summary": summarize(results, kinds, asked),
            "wall_s": round(wall_s, 2)}


def result_row(r):
    d = {"kernel": r.adapter, "case": r.case, "verdict": r.status, "figure": r.extra.get("figure"),
         "bound": r.extra.get("bound"), "ratio": r.ratio, "tensor": r.extra.get("tensor"), "seconds": round(r.seconds, 3),
         "reason": r.reason}
    d.update({k: v for k, v in r.extra.items() if k not in ("figure", "bound", "tensor", "traceback")})
    if r.metrics:
        d["tensors"] = r.metrics
    return d


def table(rows):
    """The short table: kernel x case, figure, bound, ratio, verdict."""
    lines = [f"{'kernel':34} {'case':22} {'figure':>10} {'bound':>10} {'ratio':>8} {'verdict':8} {'s':>7}"]
    for d in rows:
        fig = d.get("figure")
        bnd = d.get("bound")
        ratio = d.get("ratio")
        lines.append(f"{d['kernel'][:34]:34} {d['case'][:22]:22} "
                     f"{(f'{fig:.3e}' if isinstance(fig, float) else '-'):>10} "
                     f"{(f'{bnd:.3e}' if isinstance(bnd, float) else '-'):>10} "
                     f"{(f'{ratio:.3g}' if isinstance(ratio, float) and ratio == ratio else '-'):>8} "
                     f"{d['verdict']:8} {d.get('seconds', 0):7.1f}")
    return "\n".join(lines)


__all__ = ["Limits", "FULL", "CASES", "run_case", "judge_tensor", "replace"]
