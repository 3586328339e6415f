"""The package's references (kda, kda_chunkwise, kda_contract, kda_backward, kcp_forward,
kcp_backward, attnres, qb_solver; reference_of for a golden case) and their options'
vocabulary, over the compiled half (k3ref._core): what `import k3ref` hands on
(docs/python.md). A module of its own, beside the package's face, so that k3ref.goldens and
the GPU harness's reference path stand on the references alone, not on the safetensors writer
behind k3ref.save. Imports neither torch nor the compiled part until a reference is called.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable, Mapping, NoReturn, Sequence

from . import _data

if TYPE_CHECKING:  # annotations only: `import k3ref` imports neither torch nor NumPy
    import numpy as np
    import torch
    from numpy.typing import NDArray

# The options of `k3ref kda` other than --in/--out: name -> the Python type of the value, or
# None for a named-value option, whose allowed names, default and meanings are the C++ options
# vocabulary's (include/k3ref/vocabulary.h), read from k3ref._core on first use. KDA_OPTIONS
# (name -> allowed names or type), PRECISIONS, CHUNK_FORMS, BACKWARD_METHODS, KCP_MERGES and
# KDA_CONTRACTS are derived from it (k3ref's module __getattr__). tests/python checks this table
# against the command's --help.
_KDA_OPTION_TYPES: dict[str, type | None] = {
    "gate": None,
    "gate_base": None,
    "lower_bound": float,
    "beta": None,
    "l2norm": bool,
    "scale": float,
    "state_layout": None,
    "all_states": bool,
    "no_final_state": bool,
    "precision": None,
    "threads": int,
}
# Module attributes that are the allowed names of one vocabulary option.
_NAME_TUPLES = {"PRECISIONS": "precision", "CHUNK_FORMS": "chunk_form", "BACKWARD_METHODS": "method",
                "KCP_MERGES": "merge", "KDA_CONTRACTS": "contract"}
_vocabulary_cache: dict[str, dict[str, Any]] | None = None


def option_vocabulary() -> dict[str, dict[str, Any]]:
    """{option: {"values": (allowed names...), "default": name or None, "about": {name: meaning}}}
    for every named-value option of the references (gate, gate_base, beta, state_layout,
    precision, chunk_form, method, merge, contract): the library's one table of them."""
    global _vocabulary_cache
    if _vocabulary_cache is None:
        _vocabulary_cache = _compiled().option_vocabulary()
    return _vocabulary_cache


def tier_descriptions() -> dict[str, str]:
    """{tier name: description}: every arithmetic tier of the library (the precision option
    offers PRECISIONS of them) and the reference precision its goldens record."""
    return dict(_compiled().tiers())


def _names(option: str) -> tuple[str, ...]:
    return option_vocabulary()[option]["values"]


KDA_INPUTS = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias", "cu_seqlens")
KDA_COTANGENTS = ("d_o", "d_final_state")

_INDEX_INPUTS = ("cu_seqlens", "splits")
_compiled = _data.compiled  # the compiled half (k3ref._core), imported on first use


def _torch() -> Any:
    import torch
    return torch


def _fail(fn: str, exc: type[Exception], message: str) -> NoReturn:
    raise exc(f"k3ref.{fn}: {message}")


def _as_float64(fn: str, name: str, x: Any) -> NDArray[np.float64]:
    """A C-contiguous float64 NumPy copy of one floating-point tensor (exact: every float dtype
    widens exactly to float64)."""
    torch = _torch()
    import numpy as np
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(x)
    if not isinstance(x, torch.Tensor):
        _fail(fn, TypeError, f"tensor '{name}' must be a torch.Tensor, not {type(x).__name__}")
    if x.is_complex() or not x.is_floating_point():
        _fail(fn, TypeError, f"tensor '{name}' must have a floating-point dtype, not {x.dtype}")
    return np.ascontiguousarray(x.detach().to(device="cpu", dtype=torch.float64).numpy())


