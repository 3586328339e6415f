"""The tolerance policy table (policy/policies.json) and the judge that applies it.

One table, read here and by `k3ref compare` (include/k3ref/check/policy_table.h), gives per
operator and output tensor the metric, the floor dtype (the dtype the kernel's *contract*
rounds that tensor to, not the dtype the candidate happens to be stored in) and the
multiple or bound. docs/tolerances.md documents every field. Pure Python + torch: this
module imports without the compiled k3ref module.

API
---
judge(expected, candidate, op, policy="floor:2", *, tensors=None, known=(), table=None) -> Verdict
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
  Verdict.exit_code: 0 every judged tensor passes; 1 a verdict failure (a figure over its
  bound, a NaN/Inf mismatch, a required output missing from the candidate); 2 unusable
  input (an unknown policy, operator or tensor name, a shape mismatch). Verdict.reason is
  one line; Verdict.results holds one TensorResult per golden output (metric, floor dtype,
  floor, figure, bound, ratio, pass/fail, reason, worst element: flat and per-axis index)
  plus one per unknown candidate tensor. Verdict.to_dict() is the JSON `k3ref compare
  --json` writes (the same keys and, on the CPU, bit-identical figures).

judge_case(case, candidate, policy, **kw)   the same for a golden case object (.op,
    .expected, .tensors), e.g. k3ref.goldens' or gpu_check.golden's.
load_table(path=None) -> PolicyTable; table_path() -> the default table's path.
expand_outputs("o,{qb,sign}_{bias,loads}") -> ["o", "qb_bias", "qb_loads", ...].

The figures are those of k3ref::check::compare: relative RMS error over finite pairs
(summed in index order, so on the CPU they equal the C++ figures bit for bit), the floor
= relative RMS of rounding the golden to the floor dtype, max abs error and its index
(the first maximum), max distance in ulps of the floor dtype.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

TABLE_FORMAT = "k3ref-policy-table"
TABLE_VERSION = 1

# Floor dtypes: (explicit mantissa bits, exponent of the smallest normal, of the smallest subnormal).
FLOAT_DTYPES = {
    "fp64": (52, -1022, -1074),
    "fp32": (23, -126, -149),
    "bf16": (7, -126, -133),
    "fp16": (10, -14, -24),
}
DTYPES = tuple(FLOAT_DTYPES) + ("int",)
ROLES = ("output", "gradient", "stage")
REQUIRED_ROLES = ("output", "gradient")  # a stage tensor is judged when the candidate has it
METRICS = ("exact", "floor", "rel-rms", "max-abs-ulps")

EXIT_PASS, EXIT_FAIL, EXIT_UNUSABLE = 0, 1, 2
_NUMBER = re.compile(r"([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


class PolicyTableError(ValueError):
    """The table file is malformed (names the file and the entry)."""


@dataclass(frozen=True)
class Rule:
    metric: str               # exact | floor | rel-rms | max-abs-ulps
    floor_dtype: str          # fp64 | fp32 | bf16 | fp16 | int
    multiple: float = 0.0     # floor: bound = multiple x floor
    bound: float = 0.0        # rel-rms: the bound on the relative RMS error
    ulps: float = 0.0         # max-abs-ulps: bound = ulps x ulp(floor dtype at 1) x max(1, max|golden|)
    source: str = ""          # where the rule came from: "policies.chunk.kda.backward.dq" or "floor:2"


def table_path() -> Path:
    """The table shipped with k3ref: next to this file in an installed package, else the
    checkout's policy/policies.json (python/k3ref/policy.py -> policy/policies.json)."""
    here = Path(__file__).resolve().parent
    for p in (here / "policies.json", here.parent.parent / "policy" / "policies.json"):
        if p.is_file():
            return p
    raise FileNotFoundError(f"k3ref policy table not found: looked for {here / 'policies.json'} and "
                            f"{here.parent.parent / 'policy' / 'policies.json'}")


