"""Error metrics and tolerance policies (docs/tolerances.md; same definitions as
k3ref::check in src/check/metrics.cc).

`compare` runs on the GPU through libk3gc when both tensors are CUDA tensors and the
library is loaded, and in PyTorch fp64 otherwise; the two paths compute the same figures.
"""
import math
from dataclasses import dataclass, asdict

import torch

# (explicit mantissa bits, exponent of the smallest normal, exponent of the smallest subnormal)
FORMATS = {
    torch.float64: (52, -1022, -1074),
    torch.float32: (23, -126, -149),
    torch.bfloat16: (7, -126, -133),
    torch.float16: (10, -14, -24),
}


@dataclass
class Metrics:
    count: int = 0
    rel_rms: float = 0.0
    floor_rel_rms: float = 0.0
    max_abs: float = 0.0
    max_abs_index: int = -1
    max_ulp: float = 0.0
    max_ulp_index: int = -1
    candidate_nan: int = 0
    candidate_inf: int = 0
    reference_nan: int = 0
    reference_inf: int = 0
    first_nonfinite_mismatch: int = -1
    first_offending: int = -1
    window_rel_rms: list = None  # error by token window, when asked for
    backend: str = "torch"

    @property
    def floor_ratio(self):
        return self.rel_rms / self.floor_rel_rms if self.floor_rel_rms > 0 else (0.0 if self.rel_rms == 0 else math.inf)

    def to_dict(self):
        d = asdict(self)
        d["floor_ratio"] = self.floor_ratio
        return d


def spacing(ref, fmt):
    """Spacing of format `fmt` (a torch dtype) at |ref| (float64 tensor), subnormal spacing below normals."""
    mant, emin, esub = FORMATS[fmt]
    mag = ref.abs()
    _, exponent = torch.frexp(mag)  # mag = f * 2^exponent, f in [0.5, 1)
    normal = torch.ldexp(torch.ones_like(mag), (exponent - 1 - mant))
    return torch.where(mag >= 2.0**emin, normal, torch.full_like(mag, 2.0**esub))


def round_to(ref, fmt):
    """Round-to-nearest-even of float64 values into `fmt`, returned as float64 (no double rounding)."""
    s = spacing(ref, fmt)
    return torch.round(ref / s) * s  # torch.round rounds half to even; ref / s is exact