def _as_index(fn: str, name: str, x: Any) -> list[int]:
    """A list of ints from an integer tensor, an integer array or a sequence of ints."""
    torch = _torch()
    if isinstance(x, torch.Tensor):
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            _fail(fn, TypeError, f"'{name}' must hold integers, not {x.dtype}")
        if x.dim() != 1:
            _fail(fn, ValueError, f"'{name}' must be one-dimensional, not of shape {list(x.shape)}")
        return [int(v) for v in x.tolist()]
    try:
        values = list(x)
    except TypeError:
        _fail(fn, TypeError, f"'{name}' must be a 1-D integer tensor or a sequence of ints, not {type(x).__name__}")
    out = []
    for v in values:
        if isinstance(v, bool) or not hasattr(v, "__index__"):
            _fail(fn, TypeError, f"'{name}' must hold integers, not {type(v).__name__} ({v!r})")
        out.append(int(v.__index__()))
    return out


def _tensors(fn: str, inputs: Any, allowed: Sequence[str], required: Sequence[str]) -> dict[str, NDArray[Any]]:
    """Checks the mapping of input tensors and converts it for k3ref._core."""
    import numpy as np
    if not hasattr(inputs, "keys") or not hasattr(inputs, "__getitem__"):
        _fail(fn, TypeError, f"inputs must be a mapping of tensor names to tensors ({', '.join(allowed)}), "
                             f"not {type(inputs).__name__}")
    for name in inputs:
        if name not in allowed:
            _fail(fn, ValueError, f"unknown input tensor '{name}' (expected: {', '.join(allowed)})")
    for name in required:
        if name not in inputs or inputs[name] is None:
            _fail(fn, ValueError, f"missing input tensor '{name}'")
    out: dict[str, NDArray[Any]] = {}
    for name in allowed:
        if name not in inputs or inputs[name] is None:
            continue
        if name in _INDEX_INPUTS:
            out[name] = np.asarray(_as_index(fn, name, inputs[name]), dtype=np.int64)
        else:
            out[name] = _as_float64(fn, name, inputs[name])
    return out


def _choice(fn: str, name: str, value: Any, choices: Sequence[str] | None = None) -> str:
    """`value` checked against the allowed names of option `name` (the vocabulary's unless given)."""
    choices = _names(name) if choices is None else choices
    if not isinstance(value, str) or value not in choices:
        _fail(fn, ValueError, f"option '{name}' must be one of {', '.join(choices)}, not {value!r}")
    return value


def _number(fn: str, name: str, value: Any, optional: bool = True) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            import numpy as np
            if isinstance(value, (np.floating, np.integer)):
                return _number(fn, name, float(value), optional)
        except ImportError:
            pass
        _fail(fn, TypeError, f"option '{name}' must be a number, not {type(value).__name__} ({value!r})")
    try:
        value = float(value)
    except OverflowError:  # an int beyond double's range
        _fail(fn, ValueError, f"option '{name}' must be finite, not an integer of {value.bit_length()} bits")
    if value != value or value in (float("inf"), float("-inf")):
        _fail(fn, ValueError, f"option '{name}' must be finite, not {value!r}")  # as the CLI's --scale, --lower-bound
    return value