def _positive(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise PolicyTableError(f"{where}: must be a positive number")
    return float(value)


def _only_keys(obj: Any, allowed: Iterable[str], where: str) -> None:
    if not isinstance(obj, dict):
        raise PolicyTableError(f"{where}: must be an object")
    extra = sorted(set(obj) - set(allowed))
    if extra:
        raise PolicyTableError(f"{where}: unknown key '{extra[0]}' (allowed: {', '.join(allowed)})")


class PolicyTable:
    """The parsed table. Every rule of every policy is resolved and checked when loaded, so
    a malformed table fails at load time, naming its entry, not in the middle of a judgement.
    The checks, their order and their messages are the C++ reader's (policy_table.cc)."""

    def __init__(self, data: Any, path: str | os.PathLike[str] = "<table>") -> None:
        self.path = str(path)
        where = self.path
        _only_keys(data, ("format", "version", "about", "operators", "policies"), where)
        if data.get("format") != TABLE_FORMAT:
            raise PolicyTableError(f"{where}: 'format' must be '{TABLE_FORMAT}'")
        version = data.get("version")
        if type(version) is not int or version != TABLE_VERSION:
            shown = json.dumps(version) if "version" in data else "(none)"
            raise PolicyTableError(f"{where}: version {shown} is not supported (this k3ref reads "
                                   f"version {TABLE_VERSION})")
        self.version = TABLE_VERSION
        operators = data.get("operators", {})
        if not isinstance(operators, dict):
            raise PolicyTableError(f"{where}: 'operators' must be an object")
        self.operators: dict[str, dict[str, Any]] = {}
        for op, entry in operators.items():
            w = f"{where}: operators.{op}"
            _only_keys(entry, ("inputs", "outputs", "about"), w)
            inputs = entry.get("inputs", [])
            if not isinstance(inputs, list) or not all(isinstance(n, str) for n in inputs):
                raise PolicyTableError(f"{w}.inputs: must be an array of names")
            if not isinstance(entry.get("outputs"), dict) or not entry["outputs"]:
                raise PolicyTableError(f"{w}: no outputs")
            outputs: dict[str, tuple[str, str]] = {}
            for name, spec in entry["outputs"].items():
                wo = f"{w}.outputs.{name}"
                _only_keys(spec, ("role", "dtype", "about"), wo)
                if _string(spec, "role", wo) not in ROLES:
                    raise PolicyTableError(f"{wo}: role must be one of {', '.join(ROLES)}")
                if _string(spec, "dtype", wo) not in DTYPES:
                    raise PolicyTableError(f"{wo}: dtype must be one of {', '.join(DTYPES)}")
                outputs[name] = (spec["role"], spec["dtype"])
            self.operators[op] = {"inputs": list(inputs), "outputs": outputs}
        policies = data.get("policies", {})
        if not isinstance(policies, dict):
            raise PolicyTableError(f"{where}: 'policies' must be an object")
        self._rules: dict[tuple[str, str], dict[str, Rule]] = {}  # (policy, op) -> {tensor: Rule}
        self.about: dict[str, str] = {}
        for name, pol in policies.items():
            w = f"{where}: policies.{name}"
            _only_keys(pol, ("about", "rules"), w)
            if name == "exact" or name.startswith(("floor:", "rel-rms:")):
                raise PolicyTableError(f"{w}: the name is reserved for the parametric policy")
            self.about[name] = pol["about"] if isinstance(pol.get("about"), str) else ""
            rules = pol.get("rules", {})
            if not isinstance(rules, dict):
                raise PolicyTableError(f"{w}.rules: must be an object")
            for op, by_key in rules.items():
                if op not in self.operators:
                    raise PolicyTableError(f"{w}.rules.{op}: no such operator in 'operators'")
                outputs = self.operators[op]["outputs"]
                # Allowed keys listed as the C++ reader lists them (outputs by name, then roles).
                _only_keys(by_key, sorted(outputs) + list(ROLES), f"{w}.rules.{op}")
                resolved: dict[str, Rule] = {}
                for tensor, (role, dtype) in outputs.items():
                    key = tensor if tensor in by_key else role
                    if key not in by_key:
                        raise PolicyTableError(f"{w}.rules.{op}: no rule for '{tensor}' (give one for the tensor "
                                               f"or for its role '{role}')")
                    resolved[tensor] = _rule_from(by_key[key], dtype, f"policies.{name}.{op}.{key}",
                                                  f"{w}.rules.{op}.{key}")
                self._rules[(name, op)] = resolved

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None) -> PolicyTable:
        path = Path(path) if path is not None else table_path()
        from ._bounded import load_json

        try:  # the package's bounded reader: a regular file, size first, no duplicate keys, bounded nesting
            data = load_json(path, "policy table", limit=4 << 20)
        except ValueError as e:
            raise PolicyTableError(str(e)) from None
        return cls(data, path)

    def policy_names(self) -> list[str]:
        return sorted(self.about)

    def operators_of(self, policy: str) -> list[str]:
        return sorted(op for p, op in self._rules if p == policy)

    def rules(self, policy: str, op: str) -> dict[str, Rule]:
        """{tensor: Rule} for every output of `op` under `policy`. Raises KeyError with a
        one-line reason when the operator or policy is unknown or the policy does not cover it."""
        if op not in self.operators:
            raise KeyError(f"operator '{op}' is not in the policy table {self.path} (known: "
                           f"{', '.join(sorted(self.operators))})")
        param = parse_parametric(policy)
        if param is not None:
            metric, value = param
            out: dict[str, Rule] = {}
            for tensor, (_, dtype) in self.operators[op]["outputs"].items():
                if dtype == "int" or metric == "exact":
                    out[tensor] = Rule("exact", dtype, source=policy)
                elif metric == "floor":
                    out[tensor] = Rule("floor", dtype, multiple=value, source=policy)
                else:
                    out[tensor] = Rule("rel-rms", dtype, bound=value, source=policy)
            return out
        if (policy, op) in self._rules:
            return self._rules[(policy, op)]
        if policy in self.policy_names():
            raise KeyError(f"policy '{policy}' has no rules for operator '{op}' (it covers "
                           f"{', '.join(self.operators_of(policy))})")
        raise KeyError(f"unknown tolerance policy '{policy}' (known: exact, floor:<m>, rel-rms:<r>, "
                       f"{', '.join(self.policy_names())})")

    def role(self, op: str, tensor: str) -> str:
        return self.operators[op]["outputs"][tensor][0]


