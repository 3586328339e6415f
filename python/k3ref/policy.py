"""The tolerance policy table (policy/policies.json) and the judge that applies it.

One table and one judge, k3ref::check (include/k3ref/check/policy_table.h, judgement.h),
bound through k3ref._core: `k3ref compare` and this module compute and judge every figure
in the same C++ code. The table gives per operator and output tensor the metric, the floor
dtype (the dtype the kernel's *contract* rounds that tensor to, not the dtype the candidate
happens to be stored in), the multiple or bound, and the names of the tensor's axes.
docs/tolerances.md documents every field.

API
---
judge(expected, candidate, op, policy="floor:2", *, tensors=None, known=(), table=None,
      contracts=None, floor_at_least=None, cu_seqlens=None, state_layout="k_first") -> Verdict
    expected   {name: tensor}  the golden case's expected outputs, in the golden's order
               (GoldenCase.expected, or every name of its `k3ref.outputs`)
    candidate  {name: tensor}  the kernel's tensors, any float or integer dtype, any device
    op         the golden's operator (`k3ref.op`), e.g. "kda.recurrent", "kda.backward"
    policy     a named policy of the table ("recurrent", "chunk", "flashkda", "fla-test", ...)
               or a parametric one: "exact", "floor:<m>", "rel-rms:<r>"
    tensors    judge only these outputs (each then required); default every golden output
    known      other tensor names of the golden file (its inputs) that a candidate may
               carry; they are ignored, not "unknown"
    table      a PolicyTable or a path; default the table shipped with k3ref
    contracts  {tensor: values} of the kernel's precision contract evaluated on the same
               inputs, for rules of metric "contract" (contract_values() evaluates them)
    floor_at_least {tensor: floor}: a lower limit on a tensor's floor (prop's tiny cases)
    cu_seqlens, state_layout: how worst elements are named (a varlen token is (sequence,
               position); a v_first state's last two axes are v, k)
  Verdict.exit_code: 0 every judged tensor passes; 1 a verdict failure (a figure over its
  bound, a NaN/Inf mismatch, a required output missing from the candidate); 2 unusable
  input (an unknown policy, operator or tensor name, a shape mismatch). Verdict.reason is
  one line; Verdict.results holds one TensorResult per golden output (metric, floor dtype,
  floor, figure, bound, ratio, pass/fail, reason, worst element: flat, per-axis and named
  index) plus one per unknown candidate tensor. Verdict.to_dict() is the JSON `k3ref
  compare --json` writes.

judge_figures(figures, op, tensor, policy, contract_error=0.0) -> TensorResult: the same rule
    applied to figures measured elsewhere (libk3gc's comparator on the device).
judge_agreement(rel_rms, first_nonfinite_mismatch, nominal_floor, least, multiple) -> dict:
    two runs of a kernel judged against each other (the metamorphic checks).
judge_case(case, candidate, policy, **kw)   the same for a golden case object (.op,
    .expected, .tensors, .params), e.g. k3ref.goldens' or gpu_check.golden's.
measure(candidate, reference, dtype) -> dict: check::compare's figures of one pair.
nominal_floor(values, dtype): the expected rel RMS of rounding values of these magnitudes.
load_table(path=None) -> PolicyTable; table_path() -> the default table's path.
describe_index(op, tensor, index, cu_seqlens=None, state_layout="k_first") -> "(batch 0, ...)".
expand_outputs("o,{qb,sign}_{bias,loads}") -> ["o", "qb_bias", "qb_loads", ...].
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

from ._data import compiled as _core
from ._data import FORMAT_NAMES, shipped_file, torch_code

TABLE_VERSION = 1
EXIT_PASS, EXIT_FAIL, EXIT_UNUSABLE = 0, 1, 2

# The table's format names of torch's floating dtypes.
FORMAT_OF = {getattr(torch, name): fmt for name, fmt in FORMAT_NAMES.items()}


class PolicyTableError(ValueError):
    """The table file is malformed (names the file and the entry)."""


@dataclass(frozen=True)
class Rule:
    metric: str               # exact | floor | rel-rms | max-abs-ulps | contract
    floor_dtype: str          # fp64 | fp32 | bf16 | fp16 | int
    multiple: float = 0.0     # floor: bound = multiple x floor; contract: multiple x max(floor, contract error)
    bound: float = 0.0        # rel-rms: the bound on the relative RMS error
    ulps: float = 0.0         # max-abs-ulps: bound = ulps x ulp(floor dtype at 1) x max(1, max|golden|)
    contract: str = ""        # contract: the precision contract's name ("fla_chunk")
    source: str = ""          # where the rule came from: "policies.chunk.kda.backward.dq" or "floor:2"


def table_path() -> Path:
    """The table shipped with k3ref: next to this file in an installed package, else the
    checkout's policy/policies.json."""
    return shipped_file("policies.json", "policy table")


