"""Error metrics of the harness: the figures of k3ref::check (k3ref.policy.measure, the one
judge's compare, bound through k3ref._core), or of libk3gc's comparator when both tensors
are CUDA tensors and the library is loaded (the same definitions, summed on the device).
Verdicts are the policy table's (k3ref.policy.judge); this module only measures.
"""
import math
from dataclasses import dataclass, asdict

import torch

from .. import policy

FORMATS = tuple(policy.FORMAT_OF)  # the floating formats a floor can be taken in


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
    window_rel_rms: list = None  # error by token window, when asked for
    backend: str = "k3ref"

    @property
    def floor_ratio(self):
        return self.rel_rms / self.floor_rel_rms if self.floor_rel_rms > 0 else (0.0 if self.rel_rms == 0 else math.inf)

    def to_dict(self):
        d = asdict(self)
        d["floor_ratio"] = self.floor_ratio
        return d


_FIELDS = tuple(f for f in Metrics.__dataclass_fields__ if f not in ("window_rel_rms", "backend"))


def compare(candidate, reference, fmt=None, window_shape=None, backend="auto"):
    """Metrics of candidate against reference; fmt is the candidate's output format (default its dtype).

    window_shape = (inner, extent, window): error by token window (token t of the flat index
    i is (i // inner) % extent)."""
    fmt = fmt or candidate.dtype
    if fmt not in FORMATS:
        raise ValueError(f"no floating format for {fmt}")
    if candidate.numel() != reference.numel():
        raise ValueError(f"compare: {candidate.numel()} candidate elements, {reference.numel()} reference")
    if backend != "k3ref" and candidate.is_cuda and reference.is_cuda:
        from . import lib

        if lib.available():
            d = lib.compare(candidate, reference, fmt, window_shape=window_shape)
            # The device's sums made figures by the one rule of k3ref::check (rel_rms_of_sums).
            d["rel_rms"], d["floor_rel_rms"] = policy._core().rel_rms_of_sums([d["err_sq"], d["floor_sq"]],
                                                                             [d["ref_sq"], d["ref_sq"]])
            windows = None
            if "window_err_sq" in d:
                windows = list(policy._core().rel_rms_of_sums(d["window_err_sq"], d["window_ref_sq"]))
            return Metrics(backend="cuda", window_rel_rms=windows, **{k: d[k] for k in _FIELDS})
        if backend == "cuda":
            raise RuntimeError("libk3gc is not loaded: " + lib.load_error())
    d = policy.measure(candidate, reference, fmt)
    m = Metrics(**{k: d[k] for k in _FIELDS})
    if window_shape is not None:
        inner, extent, window = window_shape
        outer = candidate.numel() // (inner * extent) if inner * extent else 0
        x = candidate.detach().to("cpu", torch.float64).reshape(outer, extent, inner)
        r = reference.detach().to("cpu", torch.float64).reshape(outer, extent, inner)
        m.window_rel_rms = list(policy._core().rel_rms_by_window(x.numpy(), r.numpy(), 1, window))
    return m


def nominal_floor(values, fmt):
    """Expected rel RMS of rounding values of these magnitudes to fmt (k3ref::check::nominal_floor):
    the floor for comparing two runs of a kernel with each other (metamorphic checks), where
    no exact value exists."""
    return policy.nominal_floor(values, fmt)