def _string(obj: Mapping[str, Any], key: str, where: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        raise PolicyTableError(f"{where}: '{key}' must be a string")
    return value


def _rule_from(spec: Any, dtype: str, source: str, where: str) -> Rule:
    _only_keys(spec, ("metric", "multiple", "bound", "ulps", "floor_dtype", "about"), where)
    metric = _string(spec, "metric", where)
    if metric not in METRICS:
        raise PolicyTableError(f"{where}: metric must be one of {', '.join(METRICS)}")
    floor_dtype = _string(spec, "floor_dtype", where) if "floor_dtype" in spec else dtype
    if floor_dtype not in FLOAT_DTYPES and not (floor_dtype == "int" and dtype == "int"):
        raise PolicyTableError(f"{where}: floor_dtype must be one of {', '.join(FLOAT_DTYPES)}")
    if dtype == "int" and metric != "exact":
        raise PolicyTableError(f"{where}: an integer tensor takes the 'exact' metric")
    need = {"floor": "multiple", "rel-rms": "bound", "max-abs-ulps": "ulps"}.get(metric)
    for k in ("multiple", "bound", "ulps"):
        if k in spec and k != need:
            raise PolicyTableError(f"{where}: '{k}' does not apply to metric '{metric}'")
    kw: dict[str, Any] = {need: _positive(spec.get(need), f"{where}.{need}")} if need else {}
    return Rule(metric, floor_dtype, source=source, **kw)


def parse_parametric(name: str) -> tuple[str, float] | None:
    """(metric, value) of 'exact', 'floor:<m>', 'rel-rms:<r>'; None for any other name.
    Raises KeyError on a parametric prefix with a bad number."""
    if name == "exact":
        return ("exact", 0.0)
    for prefix, metric in (("floor:", "floor"), ("rel-rms:", "rel-rms")):
        if name.startswith(prefix):
            text = name[len(prefix):]
            # One spelling of a number for both readers (C++ uses the same pattern).
            value = float(text) if _NUMBER.fullmatch(text) else -1.0
            if not (value > 0 and math.isfinite(value)):
                raise KeyError(f"tolerance policy '{name}': '{text}' is not a positive number")
            return (metric, value)
    return None


_DEFAULT: PolicyTable | None = None


def load_table(path: str | os.PathLike[str] | None = None) -> PolicyTable:
    """The table at `path`; the shipped one (loaded once) by default."""
    global _DEFAULT
    if path is not None:
        return PolicyTable.load(path)
    if _DEFAULT is None:
        _DEFAULT = PolicyTable.load()
    return _DEFAULT


MAX_OUTPUT_NAMES = 131_072
MAX_OUTPUT_NAME_BYTES = 16 << 20


def expand_outputs(spec: str) -> list[str]:
    """Names of a golden's `k3ref.outputs`: comma-separated, where an item may hold brace
    groups, each expanded in order: "{qb,sign}_{bias,loads}" -> qb_bias, qb_loads, sign_bias,
    sign_loads. Raises ValueError on unbalanced or nested braces."""
    shown = spec if len(spec) <= 200 else spec[:200] + f"... ({len(spec)} characters)"
    # Every character but a separator or a brace is in some name at least once: a pattern
    # longer than the byte limit is refused before the character-by-character scan below.
    if len(spec) - spec.count(",") - spec.count("{") - spec.count("}") > MAX_OUTPUT_NAME_BYTES:
        raise ValueError(f"k3ref.outputs '{shown}': expands to more than {MAX_OUTPUT_NAME_BYTES} bytes of names "
                         "(the limit)")
    items: list[str]
    items, depth, cur = [], 0, ""
    for ch in spec:
        if ch == "{":
            depth += 1
            if depth > 1:
                raise ValueError(f"k3ref.outputs '{spec}': nested braces")
        elif ch == "}":
            depth -= 1
            if depth < 0:
                raise ValueError(f"k3ref.outputs '{spec}': unbalanced braces")
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    if depth != 0:
        raise ValueError(f"k3ref.outputs '{spec}': unbalanced braces")
    items.append(cur)
    names: list[str]
    names, name_bytes = [], 0

    def bounded(count: int, size: int) -> None:
        # The C++ limits (check::expand_outputs): "{a,b}" x 40 is 2^40 names, and 2^17 names of
        # 100 KB each are 13 GB; both are refused before they are built.
        if len(names) + count > MAX_OUTPUT_NAMES:
            raise ValueError(f"k3ref.outputs '{shown}': expands to more than {MAX_OUTPUT_NAMES} names (the limit)")
        if name_bytes + size > MAX_OUTPUT_NAME_BYTES:
            raise ValueError(f"k3ref.outputs '{shown}': expands to more than {MAX_OUTPUT_NAME_BYTES} bytes of names "
                             "(the limit)")

    for item in items:
        if not item:
            continue
        expanded = [""]
        rest = item
        while rest:
            i = rest.find("{")
            if i < 0:
                expanded = [e + rest for e in expanded]
                break
            j = rest.index("}", i)
            alternatives = rest[i + 1:j].split(",")
            bounded(len(expanded) * len(alternatives),
                    sum(len(e) + i + len(a) for e in expanded for a in alternatives))
            expanded = [e + rest[:i] + alt for e in expanded for alt in alternatives]
            rest = rest[j + 1:]
        bounded(len(expanded), sum(len(e) for e in expanded))
        names += expanded
        name_bytes += sum(len(e) for e in expanded)
    return names


# ------------------------------------------------------------------------------- the figures

def _spacing(ref: torch.Tensor, dtype: str) -> torch.Tensor:
    mant, emin, esub = FLOAT_DTYPES[dtype]
    mag = ref.abs()
    _, exponent = torch.frexp(mag)  # mag = f * 2^exponent, f in [0.5, 1)
    normal = torch.ldexp(torch.ones_like(mag), exponent - 1 - mant)
    return torch.where(mag >= 2.0 ** emin, normal, torch.full_like(mag, 2.0 ** esub))


def _round_to(ref: torch.Tensor, dtype: str) -> torch.Tensor:
    mant, emin, _ = FLOAT_DTYPES[dtype]
    s = _spacing(ref, dtype)
    out = torch.round(ref / s) * s  # half to even; ref / s is exact
    # Past the largest finite value, IEEE conversion (and num::round_to) gives +-inf.
    max_finite = (2.0 - 2.0 ** -mant) * 2.0 ** (1 - emin)
    return torch.where(out.abs() > max_finite, out.sign() * math.inf, out)


def _ordered_sum(x: torch.Tensor) -> float:
    # Index order, as k3ref::check::compare sums (CPU cumsum is a sequential loop): the
    # figures then equal the C++ ones bit for bit. On a GPU the order is the device's.
    if x.numel() == 0:
        return 0.0
    return float(x.sum()) if x.is_cuda else float(x.cumsum(0)[-1])


def _first_max(values: torch.Tensor, valid: torch.Tensor) -> tuple[float, int]:
    masked = torch.where(valid, values, torch.full_like(values, -1.0))
    top = float(masked.max())
    return top, int((masked == top).nonzero()[0, 0])


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
    candidate_value: float = 0.0
    golden_value: float = 0.0
    max_ulp: float = 0.0
    max_ulp_index: int = -1
    count: int = 0
    candidate_nan: int = 0
    candidate_inf: int = 0
    first_nonfinite_mismatch: int = -1
    candidate_dtype: str = ""
    shape: list[int] = field(default_factory=list)
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


_TORCH_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                torch.bool: "BOOL"}