class PolicyTable:
    """The parsed table (check::PolicyTable): every rule of every policy is resolved and
    checked when loaded, so a malformed table fails at load time, naming its entry."""

    def __init__(self, core_table: Any) -> None:
        self._t = core_table
        self.path = core_table.origin
        self.version = TABLE_VERSION
        self.operators = {op: core_table.operator(op) for op in core_table.operator_names()}
        self.about = {name: core_table.about(name) for name in core_table.policy_names()}

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None) -> PolicyTable:
        path = Path(path) if path is not None else table_path()
        try:
            return cls(_core().PolicyTable.load(str(path)))
        except ValueError as e:
            raise PolicyTableError(str(e)) from None

    def policy_names(self) -> list[str]:
        return sorted(self.about)

    def operators_of(self, policy: str) -> list[str]:
        return sorted(self._t.operators_of(policy))

    def rules(self, policy: str, op: str) -> dict[str, Rule]:
        """{tensor: Rule} for every output of `op` under `policy`. Raises KeyError with a
        one-line reason when the operator or policy is unknown or the policy does not cover it."""
        try:
            return {name: Rule(**r) for name, r in self._t.rules(policy, op).items()}
        except ValueError as e:
            raise KeyError(str(e)) from None

    def role(self, op: str, tensor: str) -> str:
        return self.operators[op]["outputs"][tensor]["role"]

    def axes(self, op: str | None, tensor: str) -> list[str]:
        """The names of a tensor's axes (k_first state layout); [] when the table names none.
        op None: the first operator (by name) with an output of that name."""
        for name in [op] if op is not None else sorted(self.operators):
            out = (self.operators.get(name) or {"outputs": {}})["outputs"].get(tensor)
            if out and out["axes"]:
                return list(out["axes"])
        return []

    def help(self) -> str:
        return self._t.help()


_DEFAULT: PolicyTable | None = None


def load_table(path: str | os.PathLike[str] | None = None) -> PolicyTable:
    """The table at `path`; the shipped one (loaded once) by default."""
    global _DEFAULT
    if path is not None:
        return PolicyTable.load(path)
    if _DEFAULT is None:
        _DEFAULT = PolicyTable.load()
    return _DEFAULT


def expand_outputs(spec: str) -> list[str]:
    """Names of a golden's `k3ref.outputs` (check::expand_outputs): comma-separated, where an
    item may hold brace groups, each expanded in order: "{qb,sign}_{bias,loads}" -> qb_bias,
    qb_loads, sign_bias, sign_loads. Raises ValueError on unbalanced or nested braces and past
    the C++ limits on the names' count and bytes."""
    return list(_core().expand_outputs(spec))


# ------------------------------------------------------------------------------- the figures