def _flag(fn: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        _fail(fn, TypeError, f"option '{name}' must be True or False, not {value!r}")
    return value


# No count option (threads, chunk and block sizes, k, iterations) means anything beyond a C
# int; larger values are refused here in one line rather than by the binding's conversion.
MAX_COUNT = 2**31 - 1


def _count(fn: str, name: str, value: Any, minimum: int, maximum: int = MAX_COUNT) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        _fail(fn, TypeError, f"option '{name}' must be an integer, not {type(value).__name__} ({value!r})")
    value = int(value.__index__())
    if value < minimum:
        _fail(fn, ValueError, f"option '{name}' must be at least {minimum}, not {value}")
    if value > maximum:
        _fail(fn, ValueError, f"option '{name}' must be at most {maximum}, not {value}")
    return value


def kda_options(params: Mapping[str, Any]) -> dict[str, Any]:
    """The kda / kda_contract keyword arguments of a KDA parameter object (a golden's params,
    a prop case, an adapter's params): `qk_l2norm` -> `l2norm`, ...; a key absent takes the
    option's default."""
    return dict(gate=params.get("gate", "log_decay"), gate_base=params.get("gate_base", "e"),
                lower_bound=params.get("lower_bound"), beta=params.get("beta", "as_given"),
                l2norm=bool(params.get("qk_l2norm")), scale=params.get("scale"),
                state_layout=params.get("state_layout", "k_first"))


def _kda_options(fn: str, gate: Any, gate_base: Any, lower_bound: Any, beta: Any, l2norm: Any, scale: Any,
                 state_layout: Any, all_states: Any, no_final_state: Any, threads: Any) -> dict[str, Any]:
    """The `k3ref kda` options, checked once, as k3ref._core reads them."""
    return {
        "gate": _choice(fn, "gate", gate),
        "gate_base": _choice(fn, "gate_base", str(gate_base) if gate_base == 2 else gate_base),
        "lower_bound": _number(fn, "lower_bound", lower_bound),
        "beta": _choice(fn, "beta", beta),
        "l2norm": _flag(fn, "l2norm", l2norm),
        "scale": _number(fn, "scale", scale),
        "state_layout": _choice(fn, "state_layout", state_layout),
        "all_states": _flag(fn, "all_states", all_states),
        "no_final_state": _flag(fn, "no_final_state", no_final_state),
        "threads": _count(fn, "threads", (os.cpu_count() or 1) if threads is None else threads, 1),
    }


# ---- memory budgets -------------------------------------------------------------------------
# Every reference estimates its working memory from the shapes before it computes, by the rule
# of `k3ref kda --memory-budget` (include/k3ref/io/memory_budget.h, through k3ref._core): the
# outputs in the tier and as float64, the inputs lifted to the tier, two K x V states per thread
# (at most one thread per sequence-head), and for the chunk forms each thread's chunk scratch
# (about 8 C x C matrices, allocated at chunk_size C whatever the number of tokens); a value
# takes 8 bytes in double, about 150 in mp256. Past `memory_budget` (bytes, or a string with a
# binary K/M/G/T suffix; default None: half the machine's physical memory, the command's
# default) the call is refused with a one-line ValueError naming the function and the budget.

def _memory_budget(fn: str, value: Any) -> int:
    core = _compiled()
    if value is None:
        return int(core.default_memory_budget())
    if isinstance(value, bool) or not isinstance(value, (int, str)) and not hasattr(value, "__index__"):
        _fail(fn, TypeError, f"option 'memory_budget' must be a number of bytes or a string such as '512M', "
                             f"not {type(value).__name__} ({value!r})")
    if isinstance(value, str):
        try:
            return int(core.parse_memory_budget(value, "option 'memory_budget'"))
        except ValueError as e:
            _fail(fn, ValueError, str(e).splitlines()[0])
    value = int(value.__index__())
    if value <= 0:
        _fail(fn, ValueError, f"option 'memory_budget' must be a positive number of bytes, not {value}")
    return value


def _gib(n: float) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n:.0f} bytes"


def _numel(a: Any) -> int:
    n = 1
    for d in a.shape:
        n *= int(d)
    return n


