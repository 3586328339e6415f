"""Precision contracts of the KDA kernels, for the harness's verdicts (docs/contracts.md).

A kernel adapter declares the contract of its kernel by name ("fla_recurrent", "fla_chunk",
"fla_chunk_safe_gate", "flashkda": kda/kernel_contracts.h, evaluated through
k3ref.kda_contract) and a small multiple m. The verdict on a tensor t of the kernel is

    rel RMS(t_kernel - t_ref) <= m * max(floor, rel RMS(t_contract - t_ref))

with t_ref the fp64 recurrence, t_contract the contract evaluated on the *same inputs* the
kernel received, and floor the rel RMS of rounding t_ref to bf16 (the output-rounding floor;
the state is judged at the bf16 floor too, as in the policy table). A kernel meets its bound
when its arithmetic is what it declares; a kernel far beyond its own contract has a defect.

For the metamorphic checks (split, varlen, ...) two kernel runs are compared with each other:
`agreement` bounds their difference by m * max(nominal floor, difference of the two contract
runs on the same inputs), since an ill-conditioned problem makes even the declared arithmetic
split differently from one shot (docs/contracts.md: the FLA chunk split case).

API:
    bounds = contract_bounds(contract, inputs, params, candidate=(o, final_state), m=None)
        -> {"o": ContractBound, "final_state": ContractBound}
    passed, reason, bounds = judge(adapter, inputs, params, o, final, reference)
        the verdict under adapter.contract_name / adapter.contract_multiple
    contract_outputs(contract, inputs, params) -> (o, final_state) float64 CPU
    agreement(a, b, a_contract, b_contract, m) -> (ok, reason, ratio)
    MULTIPLES: the per-contract m (measured worst ratios in docs/contracts.md)
params: the golden / harness parameter names (gate, gate_base, lower_bound, beta, qk_l2norm,
scale, state_layout). Inputs: the kernel's tensors (any device); the chunk contracts model
bf16 q, k, v and o and are refused (ValueError, one line) for other dtypes.
"""
import math
from dataclasses import dataclass

import torch

CONTRACTS = ("fla_recurrent", "fla_chunk", "fla_chunk_safe_gate", "flashkda")

# m per contract (docs/contracts.md: the measured worst ratios kernel error / max(floor,
# contract error) under each). fla_recurrent keeps the 1.5 of its former floor policy: its
# contract error is the bf16 floor itself (1.00x), so 2 would widen its bound unmeasured.
MULTIPLES = {"fla_recurrent": 1.5, "fla_chunk": 2.0, "fla_chunk_safe_gate": 2.0, "flashkda": 2.0}

_INPUTS = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias", "cu_seqlens")


def _k3ref():
    import k3ref
    return k3ref


def _rel_rms(x, ref):
    x, ref = x.detach().to("cpu", torch.float64), ref.detach().to("cpu", torch.float64)
    den = float(ref.pow(2).mean().sqrt()) if ref.numel() else 0.0
    num = float((x - ref).pow(2).mean().sqrt()) if ref.numel() else 0.0
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def _bf16_floor(ref):
    return _rel_rms(ref.to(torch.bfloat16), ref)


def contract_outputs(contract, inputs, params):
    """(o, final_state) of `contract` evaluated on the kernel's inputs, float64 on the CPU;
    final_state in params' state_layout (None when the inputs give no state to return)."""
    if contract not in CONTRACTS:
        raise ValueError(f"contracts: unknown contract {contract!r} (expected: {', '.join(CONTRACTS)})")
    for name in ("q", "k", "v"):  # every contract rounds to bf16 where the kernel stores in the input dtype
        t = inputs.get(name)
        if t is not None and t.dtype != torch.bfloat16:
            raise ValueError(f"contracts: contract {contract!r} models bf16 q, k, v and o; tensor '{name}' is {t.dtype}")
    tensors = {n: t.detach().cpu() for n, t in inputs.items() if n in _INPUTS and t is not None}
    from ..goldens import kda_options

    opts = kda_options(params)
    if contract == "flashkda" and opts["beta"] == "sigmoid" and "beta" in tensors:
        # FlashKDA's sigmoid is 0.5 + 0.5 tanh.approx(x / 2): measured per bf16 logit (flashkda_sigmoid.py)
        from . import flashkda_sigmoid

        tensors["beta"], opts["beta"] = flashkda_sigmoid.sigmoid(tensors["beta"]), "as_given"
    out = _k3ref().kda_contract(tensors, contract, **opts, threads=params.get("threads", 2))
    return out["o"], out.get("final_state")


def reference_outputs(inputs, params):
    """(o, final_state) of the recurrence in double (k3ref.kda), as the contract sees them."""
    tensors = {n: t.detach().cpu() for n, t in inputs.items() if n in _INPUTS and t is not None}
    from ..goldens import kda_options

    out = _k3ref().kda(tensors, **kda_options(params), threads=params.get("threads", 2))
    return out["o"], out.get("final_state")