def _e(x: float) -> str:
    return f"{x:.3e}"


def _measure(res: Any, x: torch.Tensor, r: torch.Tensor, rule: Rule) -> torch.Tensor:
    """Fills the figures of res (candidate x, golden r: flat float64 on one device)."""
    fmt = rule.floor_dtype if rule.floor_dtype in FLOAT_DTYPES else "fp64"
    res.count = x.numel()
    xn, rn = x.isnan(), r.isnan()
    res.candidate_nan, res.candidate_inf = int(xn.sum()), int(x.isinf().sum())
    xf, rf = x.isfinite(), r.isfinite()
    mismatch = (xf != rf) | (~xf & ~(xn & rn) & (x != r))
    if bool(mismatch.any()):
        res.first_nonfinite_mismatch = int(mismatch.nonzero()[0, 0])
    both = xf & rf
    # Not report fields (the C++ judgement's JSON has none): what the verdict rules read.
    res.finite_pairs, res.first_zero_sign_mismatch = int(both.sum()), -1
    zero = torch.zeros_like(x)
    diff = torch.where(both, (x - r).abs(), zero)
    rr = torch.where(both, r, zero)
    signs = both & (x == 0) & (r == 0) & (torch.signbit(x) != torch.signbit(r))
    if bool(signs.any()):
        res.first_zero_sign_mismatch = int(signs.nonzero()[0, 0])
    # Sums of squares scaled by a power of two near the largest magnitude compared, as two exact
    # factors in turn (k3ref::check::PowerOfTwoScale): plain squares overflow past 1e154 and
    # vanish below 1e-154. Exact wherever the plain sums were, so ordinary figures are unchanged.
    largest = float(torch.where(both, torch.maximum(x.abs(), r.abs()), zero).max()) if x.numel() else 0.0
    first = second = 1.0
    if largest > 0 and math.isfinite(largest):
        e = math.frexp(largest)[1]
        half = int(-e / 2)  # toward zero, as C++'s integer division
        first, second = math.ldexp(1.0, half), math.ldexp(1.0, -e - half)
    xs, rs = torch.where(both, x * first * second, zero), rr * first * second
    sd = xs - rs
    err_sq, ref_sq = _ordered_sum(sd * sd), _ordered_sum(rs * rs)
    fl = (_round_to(rr, fmt) - rr) * first * second
    floor_sq = _ordered_sum(fl * fl)
    res.rel_rms = math.sqrt(err_sq / ref_sq) if ref_sq > 0 else (math.inf if err_sq > 0 else 0.0)
    res.floor = math.sqrt(floor_sq / ref_sq) if ref_sq > 0 else 0.0
    res.ratio = res.rel_rms / res.floor if res.floor > 0 else (0.0 if res.rel_rms == 0 else math.inf)
    if bool(both.any()):
        res.max_abs, res.max_abs_index = _first_max(diff, both)
        res.max_ulp, res.max_ulp_index = _first_max(diff / _spacing(rr, fmt), both)
        res.candidate_value = float(x[res.max_abs_index])
        res.golden_value = float(r[res.max_abs_index])
    return both