def compare_torch(candidate, reference, fmt, atol=0.0, rtol=0.0, window_shape=None):
    x = candidate.detach().reshape(-1).to(torch.float64)
    r = reference.detach().reshape(-1).to(torch.float64, copy=False).to(x.device)
    m = Metrics(count=x.numel(), backend="torch")
    xn, rn, xi, ri = x.isnan(), r.isnan(), x.isinf(), r.isinf()
    m.candidate_nan, m.reference_nan = int(xn.sum()), int(rn.sum())
    m.candidate_inf, m.reference_inf = int(xi.sum()), int(ri.sum())
    xf, rf = x.isfinite(), r.isfinite()
    mismatch = (xf != rf) | (~xf & ~(xn & rn) & (x != r))
    if bool(mismatch.any()):
        m.first_nonfinite_mismatch = int(mismatch.nonzero()[0, 0])
    both = xf & rf
    diff = torch.where(both, (x - r).abs(), torch.zeros_like(x))
    rr = torch.where(both, r, torch.zeros_like(r))
    err_sq = float((diff * diff).sum())
    ref_sq = float((rr * rr).sum())
    fl = round_to(rr, fmt) - rr
    floor_sq = float((fl * fl).sum())
    m.rel_rms = math.sqrt(err_sq / ref_sq) if ref_sq > 0 else (math.inf if err_sq > 0 else 0.0)
    m.floor_rel_rms = math.sqrt(floor_sq / ref_sq) if ref_sq > 0 else 0.0
    if both.any():
        masked = torch.where(both, diff, torch.full_like(diff, -1.0))
        m.max_abs = float(masked.max())
        m.max_abs_index = int((masked == m.max_abs).nonzero()[0, 0])
        ulps = torch.where(both, diff / spacing(rr, fmt), torch.full_like(diff, -1.0))
        m.max_ulp = float(ulps.max())
        m.max_ulp_index = int((ulps == m.max_ulp).nonzero()[0, 0])
    bad = mismatch | (both & (diff > atol + rtol * rr.abs()))
    if bool(bad.any()):
        m.first_offending = int(bad.nonzero()[0, 0])
    if window_shape is not None:
        inner, extent, window = window_shape
        idx = torch.arange(x.numel(), device=x.device)
        w = (idx // inner) % extent // window
        nw = (extent + window - 1) // window
        e = torch.zeros(nw, dtype=torch.float64, device=x.device).index_add_(0, w, diff * diff)
        f = torch.zeros(nw, dtype=torch.float64, device=x.device).index_add_(0, w, rr * rr)
        m.window_rel_rms = [math.sqrt(a / b) if b > 0 else math.sqrt(a) for a, b in zip(e.tolist(), f.tolist())]
    return m


def compare(candidate, reference, fmt=None, atol=0.0, rtol=0.0, window_shape=None, backend="auto"):
    """Metrics of candidate against reference; fmt is the candidate's output format (default its dtype).

    window_shape = (inner, extent, window): error by token window (see k3gc_compare)."""
    fmt = fmt or candidate.dtype
    if fmt not in FORMATS:
        raise ValueError(f"no floating format for {fmt}")
    if candidate.numel() != reference.numel():
        raise ValueError(f"compare: {candidate.numel()} candidate elements, {reference.numel()} reference")
    if backend != "torch" and candidate.is_cuda and reference.is_cuda:
        from . import lib

        if lib.available():
            return Metrics(backend="cuda", **lib.compare(candidate, reference, fmt, atol, rtol, window_shape))
        if backend == "cuda":
            raise RuntimeError("libk3gc is not loaded: " + lib.load_error())
    return compare_torch(candidate, reference, fmt, atol, rtol, window_shape)


@dataclass
class Policy:
    kind: str  # exact | floor | rel-rms
    bound: float
    name: str


def parse_policy(name, op="kda.recurrent", tensor="o"):
    """The policy `name` as (kind, bound) for one tensor: "exact", "floor:<m>", "rel-rms:<r>",
    or a named policy of the one policy table (k3ref.policy, policy/policies.json), whose rule
    for `tensor` of `op` gives the metric and the multiple or bound."""
    from .. import policy as table_policy

    try:  # the one parser of parametric names (k3ref.policy; C++ spells numbers the same way)
        parametric = table_policy.parse_parametric(name)
    except KeyError as e:
        raise ValueError(str(e).strip("'\"")) from None
    if parametric is not None:
        return Policy(parametric[0], parametric[1], name)
    table = table_policy.load_table()
    try:
        rule = table.rules(name, op)[tensor]
    except KeyError:
        raise ValueError(f"unknown tolerance policy '{name}' for {op} (exact, floor:<m>, rel-rms:<r>, "
                         f"{', '.join(table.policy_names())})") from None
    if rule.metric == "floor":
        return Policy("floor", rule.multiple, name)
    if rule.metric == "rel-rms":
        return Policy("rel-rms", rule.bound, name)
    return Policy("exact", 0.0, name)


def judge(m, policy):
    """(passed, one-line reason) of metrics under a policy."""
    if m.first_nonfinite_mismatch >= 0:
        return False, (f"NaN/Inf where the reference has none (or the reverse), first at flat index "
                       f"{m.first_nonfinite_mismatch} ({m.candidate_nan} NaN, {m.candidate_inf} Inf)")
    if policy.kind == "exact":
        if m.max_abs == 0:
            return True, "bitwise equal"
        return False, f"not equal: max abs error {m.max_abs:.3e} at flat index {m.max_abs_index}"
    if policy.kind == "floor":
        bound = policy.bound * m.floor_rel_rms
        ratio = f"{m.floor_ratio:.3g}x floor" if m.floor_rel_rms > 0 else "n/a"
        ok = m.rel_rms <= bound or m.max_abs == 0
        op = "<=" if ok else ">"
        return ok, (f"rel RMS {m.rel_rms:.3e} {op} {bound:.3e} ({policy.bound:g} x floor "
                    f"{m.floor_rel_rms:.3e}; {ratio})")
    ok = m.rel_rms <= policy.bound
    return ok, f"rel RMS {m.rel_rms:.3e} {'<=' if ok else '>'} {policy.bound:.3e}"


def nominal_floor(values, fmt):
    """Expected rel RMS of rounding values of these magnitudes to fmt: sqrt(mean(ulp^2 / 12)) / rms.

    The floor for comparing two runs of a kernel with each other (metamorphic checks), where
    no exact value exists: a rounding error uniform over one ulp has variance ulp^2 / 12."""
    x = values.detach().reshape(-1).to(torch.float64)
    x = x[x.isfinite()]
    if x.numel() == 0:
        return 0.0
    s = spacing(x, fmt)
    rms = float(x.pow(2).mean().sqrt())
    return math.sqrt(float((s * s).mean()) / 12.0) / rms if rms > 0 else 0.0