def _check_memory(fn: str, t: Mapping[str, Any], opt: Mapping[str, Any], precision: str, budget: int, *,
                  chunk_size: int = 0, stages: bool = False, backward: bool = False, ranks: int = 0) -> None:
    """Refuses (ValueError, one line) a KDA-family call whose estimated working memory is past
    the budget; the shapes it cannot read are left to the library, which names them."""
    q, v = t.get("q"), t.get("v")
    if q is None or v is None or q.ndim != 4 or v.ndim != 4:
        return
    B, T, _, K = (int(x) for x in q.shape)
    HV, V = int(v.shape[2]), int(v.shape[3])
    N = len(t["cu_seqlens"]) - 1 if "cu_seqlens" in t and len(t["cu_seqlens"]) > 0 else B
    N = max(N, 0)
    inputs = sum(_numel(a) for name, a in t.items() if name not in _INDEX_INPUTS)
    outputs = B * T * HV * V
    if not opt.get("no_final_state"):
        outputs += N * HV * K * V
    if opt.get("all_states") or backward:  # the adjoint keeps every token's state
        outputs += B * T * HV * K * V
    if backward:
        outputs += inputs  # the gradients, one per input
    if stages and chunk_size:
        outputs += B * T * HV * (5 * K + 3 * chunk_size + 2 * V) + (T // chunk_size + N + 1) * HV * K * V
    if ranks:
        outputs += ranks * HV * (K * K + 3 * K * V)
    threads = opt["threads"]
    need = float(_compiled().working_memory(outputs, inputs, N * HV, threads, K, V, chunk_size, precision))
    if need > budget:
        used = max(1, min(threads, max(1, N * HV)))
        detail = f"{precision}, {used} thread(s), K = {K}, V = {V}" + (f", chunk_size = {chunk_size}" if chunk_size else "")
        _fail(fn, ValueError, f"the computation needs about {_gib(need)} of memory ({detail}), over the memory_budget "
                              f"of {_gib(budget)} (memory_budget=: bytes or '512M'; default half the machine's "
                              "memory, as `k3ref kda --memory-budget`)")


def _progress_after(fn: str, value: Any) -> float:
    """The threshold of a reference's progress lines (None: the command's default, 5 s)."""
    after = _number(fn, "progress_after", value)
    return float(_compiled().default_progress_after) if after is None else after


def _call(fn: str, core_fn: Callable[..., Any], *args: Any) -> dict[str, torch.Tensor]:
    """Calls k3ref._core; its errors (the library's InvalidArgument) become one-line ValueErrors."""
    torch = _torch()
    try:
        out = core_fn(*args)
    except ValueError as e:
        raise ValueError(f"k3ref.{fn}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return {name: torch.from_numpy(a) for name, a in out.items()}


def kda(inputs: Mapping[str, Any], *, gate: str = "log_decay", gate_base: str | int = "e", lower_bound: float | None = None,
        beta: str = "as_given", l2norm: bool = False, scale: float | None = None, state_layout: str = "k_first",
        all_states: bool = False, no_final_state: bool = False, precision: str = "double", threads: int | None = None,
        memory_budget: int | str | None = None, progress_after: float | None = None) -> dict[str, torch.Tensor]:
    """The KDA recurrence (what `k3ref kda` computes). inputs: q, k [B, T, H, K], v [B, T, HV, V],
    g [B, T, HV, K], beta [B, T, HV], optional initial_state [N, HV, K, V] (V-first with
    state_layout="v_first"), A_log [HV], dt_bias [HV, K], cu_seqlens [N + 1] (B = 1).
    Returns o [B, T, HV, V], final_state (unless no_final_state) and all_states [B, T, HV, K, V]
    (with all_states=True). threads: parallel over (sequence, head); never changes a result
    (default: every CPU). memory_budget: see "memory budgets" (refused past it, before computing).
    progress_after: a call estimated (from its size, precision and threads) to take at least this
    many seconds writes progress lines to sys.stderr every few seconds (0: always; negative: never;
    default None: 5 s, as `k3ref kda --progress-after`)."""
    fn = "kda"
    t = _tensors(fn, inputs, KDA_INPUTS, KDA_INPUTS[:5])
    opt = _kda_options(fn, gate, gate_base, lower_bound, beta, l2norm, scale, state_layout, all_states,
                       no_final_state, threads)
    precision = _choice(fn, "precision", precision)
    _check_memory(fn, t, opt, precision, _memory_budget(fn, memory_budget))
    return _call(fn, _compiled().kda_recurrent, t, opt, precision, _progress_after(fn, progress_after))


def kda_chunkwise(inputs: Mapping[str, Any], *, chunk_form: str = "flashkda", chunk_size: int = 0, sub_chunk: int = 16,
                  stages: bool = False, gate: str = "log_decay", gate_base: str | int = "e", lower_bound: float | None = None,
                  beta: str = "as_given", l2norm: bool = False, scale: float | None = None,
                  state_layout: str = "k_first", no_final_state: bool = False, precision: str = "double",
                  threads: int | None = None, memory_budget: int | str | None = None,
        progress_after: float | None = None) -> dict[str, torch.Tensor]:
    """The KDA forward by a chunkwise (UT transform) form: chunk_form "flashkda" (inverse-decay
    form, chunk 16 by default) or "fla" (FLA's sub-chunked form, chunk 64; sub_chunk rows per
    sub-chunk). chunk_size 0 takes the form's own. Returns o and final_state; with stages=True
    also the stage tensors of the kda.chunkwise_* goldens (decay, q_decay, k_decay, k_inv,
    k_restore, L, INV, M_qk, w, u_pre, u, chunk_states, chunk_starts; docs/chunkwise.md).
    The arithmetic is exact to the tier (no rounding contract). memory_budget: as for kda (the
    chunk scratch counts at chunk_size, whatever the number of tokens).
    progress_after: progress lines past an estimated duration, as for kda."""
    fn = "kda_chunkwise"
    t = _tensors(fn, inputs, KDA_INPUTS, KDA_INPUTS[:5])
    opt = _kda_options(fn, gate, gate_base, lower_bound, beta, l2norm, scale, state_layout, False, no_final_state,
                       threads)
    chunk_form = _choice(fn, "chunk_form", chunk_form)
    chunk_size = _count(fn, "chunk_size", chunk_size, 0)
    stages = _flag(fn, "stages", stages)
    precision = _choice(fn, "precision", precision)
    _check_memory(fn, t, opt, precision, _memory_budget(fn, memory_budget),
                  chunk_size=chunk_size or (64 if chunk_form == "fla" else 16), stages=stages)
    return _call(fn, _compiled().kda_chunkwise, t, opt, chunk_form, chunk_size, _count(fn, "sub_chunk", sub_chunk, 1),
                 stages, precision, _progress_after(fn, progress_after))


def kda_contract(inputs: Mapping[str, Any], contract: str, *, exact: bool = False, sites: Mapping[str, str] | None = None,
                 gate: str = "log_decay", gate_base: str | int = "e", lower_bound: float | None = None, beta: str = "as_given",
                 l2norm: bool = False, scale: float | None = None, state_layout: str = "k_first",
                 no_final_state: bool = False, threads: int | None = None,
                 memory_budget: int | str | None = None,
        progress_after: float | None = None) -> dict[str, torch.Tensor]:
    """The precision contract of a real KDA kernel evaluated on the inputs it received
    (docs/contracts.md): "fla_recurrent", "fla_chunk", "fla_chunk_safe_gate" or "flashkda".
    Options as for kda. Returns o and final_state (float64), the values the kernel's declared
    roundings give; exact=True: the same algorithm rounding nowhere (the chunk form itself).
    sites: {site name: precision} overrides ("exact", "fp32", "tf32", "tf32_rz", "fp16", "bf16"),
    for measuring which rounding explains an error; kda_contract_sites(contract) lists them.
    progress_after: progress lines past an estimated duration, as for kda."""
    fn = "kda_contract"
    t = _tensors(fn, inputs, KDA_INPUTS, KDA_INPUTS[:5])
    opt = _kda_options(fn, gate, gate_base, lower_bound, beta, l2norm, scale, state_layout, False, no_final_state,
                       threads)
    if sites is not None and not (hasattr(sites, "items") and all(isinstance(a, str) and isinstance(b, str)
                                                                for a, b in sites.items())):
        _fail(fn, TypeError, f"option 'sites' must map site names to precision names, not {sites!r}")
    # (the chunk kernels' contracts run a chunk form: counted at the larger default chunk, 64)
    _check_memory(fn, t, opt, "double", _memory_budget(fn, memory_budget),
                  chunk_size=0 if contract == "fla_recurrent" else 64)
    return _call(fn, _compiled().kda_contract, t, opt, _choice(fn, "contract", contract),
                 _flag(fn, "exact", exact), dict(sites or {}), _progress_after(fn, progress_after))


def kda_contract_sites(contract: str) -> dict[str, str]:
    """{rounding site: precision} of a kernel contract (docs/contracts.md)."""
    fn = "kda_contract_sites"
    try:
        return dict(_compiled().kda_contract_sites(_choice(fn, "contract", contract)))
    except ValueError as e:
        raise ValueError(f"k3ref.{fn}: {str(e).splitlines()[0]}") from None


def kda_backward(inputs: Mapping[str, Any], cotangents: Mapping[str, Any] | None = None, *, method: str = "adjoint",
                 chunk_size: int = 0, gate: str = "log_decay", gate_base: str | int = "e", lower_bound: float | None = None,
                 beta: str = "as_given", l2norm: bool = False, scale: float | None = None,
                 state_layout: str = "k_first", precision: str = "double", threads: int | None = None,
                 memory_budget: int | str | None = None,
        progress_after: float | None = None) -> dict[str, torch.Tensor]:
    """Gradients of the KDA forward for the loss sum(o * d_o) + sum(final_state * d_final_state).
    cotangents: d_o [B, T, HV, V] and optional d_final_state; they may also sit in `inputs`
    (as in the kda.backward goldens). method "adjoint" (the adjoint recurrence) or "chunkwise"
    (the chunkwise backward, chunk_size 0 = 16, which also returns its stage tensors
    chunk_states, chunk_state_gradients, du, dg_cumulative, chunk_starts). Returns dq, dk, dv,
    dg (w.r.t. g as passed, under `gate`), dbeta (before its activation), d_initial_state, and
    dA_log / ddt_bias when those were given.
    progress_after: progress lines past an estimated duration, as for kda."""
    fn = "kda_backward"
    inputs, cotangents = _split_cotangents(fn, inputs, cotangents)
    t = _tensors(fn, inputs, KDA_INPUTS, KDA_INPUTS[:5])
    c = _tensors(fn, cotangents, KDA_COTANGENTS, KDA_COTANGENTS[:1])
    opt = _kda_options(fn, gate, gate_base, lower_bound, beta, l2norm, scale, state_layout, False, False, threads)
    method = _choice(fn, "method", method)
    chunk_size = _count(fn, "chunk_size", chunk_size, 0)
    precision = _choice(fn, "precision", precision)
    _check_memory(fn, {**t, **c}, opt, precision, _memory_budget(fn, memory_budget), backward=True,
                  chunk_size=(chunk_size or 16) if method == "chunkwise" else 0, stages=method == "chunkwise")
    return _call(fn, _compiled().kda_backward, t, c, opt, method, chunk_size, precision,
                 _progress_after(fn, progress_after))


def _split_cotangents(fn: str, inputs: Any, cotangents: Any) -> tuple[dict[str, Any], Any]:
    if not hasattr(inputs, "keys"):
        _fail(fn, TypeError, f"inputs must be a mapping of tensor names to tensors, not {type(inputs).__name__}")
    inputs = dict(inputs)
    found = {n: inputs.pop(n) for n in KDA_COTANGENTS if n in inputs}
    if cotangents is None:
        return inputs, found
    if found:
        _fail(fn, ValueError, f"cotangent '{next(iter(found))}' given both in inputs and in cotangents")
    return inputs, cotangents


def _splits(fn: str, inputs: Any, splits: Any) -> tuple[Any, list[int]]:
    inputs = dict(inputs) if hasattr(inputs, "keys") else inputs
    if hasattr(inputs, "keys") and "splits" in inputs:
        if splits is not None:
            _fail(fn, ValueError, "'splits' given both in inputs and as an argument")
        splits = inputs.pop("splits")
    if splits is None:
        _fail(fn, ValueError, "missing 'splits' (token boundaries of the ranks, [P + 1], from 0 to T)")
    return inputs, _as_index(fn, "splits", splits)


def kcp_forward(inputs: Mapping[str, Any], splits: torch.Tensor | Sequence[int] | None = None, *,
                merge: str = "origin_rank", gate: str = "log_decay", gate_base: str | int = "e", lower_bound: float | None = None,
                beta: str = "as_given", l2norm: bool = False, scale: float | None = None,
                state_layout: str = "k_first", all_states: bool = False, no_final_state: bool = False,
                precision: str = "double", threads: int | None = None,
                memory_budget: int | str | None = None,
        progress_after: float | None = None) -> dict[str, torch.Tensor]:
    """Context-parallel KDA over P simulated ranks (docs/kcp.md): splits [P + 1] are the ranks'
    token boundaries (0 .. T; also accepted as inputs["splits"]), inputs as for kda with B = 1
    and cu_seqlens. merge: how gathered fragments become entering states ("origin_rank" is
    FLA's). Returns o, final_state (and all_states), and per rank, stacked: fragment_transition
    [P, HV, K, K], fragment_state [P, HV, K, V], entering_state [P, HV, K, V], origin_rank [P].
    progress_after: progress lines past an estimated duration, as for kda."""
    fn = "kcp_forward"
    inputs, s = _splits(fn, inputs, splits)
    t = _tensors(fn, inputs, KDA_INPUTS, KDA_INPUTS[:5])
    opt = _kda_options(fn, gate, gate_base, lower_bound, beta, l2norm, scale, state_layout, all_states,
                       no_final_state, threads)
    precision = _choice(fn, "precision", precision)
    _check_memory(fn, t, opt, precision, _memory_budget(fn, memory_budget), ranks=max(len(s) - 1, 0))
    return _call(fn, _compiled().kcp_forward, t, opt, s, _choice(fn, "merge", merge), precision,
                 _progress_after(fn, progress_after))


def kcp_backward(inputs: Mapping[str, Any], cotangents: Mapping[str, Any] | None = None,
                 splits: torch.Tensor | Sequence[int] | None = None, *, merge: str = "origin_rank",
                 gate: str = "log_decay", gate_base: str | int = "e", lower_bound: float | None = None, beta: str = "as_given",
                 l2norm: bool = False, scale: float | None = None, state_layout: str = "k_first",
                 precision: str = "double", threads: int | None = None,
                 memory_budget: int | str | None = None,
        progress_after: float | None = None) -> dict[str, torch.Tensor]:
    """The context-parallel backward: each rank's adjoint over its slice from the state it
    entered with and the state gradient arriving from the next rank. Returns the gathered
    gradients (as kda_backward) and, stacked per rank, cp_entering_states and
    cp_entering_state_gradients [P, HV, K, V] (the kda.backward goldens' names).
    progress_after: progress lines past an estimated duration, as for kda."""
    fn = "kcp_backward"
    inputs, s = _splits(fn, inputs, splits)
    inputs, cotangents = _split_cotangents(fn, inputs, cotangents)
    t = _tensors(fn, inputs, KDA_INPUTS, KDA_INPUTS[:5])
    c = _tensors(fn, cotangents, KDA_COTANGENTS, KDA_COTANGENTS[:1])
    opt = _kda_options(fn, gate, gate_base, lower_bound, beta, l2norm, scale, state_layout, False, False, threads)
    precision = _choice(fn, "precision", precision)
    _check_memory(fn, {**t, **c}, opt, precision, _memory_budget(fn, memory_budget), backward=True,
                  ranks=max(len(s) - 1, 0))
    return _call(fn, _compiled().kcp_backward, t, c, opt, s, _choice(fn, "merge", merge), precision,
                 _progress_after(fn, progress_after))


def attnres(inputs: Mapping[str, Any], *, eps: float = 1e-6, block_size: int | None = None, two_phase: bool = False,
            precision: str = "double", memory_budget: int | str | None = None,
        progress_after: float | None = None) -> dict[str, torch.Tensor]:
    """Attention Residuals with teacher forcing (docs/attnres.md). inputs: values [L+1, T, d],
    queries and norm_weights [L+1, d]. block_size None: full AttnRes; otherwise block AttnRes
    (two_phase: the two-phase inference form). Returns h [L+1, T, d], alpha, and for blocks
    block_sums (and phase1_output, phase1_max, phase1_sum with two_phase).
    progress_after: progress lines past an estimated duration, as for kda."""
    fn = "attnres"
    names = ("values", "queries", "norm_weights")
    t = _tensors(fn, inputs, names, names)
    if block_size is not None:
        block_size = _count(fn, "block_size", block_size, 1)
    precision = _choice(fn, "precision", precision)
    values = t["values"]
    if values.ndim == 3:  # outputs h [L+1, T, d] and alpha [L+1, T, L+1] (and block sums), inputs lifted
        L1, T, d = (int(x) for x in values.shape)
        need = float(_compiled().working_memory(3 * L1 * T * d + 2 * L1 * T * L1, sum(_numel(a) for a in t.values()),
                                                1, 1, 0, 0, 0, precision))
        budget = _memory_budget(fn, memory_budget)
        if need > budget:
            _fail(fn, ValueError, f"the computation needs about {_gib(need)} of memory ({precision}, L + 1 = {L1}, "
                                  f"T = {T}, d = {d}), over the memory_budget of {_gib(budget)} (memory_budget=: "
                                  "bytes or '512M'; default half the machine's memory)")
    return _call(fn, _compiled().attnres, t["values"], t["queries"], t["norm_weights"], _number(fn, "eps", eps, False),
                 block_size, _flag(fn, "two_phase", two_phase), precision, _progress_after(fn, progress_after))


def qb_solver(inputs: Mapping[str, Any], *, k: int, iterations: int,
              beta0: torch.Tensor | NDArray[Any] | None = None,
              progress_after: float | None = None) -> dict[str, torch.Tensor]:
    """The Quantile Balancing alternating solver (docs/qb.md), in double: exact on dyadic
    scores. inputs: scores [m, n]. Returns per iteration alpha [T, m], beta [T, n], selection
    [T, m, k] (int32, best first, k3ref's tie rule) and loads [T, n] (int64).
    progress_after: progress lines past an estimated duration, as for kda."""
    fn = "qb_solver"
    t = _tensors(fn, inputs, ("scores",), ("scores",))
    b0 = None if beta0 is None else _as_float64(fn, "beta0", beta0)
    return _call(fn, _compiled().qb_solver, t["scores"], _count(fn, "k", k, 1), _count(fn, "iterations", iterations, 0),
                 b0, _progress_after(fn, progress_after))


# The golden operators reference_of computes.
REFERENCE_OPS = ("kda.recurrent", "kda.chunkwise_fla", "kda.chunkwise_flashkda", "kda.backward",
                 "kcp.context_parallel", "attnres.full", "attnres.block", "attnres.phase1", "qb.solver")
# The chunk size of the chunkwise backward whose stage tensors (chunk_states,
# chunk_state_gradients) the kda.backward goldens hold (docs/backward.md: C = 64).
BACKWARD_GOLDEN_CHUNK_SIZE = 64


def reference_of(case: Any, precision: str = "mp256", threads: int | None = None) -> dict[str, torch.Tensor]:
    """The references' outputs for a golden case's inputs (a k3ref.goldens.GoldenCase), for
    every expected output this package computes (all of them except qb.online's), in float64 (integer outputs in the golden's
    dtype). At "mp256", the goldens' tier, the KDA, kcp and AttnRes outputs equal the
    goldens bit for bit; qb.solver runs in double, exact on the goldens' dyadic scores."""
    op, opt = case.op, case.options
    kw: dict[str, Any] = {} if threads is None else {"threads": threads}
    if op == "kda.recurrent":
        out = kda(case.inputs, precision=precision, **opt, **kw)
    elif op.startswith("kda.chunkwise_"):
        out = kda_chunkwise(case.inputs, precision=precision, **opt, **kw)
    elif op == "kda.backward":
        inputs = dict(case.inputs)
        splits = inputs.pop("splits", None)
        out = kda_backward(inputs, precision=precision, **opt, **kw)
        stages = kda_backward(inputs, method="chunkwise", chunk_size=BACKWARD_GOLDEN_CHUNK_SIZE,
                              precision=precision, **opt, **kw)
        out.update({n: stages[n] for n in ("chunk_states", "chunk_state_gradients")})
        if splits is not None:
            cp = kcp_backward(inputs, splits=splits, precision=precision, **opt, **kw)
            out.update({n: cp[n] for n in ("cp_entering_states", "cp_entering_state_gradients")})
    elif op == "kcp.context_parallel":
        out = kcp_forward(case.inputs, precision=precision, **opt, **kw)
    elif op.startswith("attnres."):
        out = attnres(case.inputs, precision=precision, **opt)
    elif op == "qb.solver":
        if "scores" not in case.tensors:
            raise ValueError(f"k3ref.reference_of: case '{case.name}' stores no 'scores' (its scores are "
                             f"{case.params.get('scores', {}).get('kind', 'derived')}); docs/qb.md gives their formula")
        out = qb_solver(case.inputs, **opt)
        # The file keeps the selections of some iterations only (1-based selection_iterations).
        keep = case.params.get("selection_iterations")
        if keep is not None:
            out["selection"] = out["selection"][[i - 1 for i in keep]]
    else:
        raise ValueError(f"k3ref.reference_of: operator '{op}' of case '{case.name}' has no reference in "
                         "the Python package")
    expected = case.expected
    return {n: (t.to(expected[n].dtype) if not expected[n].is_floating_point() else t)
            for n, t in out.items() if n in expected}
