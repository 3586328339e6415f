"""Precision contracts of the KDA kernels, for the harness's verdicts (docs/contracts.md).

A kernel adapter declares the contract of its kernel by name ("fla_recurrent", "fla_chunk",
"fla_chunk_safe_gate", "flashkda": kda/kernel_contracts.h, evaluated through
k3ref.kda_contract). The verdict is a rule of the policy table (metric "contract", policy
`policy_of(contract)`, its multiple m and the reason for m beside it), applied by the one
judge (k3ref.policy.judge):

    rel RMS(t_kernel - t_ref) <= m * max(floor, rel RMS(t_contract - t_ref))

with t_ref the fp64 recurrence, t_contract the contract evaluated on the *same inputs* the
kernel received (here), and floor the rel RMS of rounding t_ref to bf16. A kernel meets its
bound when its arithmetic is what it declares; a kernel far beyond its own contract has a defect.

For the metamorphic checks (split, varlen, ...) two kernel runs are compared with each other:
`agreement` bounds their difference by m * max(nominal floor, difference of the two contract
runs on the same inputs), since an ill-conditioned problem makes even the declared arithmetic
split differently from one shot (docs/contracts.md: the FLA chunk split case).

API:
    verdict = judge(contract, inputs, params, candidate, reference, op=..., floor_at_least=None)
        k3ref.policy.Verdict of the kernel's {"o", "final_state"} under the contract's policy
    multiple(contract): m of the contract's rule in the policy table
    contract_outputs(contract, inputs, params) -> (o, final_state) float64 CPU
    agreement(a, b, a_contract, b_contract, m) -> (ok, reason, ratio)
params: the golden / harness parameter names (gate, gate_base, lower_bound, beta, qk_l2norm,
scale, state_layout). Inputs: the kernel's tensors (any device); the chunk contracts model
bf16 q, k, v and o and are refused (ValueError, one line) for other dtypes.
"""
import math

import torch

from .. import policy
from .._references import kda, kda_contract, kda_options

CONTRACTS = ("fla_recurrent", "fla_chunk", "fla_chunk_safe_gate", "flashkda")

_INPUTS = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias", "cu_seqlens")


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
    opts = kda_options(params)
    if contract == "flashkda" and opts["beta"] == "sigmoid" and "beta" in tensors:
        # FlashKDA's sigmoid is 0.5 + 0.5 tanh.approx(x / 2): measured per bf16 logit (flashkda_sigmoid.py)
        from . import flashkda_sigmoid

        tensors["beta"], opts["beta"] = flashkda_sigmoid.sigmoid(tensors["beta"]), "as_given"
    out = kda_contract(tensors, contract, **opts, threads=params.get("threads", 2))
    return out["o"], out.get("final_state")


def reference_outputs(inputs, params):
    """(o, final_state) of the recurrence in double (k3ref.kda), as the contract sees them."""
    tensors = {n: t.detach().cpu() for n, t in inputs.items() if n in _INPUTS and t is not None}
    out = kda(tensors, **kda_options(params), threads=params.get("threads", 2))
    return out["o"], out.get("final_state")


def policy_of(contract):
    """The policy of the table whose rules are the contract's ("fla_chunk" -> "fla-chunk-contract")."""
    return contract.replace("_", "-") + "-contract"


def multiple(contract, op="kda.recurrent", tensor="o"):
    """m of the contract's rule for `tensor` of `op` in the policy table."""
    return policy.load_table().rules(policy_of(contract), op)[tensor].multiple


def judge(contract, inputs, params, candidate, reference, op="kda.recurrent", floor_at_least=None):
    """The one judge's Verdict on the kernel's tensors (candidate {"o", "final_state"}) under
    the contract's rules, against reference {name: float64 tensor} (every name given is
    judged and required); the contract is evaluated here on the kernel's inputs. A contract
    that cannot be evaluated, or is not finite there, raises ValueError (no verdict it
    cannot vouch for)."""
    con_o, con_s = contract_outputs(contract, inputs, params)
    con = {"o": con_o, "final_state": con_s}
    names = [n for n, t in reference.items() if t is not None]
    v = policy.judge({n: reference[n] for n in names}, {n: t for n, t in candidate.items() if t is not None}, op,
                     policy_of(contract), tensors=names, contracts={n: con[n] for n in names if con.get(n) is not None},
                     floor_at_least=floor_at_least)
    if v.exit_code == policy.EXIT_UNUSABLE:
        raise ValueError(f"contracts: contract {contract!r}: {v.reason}")
    return v


def agreement(a, b, a_contract, b_contract, m, nominal_floor=None):
    """(ok, reason, ratio) for two kernel runs a, b that must agree (a split against one shot,
    varlen against separate runs): rel RMS(a - b) <= m * max(nominal floor, rel RMS of the
    two contract runs' difference). nominal_floor: the floor of b (default: the nominal bf16
    floor of its values, as the harness's other metamorphic checks)."""
    if not (torch.isfinite(a.double()).all() and torch.isfinite(b.double()).all()):
        return False, "NaN/Inf in a run", math.inf  # no figure vouches for a run that holds one
    d = policy.measure(a, b.to(a.dtype), "bf16")
    fl = float(policy.nominal_floor(b, "bf16") if nominal_floor is None else nominal_floor)
    cd = policy.measure(a_contract, b_contract, "bf16")["rel_rms"]
    v = policy.judge_agreement(d["rel_rms"], d["first_nonfinite_mismatch"], fl, cd, m, "the contract's own difference")
    return v["passed"], v["reason"], v["ratio"]
