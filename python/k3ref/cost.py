"""The K3 cost models as calculators (docs/cost-models.md), through k3ref._core.

    from k3ref import cost
    cost.decode(head_dim=128, heads=96)                  # {"flops", "bytes", "flops_per_byte"}
    cost.prefill(tokens=32768, head_dim=128)             # FlashKDA, C = 16, both kernels
    cost.moe_ratio_uniform(bytes_per_element=2, flops_per_second=989e12,
                           bytes_per_second=50e9, intermediate=3072, gpus=64)
    cost.moe_ratio(selection, experts=16, gpus=4, ...)  # a measured routing [tokens, k]

The same formulas as `k3ref report decode|prefill|moe`: decode 7 D^2 FLOP and 8 D^2 bytes per
head and token; FlashKDA prefill 12 C^3 + 8 C^2 D + 6 C D^2 FLOP and 8 C^2 + 22 C D bytes per
chunk and head, ceil(T / C) chunks, 8 D^2 bytes of state per kernel; MoE
T_comm / T_comp = (P F) / (6 m B) (1 - 1/E) under uniform routing, and for a measured
selection the busiest GPU's remote routes received over its routes computed (tokens spread
over the GPUs in contiguous blocks, expert j on GPU j // (n / E)).
"""
from __future__ import annotations

from typing import Any

from ._references import _compiled, _count, _number


def _work(w: dict[str, float], scale: float = 1.0) -> dict[str, float]:
    flops, nbytes = w["flops"] * scale, w["bytes"] * scale
    return {"flops": flops, "bytes": nbytes, "flops_per_byte": flops / nbytes}


def decode(head_dim: int = 128, heads: int = 1, tokens: int = 1) -> dict[str, float]:
    """FLOPs and bytes of `tokens` decode steps of `heads` heads of size D = head_dim."""
    D = _count("cost.decode", "head_dim", head_dim, 1)
    n = _count("cost.decode", "heads", heads, 1) * _count("cost.decode", "tokens", tokens, 1)
    return _work(_compiled().cost_decode(D), n)


def prefill(tokens: int = 4096, head_dim: int = 128, chunk: int = 16, heads: int = 1,
            kernels: int = 2) -> dict[str, Any]:
    """FlashKDA's prefill of `tokens` tokens: {"per_chunk": ..., "per_head": ..., "total": ...}."""
    fn = "cost.prefill"
    r = _compiled().cost_prefill(_count(fn, "tokens", tokens, 1), _count(fn, "chunk", chunk, 1),
                                 _count(fn, "head_dim", head_dim, 1), _count(fn, "kernels", kernels, 0))
    h = _count(fn, "heads", heads, 1)
    return {"per_chunk": _work(r["per_chunk"]), "per_head": _work(r["per_head"]), "total": _work(r["per_head"], h)}


def _positive(fn: str, name: str, value: Any) -> float:
    x = _number(fn, name, value, optional=False)
    assert x is not None
    if not x > 0:
        raise ValueError(f"k3ref.{fn}: argument '{name}' must be positive, got {x!r}")
    return x


def moe_ratio_uniform(*, bytes_per_element: float = 2, flops_per_second: float, bytes_per_second: float,
                      intermediate: int = 3072, gpus: int = 8) -> float:
    """T_comm / T_comp of expert parallelism under uniform routing: (P F) / (6 m B) (1 - 1/E)."""
    fn = "cost.moe_ratio_uniform"
    return float(_compiled().cost_moe_uniform(_positive(fn, "bytes_per_element", bytes_per_element),
                                              _positive(fn, "flops_per_second", flops_per_second),
                                              float(_count(fn, "intermediate", intermediate, 1)),
                                              _positive(fn, "bytes_per_second", bytes_per_second),
                                              float(_count(fn, "gpus", gpus, 1))))


def moe_ratio(selection: Any, *, experts: int, gpus: int, bytes_per_element: float = 2, flops_per_second: float,
              bytes_per_second: float, intermediate: int = 3072) -> dict[str, Any]:
    """The dispatch of a measured routing, counted: routes per GPU, remote routes in and out, and
    T_comm / T_comp at the busiest GPUs. `selection` is [tokens, k] expert indices."""
    import numpy as np

    fn = "cost.moe_ratio"
    sel = np.ascontiguousarray(np.asarray(selection), dtype=np.int64)
    if sel.ndim != 2:
        raise ValueError(f"k3ref.{fn}: argument 'selection' must be [tokens, k], got shape {sel.shape}")
    try:
        out: dict[str, Any] = _compiled().cost_moe_dispatch(
            sel, _count(fn, "experts", experts, 1), _count(fn, "gpus", gpus, 1),
            _positive(fn, "bytes_per_element", bytes_per_element), _positive(fn, "flops_per_second", flops_per_second),
            _positive(fn, "bytes_per_second", bytes_per_second), _count(fn, "intermediate", intermediate, 1))
    except ValueError as e:
        raise ValueError(f"k3ref.{fn}: {str(e).splitlines()[0]}") from None
    return out