@dataclass
class TensorResult:
    tensor: str
    role: str = ""             # output | gradient | stage | "" (unknown to the table)
    required: bool = True
    status: str = "pass"       # pass | fail | missing | skipped | unknown | error
    passed: bool = False
    metric: str = ""
    floor_dtype: str = ""
    rule: str = ""             # where the rule came from
    figure: float = 0.0        # what the bound applies to: rel RMS, or max abs error (exact, max-abs-ulps)
    bound: float = 0.0
    floor: float = 0.0         # rel RMS of rounding the golden to floor_dtype
    ratio: float = 0.0         # rel RMS / floor
    rel_rms: float = 0.0
    max_abs: float = 0.0
    max_abs_index: int = -1
    worst_index: list[int] = field(default_factory=list)  # max_abs_index per axis of the golden's shape
    worst_at: str = ""         # worst_index with the axes named (describe_index)
    candidate_value: float = 0.0
    golden_value: float = 0.0
    max_ulp: float = 0.0
    max_ulp_index: int = -1
    count: int = 0
    candidate_nan: int = 0
    candidate_inf: int = 0
    first_nonfinite_mismatch: int = -1
    first_nonfinite_at: str = ""
    candidate_dtype: str = ""
    shape: list[int] = field(default_factory=list)
    contract: str = ""         # contract rules: the contract's name and its own rel RMS
    contract_error: float = 0.0
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}


@dataclass
class Verdict:
    op: str
    policy: str
    exit_code: int
    reason: str
    results: list[TensorResult]
    table: str = ""

    @property
    def passed(self) -> bool:
        return self.exit_code == EXIT_PASS

    @property
    def verdict(self) -> str:
        return ("pass", "fail", "unusable")[self.exit_code]

    def __getitem__(self, tensor: str) -> TensorResult:
        for r in self.results:
            if r.tensor == tensor:
                return r
        raise KeyError(tensor)

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "policy": self.policy, "policy_table_version": TABLE_VERSION,
                "verdict": self.verdict, "exit_code": self.exit_code, "reason": self.reason,
                "tensors": [r.to_dict() for r in self.results]}


def _values(t: Any) -> tuple[np.ndarray, str, bool]:
    """(float64 values, dtype name, numeric) of a tensor, as check::NamedValues holds them."""
    if not isinstance(t, torch.Tensor):  # NumPy arrays, lists: taken as they are
        t = torch.as_tensor(t)
    numeric = not (t.dtype == torch.bool or t.is_complex())
    values = t.detach().to("cpu", torch.float64) if numeric else torch.zeros(t.shape, dtype=torch.float64)
    return values.contiguous().numpy(), (torch_code(t.dtype) or str(t.dtype)), numeric


def measure(candidate: Any, reference: Any, dtype: str | torch.dtype) -> dict[str, Any]:
    """check::compare's figures of candidate against reference (flattened; dtype: the format
    whose rounding of the reference is the floor, a table name or a torch dtype)."""
    fmt = FORMAT_OF.get(dtype, dtype) if isinstance(dtype, torch.dtype) else dtype
    return _core().compare(_values(candidate)[0].reshape(-1), _values(reference)[0].reshape(-1), fmt)


def nominal_floor(values: Any, dtype: str | torch.dtype) -> float:
    """check::nominal_floor: sqrt(mean(ulp^2 / 12)) / rms of the finite values in `dtype`."""
    fmt = FORMAT_OF.get(dtype, dtype) if isinstance(dtype, torch.dtype) else dtype
    return float(_core().nominal_floor(_values(values)[0].reshape(-1), fmt))


def describe_index(op: str | None, tensor: str, index: Sequence[int], cu_seqlens: Any = None,
                   state_layout: str = "k_first", table: PolicyTable | None = None) -> str:
    """check::describe_index: "(batch 0, token 12, head 1, channel 7)", the axes named by the
    policy table; a varlen token as "sequence s, position p"."""
    axes = (table or load_table()).axes(op, tensor)
    return _core().describe_index(axes, [int(i) for i in index], _seqlens(cu_seqlens), state_layout == "v_first")


def _seqlens(cu_seqlens: Any) -> list[int]:
    return [] if cu_seqlens is None else [int(x) for x in torch.as_tensor(cu_seqlens).reshape(-1).tolist()]