def _apply_rule(res: Any, x: torch.Tensor, r: torch.Tensor, rule: Rule) -> None:
    both = _measure(res, x, r, rule)
    res.metric, res.floor_dtype, res.rule = rule.metric, rule.floor_dtype, rule.source
    # The ratio to the floor where there is one (a golden exact in the floor dtype has none).
    ratio = f"; {res.ratio:.3g}x" if res.floor > 0 else ""
    if rule.metric == "exact":
        res.figure, res.bound = res.max_abs, 0.0
        ok = res.max_abs == 0 and res.first_zero_sign_mismatch < 0
        why = ("bitwise equal" if ok else
               f"not equal: max abs error {_e(res.max_abs)} at flat index {res.max_abs_index}" if res.max_abs != 0 else
               f"not equal: 0.0 against -0.0 at flat index {res.first_zero_sign_mismatch}")
    elif rule.metric == "floor":
        res.figure, res.bound = res.rel_rms, rule.multiple * res.floor
        ok = res.rel_rms <= res.bound or res.max_abs == 0
        why = (f"rel RMS {_e(res.rel_rms)} {'<=' if ok else '>'} {_e(res.bound)} ({rule.multiple:g} x "
               f"{rule.floor_dtype} floor {_e(res.floor)}{ratio})")
        if not math.isfinite(res.floor):  # fail closed: an infinite floor would pass anything
            ok, why = False, f"the golden overflows {rule.floor_dtype}: its floor is infinite"
        elif res.floor >= 1:  # every value rounds to zero: a sign flip would pass
            ok = False
            why = f"the golden underflows {rule.floor_dtype}: every value rounds to zero there, its floor is 100 %"
    elif rule.metric == "rel-rms":
        res.figure, res.bound = res.rel_rms, rule.bound
        ok = res.rel_rms <= res.bound
        why = (f"rel RMS {_e(res.rel_rms)} {'<=' if ok else '>'} {_e(res.bound)} ({rule.floor_dtype} floor "
               f"{_e(res.floor)}{ratio})")
    else:  # max-abs-ulps
        mant = FLOAT_DTYPES[rule.floor_dtype][0]
        scale = max(1.0, float(torch.where(both, r.abs(), torch.zeros_like(r)).max())) if r.numel() else 1.0
        res.figure, res.bound = res.max_abs, rule.ulps * math.ldexp(1.0, -mant) * scale
        ok = res.max_abs <= res.bound
        why = (f"max abs error {_e(res.max_abs)} {'<=' if ok else '>'} {_e(res.bound)} ({rule.ulps:g} "
               f"{rule.floor_dtype} ulps of max(1, max |golden|) = {_e(scale)})")
    if res.first_nonfinite_mismatch >= 0:
        ok = False
        why = (f"NaN/Inf where the golden has none (or the reverse), first at flat index "
               f"{res.first_nonfinite_mismatch}")
    elif res.count > 0 and res.finite_pairs == 0:  # a figure over nothing vouches for nothing
        ok, why = False, f"no finite value compared ({res.count} non-finite pairs)"
    res.passed = ok
    res.status = "pass" if ok else "fail"
    res.reason = why


