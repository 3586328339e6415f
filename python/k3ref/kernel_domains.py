"""Kernel domains (policy/kernel_domains.json, docs/kernel-domains.md): what each kernel accepts
(golden operators, head sizes, GVA ratio HV/H, gates and their bases, beta forms, layouts,
varlen, initial state, input dtypes). The harness judges a kernel on the goldens inside its
domain and reports the others as not applicable; `k3ref golden list --kernel` (the C++ reader,
io/kernel_domains.h) lists the same goldens, with the same reasons. A user's adapter declares
its own domain in the same schema (its `domain` attribute: a dict, or a KernelDomain); None
accepts everything. The shipped file is read by k3ref.kernel_domains_file; this module, the
schema and its verdicts, imports nothing of the package, so that the adapter protocol
(k3ref.gpu_check.protocol) judges an adapter's declared domain without the file's readers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FORMAT = "k3ref-kernel-domains"
VERSION = 1
SIZE_KEYS = ("B", "T", "H", "HV", "K", "V", "gva_ratio")
KERNEL_KEYS = ("about", "ops", *SIZE_KEYS, "varlen", "initial_state", "gates", "betas", "qk_l2norm",
               "state_layouts", "input_dtypes")
MAX_DEPTH = 16


class KernelDomainError(ValueError):
    """A malformed domain (file or adapter attribute), in one line naming the entry."""


def _only_keys(obj, allowed, where):
    if not isinstance(obj, dict):
        raise KernelDomainError(f"{where}: must be an object")
    for key in obj:
        if key not in allowed:
            raise KernelDomainError(f"{where}: unknown key {key[:60]!r} (allowed: {', '.join(allowed)})")


def _number(v, where):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (float("inf"), float("-inf")):
        raise KernelDomainError(f"{where}: must be a finite number")
    return float(v)


def _list(v, kind, where):
    if not isinstance(v, list) or not v:
        raise KernelDomainError(f"{where}: must be a non-empty list")
    if not all(isinstance(x, kind) for x in v):
        raise KernelDomainError(f"{where}: must hold {'strings' if kind is str else 'true or false'}")
    return list(v)


def _num(x: float) -> str:
    return "%g" % x  # as the C++ reader prints it (%g)


@dataclass
class Range:
    """A set of numbers: the listed values (`values`), or the interval its bounds leave."""

    values: list = field(default_factory=list)
    min: float | None = None
    max: float | None = None
    above: float | None = None
    below: float | None = None

    @classmethod
    def from_json(cls, j, where):
        _only_keys(j, ("in", "min", "max", "above", "below"), where)
        if not j:
            raise KernelDomainError(f"{where}: must bound something (in, min, max, above or below)")
        r = cls()
        if "in" in j:
            if len(j) != 1:
                raise KernelDomainError(f"{where}: 'in' takes no bound beside it")
            if not isinstance(j["in"], list) or not j["in"]:
                raise KernelDomainError(f"{where}.in: must be a non-empty list")
            r.values = [_number(x, f"{where}.in") for x in j["in"]]
        for key in ("min", "max", "above", "below"):
            if key in j:
                setattr(r, key, _number(j[key], f"{where}.{key}"))
        if (r.min is not None and r.above is not None) or (r.max is not None and r.below is not None):
            raise KernelDomainError(f"{where}: min/above and max/below: one of each at most")
        return r

    def holds(self, x: float) -> bool:
        if self.values:
            return x in self.values
        return not ((self.min is not None and x < self.min) or (self.above is not None and x <= self.above)
                    or (self.max is not None and x > self.max) or (self.below is not None and x >= self.below))

    def text(self, label: str) -> str:
        if len(self.values) == 1:
            return f"{label} = {_num(self.values[0])}"
        if self.values:
            return f"{label} in {{{', '.join(_num(x) for x in self.values)}}}"
        low = self.min if self.min is not None else self.above
        high = self.max if self.max is not None else self.below
        if low is not None and high is not None:
            return (f"{label} in {'[' if self.min is not None else '('}{_num(low)}, "
                    f"{_num(high)}{']' if self.max is not None else ')'}")
        if low is not None:
            return f"{label} {'>=' if self.min is not None else '>'} {_num(low)}"
        return f"{label} {'<=' if self.max is not None else '<'} {_num(high)}"


@dataclass
class Gate:
    form: str
    bases: list = field(default_factory=list)  # empty: any
    lower_bound: Range | None = None
    A_log: bool | None = None                  # True: needs A_log; False: refuses it; None: either


def _listed(label, value, allowed, show=str):
    if value in allowed:
        return None
    return f"{label} {show(value)}: the kernel takes {label} {', '.join(show(a) for a in allowed)}"


def _yes_no(b):
    return "yes" if b else "no"


@dataclass
class KernelDomain:
    """What one kernel accepts; None (a key left out) accepts everything."""

    name: str = ""
    about: str = ""
    ops: list | None = None
    sizes: dict = field(default_factory=dict)  # B, T, H, HV, K, V, gva_ratio -> Range
    varlen: bool | None = None
    initial_state: list | None = None
    qk_l2norm: list | None = None
    gates: list | None = None
    betas: list | None = None
    state_layouts: list | None = None
    input_dtypes: list | None = None

    @classmethod
    def from_json(cls, j, name="", where=None):
        where = where or f"domain of {name or 'an adapter'}"
        _only_keys(j, KERNEL_KEYS, where)
        if not isinstance(j.get("about", ""), str):
            raise KernelDomainError(f"{where}: 'about' must be a string")
        d = cls(name=name, about=j.get("about", ""))
        d.sizes = {k: Range.from_json(j[k], f"{where}.{k}") for k in SIZE_KEYS if k in j}
        for key in ("ops", "betas", "state_layouts", "input_dtypes"):
            if key in j:
                setattr(d, key, _list(j[key], str, f"{where}.{key}"))
        for key in ("initial_state", "qk_l2norm"):
            if key in j:
                setattr(d, key, _list(j[key], bool, f"{where}.{key}"))
        if "varlen" in j:
            if not isinstance(j["varlen"], bool):
                raise KernelDomainError(f"{where}.varlen: must be true or false")
            d.varlen = j["varlen"]
        if "gates" in j:
            if not isinstance(j["gates"], list) or not j["gates"]:
                raise KernelDomainError(f"{where}.gates: must be a non-empty list")
            d.gates = []
            for i, g in enumerate(j["gates"]):
                w = f"{where}.gates[{i}]"
                _only_keys(g, ("form", "bases", "lower_bound", "A_log"), w)
                if not isinstance(g.get("form"), str):
                    raise KernelDomainError(f"{w}: 'form' must be a string")
                if any(o.form == g["form"] for o in d.gates):
                    raise KernelDomainError(f"{w}: gate {g['form'][:60]!r} listed twice")
                if "A_log" in g and not isinstance(g["A_log"], bool):
                    raise KernelDomainError(f"{w}.A_log: must be true or false")
                d.gates.append(Gate(g["form"], _list(g["bases"], str, f"{w}.bases") if "bases" in g else [],
                                    Range.from_json(g["lower_bound"], f"{w}.lower_bound") if "lower_bound" in g else None,
                                    g.get("A_log")))
        return d

    def outside(self, op: str, params: dict, shapes: dict | None = None, input_dtype: str | None = None) -> str | None:
        """None when a case of operator `op` with golden parameters `params` (its sizes taken
        from `shapes` where given, as protocol.shapes_of returns them) and inputs in
        `input_dtype` ("bf16") is inside the domain, else why not (the C++ reader's words).
        A parameter the case does not have constrains nothing."""
        if self.ops is not None and op is not None and (why := _listed("operator", op, self.ops)):
            return why
        if self.input_dtypes is not None and input_dtype is not None and (why := _listed("inputs", input_dtype, self.input_dtypes)):
            return why
        sizes = {k: params[k] for k in ("B", "T", "H", "HV", "K", "V") if _is_number(params.get(k))}
        sizes.update(shapes or {})
        if "H" in sizes and "HV" in sizes:
            sizes["gva_ratio"] = sizes["HV"] / sizes["H"]
        for key in SIZE_KEYS:
            r = self.sizes.get(key)
            if r is not None and key in sizes and not r.holds(float(sizes[key])):
                label = "HV/H" if key == "gva_ratio" else key
                return f"{label} = {_num(float(sizes[key]))}: the kernel takes {r.text(label)}"
        if self.varlen is False and params.get("cu_seqlens") is not None:
            return "varlen (cu_seqlens): the kernel takes no varlen"
        flag = lambda key: params[key] if isinstance(params.get(key), bool) else None  # noqa: E731
        text = lambda key: params[key] if isinstance(params.get(key), str) else None  # noqa: E731
        if self.initial_state is not None and flag("initial_state") is not None and \
                (why := _listed("initial_state", flag("initial_state"), self.initial_state, _yes_no)):
            return why
        form = text("gate")
        if self.gates is not None and form is not None:
            g = next((d for d in self.gates if d.form == form), None)
            if g is None:
                return f"gate {form}: the kernel takes gate {', '.join(d.form for d in self.gates)}"
            base = text("gate_base")
            if base is not None and g.bases and (why := _listed(f"gate {form} in base", base, g.bases)):
                return why
            if g.lower_bound is not None:
                lb = params.get("lower_bound")
                if not _is_number(lb):
                    return f"gate {form} without lower_bound: the kernel takes {g.lower_bound.text('lower_bound')}"
                if not g.lower_bound.holds(float(lb)):
                    return f"lower_bound = {_num(float(lb))}: the kernel takes {g.lower_bound.text('lower_bound')}"
            a = flag("A_log")
            if a is not None and g.A_log is not None and a != g.A_log:
                return (f"gate {form} {'with' if a else 'without'} A_log: the kernel takes it "
                        f"{'with' if g.A_log else 'without'} A_log")
        if self.betas is not None and text("beta") is not None and (why := _listed("beta", text("beta"), self.betas)):
            return why
        if self.qk_l2norm is not None and flag("qk_l2norm") is not None and \
                (why := _listed("qk_l2norm", flag("qk_l2norm"), self.qk_l2norm, _yes_no)):
            return why
        if self.state_layouts is not None and text("state_layout") is not None and \
                (why := _listed("state_layout", text("state_layout"), self.state_layouts)):
            return why
        return None


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def parse(data: Any, origin: str) -> dict[str, KernelDomain]:
    """{kernel name: KernelDomain} of a kernel-domains document (checked whole)."""
    _only_keys(data, ("format", "version", "about", "kernels"), origin)
    if data.get("format") != FORMAT:
        raise KernelDomainError(f"{origin}: 'format' must be '{FORMAT}'")
    if data.get("version") != VERSION or isinstance(data.get("version"), bool):
        raise KernelDomainError(f"{origin}: 'version' must be {VERSION}")
    if not isinstance(data.get("kernels"), dict):
        raise KernelDomainError(f"{origin}: 'kernels' must be an object")
    out = {}
    for name in sorted(data["kernels"]):
        j = data["kernels"][name]
        if not isinstance(j, dict) or not isinstance(j.get("about"), str):
            raise KernelDomainError(f"{origin}: kernels.{name}: 'about' must be a string")
        out[name] = KernelDomain.from_json(j, name, f"{origin}: kernels.{name}")
    return out


def domain_of(declared: Any, name: str = "") -> KernelDomain | None:
    """An adapter's `domain` attribute as a KernelDomain: None (everything), a KernelDomain, or
    a dict in the file's schema (checked)."""
    if declared is None or isinstance(declared, KernelDomain):
        return declared
    return KernelDomain.from_json(declared, name)