@dataclass
class ContractBound:
    tensor: str
    contract: str
    m: float
    contract_error: float   # rel RMS of the contract's tensor against the reference
    floor: float            # rel RMS of the reference rounded to bf16
    bound: float            # m * max(floor, contract_error)
    error: float = None     # the kernel's rel RMS against the reference (with a candidate)
    ratio: float = None     # error / max(floor, contract_error)
    passed: bool = None     # error <= bound (NaN/Inf in the kernel's tensor: False)

    def line(self):
        base = (f"{self.tensor}: contract {self.contract} error {self.contract_error:.3e}, bf16 floor "
                f"{self.floor:.3e}, bound {self.m:g} x max = {self.bound:.3e}")
        if self.error is None:
            return base
        verdict = "<=" if self.passed else ">"
        return (f"{self.tensor}: rel RMS {self.error:.3e} {verdict} {self.m:g} x max(bf16 floor {self.floor:.3e}, "
                f"contract {self.contract} {self.contract_error:.3e}) ({self.ratio:.3g}x)")


def contract_bounds(contract, inputs, params, candidate=None, m=None, reference=None, floor=None):
    """{tensor: ContractBound} for o and final_state (when the reference has one). candidate:
    the kernel's (o, final_state) in k3ref's conventions, to fill error/ratio/passed;
    reference: (o, final_state) in float64 if already computed (else k3ref.kda in double);
    floor: a function of the reference tensor giving its floor (default: its bf16 rounding's
    rel RMS; prop passes the larger of that and the nominal floor for its tiny cases)."""
    m = MULTIPLES[contract] if m is None else float(m)
    floor = _bf16_floor if floor is None else floor
    ref_o, ref_s = reference if reference is not None else reference_outputs(inputs, params)
    con_o, con_s = contract_outputs(contract, inputs, params)
    out = {}
    for name, ref, con, cand in (("o", ref_o, con_o, None if candidate is None else candidate[0]),
                                 ("final_state", ref_s, con_s, None if candidate is None else candidate[1])):
        if ref is None or con is None:
            continue
        ref = ref.to("cpu", torch.float64)
        if not bool(torch.isfinite(con).all()):  # e.g. FlashKDA's inverse decays overflow for steep gates
            raise ValueError(f"contracts: contract {contract!r} is not finite on these inputs ({name}: "
                             f"{int((~torch.isfinite(con)).sum())} of {con.numel()} values): no bound to judge by")
        ce, fl = _rel_rms(con, ref), floor(ref)
        b = ContractBound(name, contract, m, ce, fl, m * max(fl, ce))
        if cand is not None:
            c64 = cand.detach().to("cpu", torch.float64)
            if c64.shape != ref.shape:
                raise ValueError(f"contracts: tensor '{name}': kernel shape {list(c64.shape)} != reference "
                                 f"{list(ref.shape)}")
            finite = bool(torch.isfinite(c64).all())
            b.error = _rel_rms(c64, ref) if finite else math.inf
            scale = max(fl, ce)
            b.ratio = b.error / scale if scale > 0 else (0.0 if b.error == 0 else math.inf)
            b.passed = finite and b.error <= b.bound
        out[name] = b
    return out


def judge(adapter, inputs, params, o, final, reference, floor=None):
    """(passed, reason, bounds) of a kernel's (o, final_state) under its adapter's contract
    (adapter.contract_name, adapter.contract_multiple or MULTIPLES): every tensor the
    reference has must be returned and within its bound. A contract that cannot be evaluated
    raises (the caller reports an error: no verdict it cannot vouch for)."""
    ref_o, ref_s = reference
    if o is None or (ref_s is not None and final is None):
        missing = "o" if o is None else "final_state"
        return False, f"{missing}: the kernel returned None", {}
    bounds = contract_bounds(adapter.contract_name, inputs, params, candidate=(o, final),
                             m=getattr(adapter, "contract_multiple", None), reference=reference, floor=floor)
    passed = all(b.passed for b in bounds.values())
    return passed, "; ".join(b.line() for b in bounds.values()), bounds


def agreement(a, b, a_contract, b_contract, m, nominal_floor=None):
    """(ok, reason, ratio) for two kernel runs a, b that must agree (a split against one shot,
    varlen against separate runs): rel RMS(a - b) <= m * max(nominal floor, rel RMS of the
    two contract runs' difference). nominal_floor: the floor of b (default: the nominal bf16
    floor of its values, metrics.nominal_floor, as the harness's other metamorphic checks)."""
    d = _rel_rms(a, b.to(a.dtype))
    if not (torch.isfinite(a.double()).all() and torch.isfinite(b.double()).all()):
        return False, "NaN/Inf in a run", math.inf
    if nominal_floor is None:
        from . import metrics
        nominal_floor = metrics.nominal_floor(b, torch.bfloat16)
    fl = float(nominal_floor)
    cd = _rel_rms(a_contract, b_contract)
    scale = max(fl, cd)
    ratio = d / scale if scale > 0 else (0.0 if d == 0 else math.inf)
    ok = d <= m * scale
    return ok, (f"rel RMS of the difference {d:.3e} {'<=' if ok else '>'} {m:g} x max(floor {fl:.3e}, "
                f"the contract's own difference {cd:.3e}) ({ratio:.3g}x)"), ratio