def _name_list(names: Iterable[str]) -> str:
    """A list of names for a one-line message: the first 8, then how many there are in all."""
    names = list(names)
    return ", ".join(names) if len(names) <= 8 else ", ".join(names[:8]) + f", ... ({len(names)} in all)"


def _unravel(index: int, shape: Sequence[int]) -> list[int]:
    out = []
    for extent in reversed(shape):
        out.append(index % extent if extent else 0)
        index //= extent if extent else 1
    return out[::-1]


def judge(expected: Mapping[str, Any], candidate: Mapping[str, Any], op: str, policy: str = "floor:2", *,
          tensors: Iterable[str] | None = None, known: Iterable[str] = (),
          table: PolicyTable | str | os.PathLike[str] | None = None) -> Verdict:
    """Judges every golden output of one case under `policy` (see the module docstring)."""
    if not isinstance(policy, str) or not isinstance(op, str):
        return Verdict(str(op), str(policy), EXIT_UNUSABLE, f"policy and op must be names (str), not "
                       f"{type(policy).__name__} and {type(op).__name__}", [])
    if not isinstance(table, PolicyTable):
        try:
            table = load_table(table)
        except (PolicyTableError, FileNotFoundError) as e:
            return Verdict(op, policy, EXIT_UNUSABLE, str(e), [])
    try:
        rules = table.rules(policy, op)
    except KeyError as e:
        return Verdict(op, policy, EXIT_UNUSABLE, e.args[0], [], table.path)
    outputs = list(expected)
    results: list[TensorResult]
    first: dict[int, str]
    results, first = [], {}

    def note(code: int, line: str) -> None:
        first.setdefault(code, line)

    for name in outputs:
        if name not in rules:
            note(EXIT_UNUSABLE, f"golden output '{name}' of operator '{op}' is not in the policy table")
    selected = outputs if tensors is None else list(tensors)
    for name in selected:
        if name not in expected:
            note(EXIT_UNUSABLE, f"no output '{name}' in the golden (outputs: {_name_list(outputs)})")
    accepted = set(outputs) | set(known) | set(table.operators[op]["inputs"])
    for name in candidate:
        if name not in accepted:
            results.append(TensorResult(name, required=False, status="unknown", reason=(
                f"candidate tensor '{name}' is neither an output nor an input of the golden "
                f"(outputs: {_name_list(outputs)})")))
            note(EXIT_UNUSABLE, results[-1].reason)
    if EXIT_UNUSABLE in first:
        return Verdict(op, policy, EXIT_UNUSABLE, first[EXIT_UNUSABLE], results, table.path)

    judged = 0
    for name in selected:
        rule = rules[name]
        role = table.role(op, name)
        ref = expected[name]
        if not isinstance(ref, torch.Tensor):
            ref = torch.as_tensor(ref)
        res = TensorResult(name, role=role, required=tensors is not None or role in REQUIRED_ROLES,
                           metric=rule.metric, floor_dtype=rule.floor_dtype, rule=rule.source,
                           shape=list(ref.shape))
        results.append(res)
        if name not in candidate:
            if res.required:
                res.status, res.reason = "missing", f"missing from the candidate (a required {role})"
                note(EXIT_FAIL, f"{name}: {res.reason}")
            else:
                res.status, res.passed = "skipped", True
                res.reason = f"not in the candidate (an optional {role} tensor)"
            continue
        cand = candidate[name]
        if not isinstance(cand, torch.Tensor):  # NumPy arrays, lists: taken as they are
            cand = torch.as_tensor(cand)
        res.candidate_dtype = _TORCH_NAMES.get(cand.dtype, str(cand.dtype))
        if list(cand.shape) != list(ref.shape):
            res.status = "error"
            res.reason = f"shape {list(cand.shape)} differs from the golden's {list(ref.shape)}"
            note(EXIT_UNUSABLE, f"{name}: {res.reason}")
            continue
        if cand.dtype == torch.bool or cand.is_complex():
            res.status, res.reason = "error", f"dtype {res.candidate_dtype} is not a numeric output"
            note(EXIT_UNUSABLE, f"{name}: {res.reason}")
            continue
        x = cand.detach().reshape(-1).to(torch.float64)
        r = ref.detach().reshape(-1).to(device=x.device, dtype=torch.float64)
        bad = (~r.isfinite()).nonzero()
        if bad.numel():
            res.status = "error"
            res.reason = (f"the golden holds a non-finite value (first at flat index {int(bad[0, 0])}): no verdict "
                          "can be vouched for against it")
            note(EXIT_UNUSABLE, f"{name}: {res.reason}")
            continue
        _apply_rule(res, x, r, rule)
        if res.max_abs_index >= 0:
            res.worst_index = _unravel(res.max_abs_index, res.shape)
        judged += 1
        if not res.passed:
            note(EXIT_FAIL, f"{name}: {res.reason}")
    if EXIT_UNUSABLE in first:
        return Verdict(op, policy, EXIT_UNUSABLE, first[EXIT_UNUSABLE], results, table.path)
    if EXIT_FAIL in first:
        return Verdict(op, policy, EXIT_FAIL, first[EXIT_FAIL], results, table.path)
    if judged == 0:
        return Verdict(op, policy, EXIT_FAIL, "no tensor was judged: the candidate holds none of the golden's outputs",
                       results, table.path)
    return Verdict(op, policy, EXIT_PASS, f"{judged} tensor(s) pass under policy '{policy}'", results, table.path)


def judge_case(case: Any, candidate: Mapping[str, Any], policy: str = "floor:2", **kw: Any) -> Verdict:
    """judge() for a golden case object with .op, .expected ({name: tensor}, golden order)
    and .tensors (every tensor of the file)."""
    known = [n for n in getattr(case, "tensors", {}) if n not in case.expected]
    return judge(case.expected, candidate, case.op, policy, known=known, **kw)
