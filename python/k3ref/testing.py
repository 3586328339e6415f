"""assert_kda_close: torch.testing.assert_close for kernels judged against k3ref goldens.

    from k3ref.testing import assert_kda_close
    case = k3ref.goldens.load_case("kda_varlen")
    assert_kda_close({"o": o, "final_state": ht}, case, policy="recurrent")

The judging is k3ref.policy's (the policy table, the same verdicts as `k3ref compare`): each
expected output gets its metric, floor dtype and bound; a required output the candidate
lacks fails; a candidate tensor that is neither an output nor an input of the golden makes
the call unusable. On failure an AssertionError names, per failing tensor, the figure and
its bound, the worst element by its (batch, token, head, channel) index with both values,
and the reason. An unknown policy or operator raises ValueError.
"""
from __future__ import annotations

import os
from typing import Any, Iterable, Mapping, Sequence

import torch

from . import policy as _policy


def format_index(tensor: str, index: Sequence[int], state_layout: str = "k_first", op: str | None = None,
                 cu_seqlens: Any = None) -> str:
    """"(batch 0, token 12, head 1, channel 7)" for a per-axis index of an output of `op` (None:
    any operator with an output of that name): the
    axes the policy table names (k3ref.policy.describe_index, the rule `k3ref compare` prints
    by); a varlen token as "sequence s, position p"."""
    return _policy.describe_index(op, tensor, index, cu_seqlens, state_layout)


def _line(r: _policy.TensorResult) -> str:
    """One failing tensor: its reason (the policy judge's), the figure and bound, the worst element."""
    line = f"{r.tensor}: {r.reason or r.status}"
    if r.status in ("missing", "unknown", "error"):
        return line
    if r.first_nonfinite_mismatch >= 0:  # the figure is over the finite pairs only: name the NaN/Inf instead
        return (f"{line}; {r.candidate_nan} NaN and {r.candidate_inf} Inf in the candidate, the first mismatch at "
                f"{r.first_nonfinite_at}")
    line += f" [{r.metric}: figure {r.figure:.3e}, bound {r.bound:.3e}]"
    if r.worst_index and r.max_abs > 0:
        line += (f"; worst element at {r.worst_at}: candidate "
                 f"{r.candidate_value!r}, golden {r.golden_value!r} (abs error {r.max_abs:.3e})")
    return line


# FLA's KDA functions return (o, final_state); a tuple or list is read in that order.
RETURN_ORDER = ("o", "final_state")


def _recommended_policy(case: Any) -> str:
    """The one policy a golden case recommends for its outputs ("floor:2" for plain tensors)."""
    named = set((getattr(case, "recommended_policies", None) or {}).values())
    if not named:
        return "floor:2"
    if len(named) > 1:
        raise ValueError(f"assert_kda_close: the golden recommends {len(named)} policies ({', '.join(sorted(named))}); "
                         "pass policy= to name one")
    return named.pop()


def assert_kda_close(actual: torch.Tensor | Mapping[str, Any] | tuple[Any, ...] | list[Any],
                     expected_or_case: Any, policy: str = "recommended", *, op: str | None = None,
                     tensors: Iterable[str] | None = None, name: str = "o", msg: str | None = None,
                     table: _policy.PolicyTable | str | os.PathLike[str] | None = None) -> _policy.Verdict:
    """Judges `actual` against a golden and raises AssertionError unless every judged
    tensor passes.

    actual            {name: tensor} (any float dtype, any device), one tensor (named `name`), or
                      a tuple in FLA's return order (o, final_state); None entries are left out
    expected_or_case  a golden case (k3ref.goldens.GoldenCase, or any object with .op,
                      .expected and .tensors), or {name: tensor} / one tensor of expected
                      values (then `op`, the golden operator such as "kda.recurrent", is required)
    policy            "recommended" (default: the policy the golden recommends for its outputs,
                      k3ref.policies; with plain expected tensors, "floor:2"), a policy of
                      the table ("recurrent", "chunk", ...) or "exact", "floor:<m>", "rel-rms:<r>"
    tensors           judge only these outputs (each then required); default every output
    msg               replaces the first line of the failure message
    Returns the k3ref.policy.Verdict on success."""
    __tracebackhide__ = True  # pytest shows the caller's line, not this function's
    if isinstance(actual, torch.Tensor):
        actual = {name: actual}
    elif isinstance(actual, (tuple, list)):
        if len(actual) > len(RETURN_ORDER):
            raise TypeError(f"assert_kda_close: a tuple of actual outputs is read as {RETURN_ORDER} (FLA's order); "
                            f"got {len(actual)} items")
        actual = {n: t for n, t in zip(RETURN_ORDER, actual) if t is not None}
    if not hasattr(actual, "keys"):
        raise TypeError(f"assert_kda_close: actual must be a tensor or a mapping of names to tensors, not "
                        f"{type(actual).__name__}")
    case = expected_or_case
    layout, cu_seqlens = "k_first", None
    if hasattr(case, "expected") and hasattr(case, "op"):
        expected, op = case.expected, op or case.op
        known = [n for n in getattr(case, "tensors", {}) if n not in expected]
        params = getattr(case, "params", {}) or {}
        layout = params.get("state_layout", "k_first") if isinstance(params, dict) else layout
        cu_seqlens = (getattr(case, "tensors", None) or {}).get("cu_seqlens")
    else:
        expected = {name: case} if isinstance(case, torch.Tensor) else case
        if not hasattr(expected, "keys"):
            raise TypeError(f"assert_kda_close: expected_or_case must be a golden case, a tensor or a mapping, "
                            f"not {type(case).__name__}")
        if op is None:
            raise ValueError("assert_kda_close: pass op= (the golden operator, e.g. 'kda.recurrent') with "
                             "expected tensors that are not a golden case")
        known = []
    if policy == "recommended":
        policy = _recommended_policy(case)
    verdict = _policy.judge(expected, actual, op, policy, tensors=tensors, known=known, table=table,
                            cu_seqlens=cu_seqlens, state_layout=layout)
    if verdict.passed:
        return verdict
    if verdict.exit_code == _policy.EXIT_UNUSABLE and not verdict.results:
        raise ValueError(f"assert_kda_close: {verdict.reason}")
    bad = [r for r in verdict.results if not r.passed]
    first = msg or (f"Tensors are not close to the golden under policy '{policy}' ({op}): "
                    f"{len(bad)} of {len(verdict.results)} tensor(s) fail")
    lines = [first] + [_line(r) for r in bad]
    if not bad:
        lines.append(verdict.reason)
    raise AssertionError("\n".join(lines))