def judge(expected: Mapping[str, Any], candidate: Mapping[str, Any], op: str, policy: str = "floor:2", *,
          tensors: Iterable[str] | None = None, known: Iterable[str] = (),
          table: PolicyTable | str | os.PathLike[str] | None = None, contracts: Mapping[str, Any] | None = None,
          floor_at_least: Mapping[str, float] | None = None, cu_seqlens: Any = None,
          state_layout: str = "k_first") -> Verdict:
    """Judges every golden output of one case under `policy` (see the module docstring)."""
    if not isinstance(policy, str) or not isinstance(op, str):
        return Verdict(str(op), str(policy), EXIT_UNUSABLE, f"policy and op must be names (str), not "
                       f"{type(policy).__name__} and {type(op).__name__}", [])
    if not isinstance(table, PolicyTable):
        try:
            table = load_table(table)
        except (PolicyTableError, FileNotFoundError) as e:
            return Verdict(op, policy, EXIT_UNUSABLE, str(e), [])
    con: dict[tuple[str, str], Any] = {}
    if contracts:
        try:
            rules = table.rules(policy, op)
        except KeyError:
            rules = {}
        con = {(rules[n].contract, n): _values(v) for n, v in contracts.items() if n in rules and v is not None}
    j = _core().judge(table._t, op, policy, [(n, _values(v)) for n, v in expected.items()], list(known),
                      {n: _values(v) for n, v in candidate.items()}, None if tensors is None else list(tensors), con,
                      dict(floor_at_least or {}), _seqlens(cu_seqlens), state_layout == "v_first")
    return Verdict(j["op"], j["policy"], j["exit_code"], j["reason"], [TensorResult(**r) for r in j["tensors"]],
                   j["table"])


def judge_figures(figures: Mapping[str, Any], op: str, tensor: str, policy: str, *, contract_error: float = 0.0,
                  ulp_scale: float = 1.0, table: PolicyTable | None = None) -> TensorResult:
    """The one judge's verdict on figures measured elsewhere (check::judge_figures): the rule of
    `tensor` of `op` under `policy` applied to `figures` (compare's keys: rel_rms,
    floor_rel_rms, first_nonfinite_mismatch, ...), as judge() applies it after comparing on the
    host. For tensors compared where they lie (libk3gc's comparator on the device, its sums made
    figures by rel_rms_of_sums). KeyError (one line) for an unknown policy or operator."""
    try:
        r = _core().judge_figures((table or load_table())._t, policy, op, tensor, dict(figures), contract_error,
                                  ulp_scale)
    except ValueError as e:
        raise KeyError(str(e)) from None
    return TensorResult(**r)


def judge_agreement(rel_rms: float, first_nonfinite_mismatch: int, nominal_floor_: float, least: float,
                    multiple: float, least_name: str | None = None) -> dict[str, Any]:
    """check::judge_agreement: two runs of a kernel (no exact value) agree when the rel RMS of
    their difference is within `multiple` x max(the nominal floor, `least`: what a correct
    kernel's runs differ by, which `least_name` names in the reason; by default the carried
    state's error) and no value is finite in one run only. {"passed", "ratio", "reason"}."""
    named = {} if least_name is None else {"least_name": least_name}
    return dict(_core().judge_agreement(rel_rms, first_nonfinite_mismatch, nominal_floor_, least, multiple, **named))


def judge_case(case: Any, candidate: Mapping[str, Any], policy: str = "floor:2", **kw: Any) -> Verdict:
    """judge() for a golden case object with .op, .expected ({name: tensor}, golden order)
    and .tensors (every tensor of the file); its cu_seqlens and state layout name the axes."""
    tensors = getattr(case, "tensors", {}) or {}
    known = [n for n in tensors if n not in case.expected]
    params = getattr(case, "params", None)
    kw.setdefault("cu_seqlens", tensors.get("cu_seqlens"))
    kw.setdefault("state_layout", params.get("state_layout", "k_first") if isinstance(params, dict) else "k_first")
    return judge(case.expected, candidate, case.op, policy, known=known, **kw)


