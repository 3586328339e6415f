"""libk3gc.so (gpu_check/include/k3gc.h) through k3ref._core's binding (K3gc), which opens the
library at run time and types its calls by the header: this module holds no copy of its
structs or codes. Found at the run's path (use(path): --lib, $K3GC_LIB for a run), an
explicit load(path), $K3GC_LIB, or the build directories of the source tree (build*/gpu_check/)."""
import glob
import os
from pathlib import Path

import torch

from .._data import FORMAT_NAMES
from .._data import compiled as _core

# The mutants equal to the fp32 kernel below the sizes where they break (k3gc.h): the scale
# tier's (scale.py), left out of the default matrix, which cannot reach those sizes.
SCALE_MUTANTS = ("int32_offset_wrap", "grid_drops_sequences", "last_chunk_read_past_end", "bf16_state_long_t")


def __getattr__(name):
    # MUTATIONS: the mutants' names by code, from the header k3ref._core was built with (read
    # on use, so that importing this module needs no compiled half).
    if name == "MUTATIONS":
        return list(_core().k3gc_mutation_names())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_lib = None
_error = "not loaded yet"
_path = None  # the run's path of the library (use), tried first


def use(path):
    """Makes `path` the library this process loads (the run's --lib; None changes nothing). A
    library already loaded from another path is loaded again from this one."""
    global _lib, _path
    if path and path != _path:
        _path, _lib = str(path), None


def _candidates():
    # $K3GC_LIB serves the library's direct users (a script, a test); a run's path comes by use().
    for given in (_path, os.environ.get("K3GC_LIB")):
        if given:
            yield given
    root = Path(__file__).resolve().parents[3]
    for p in sorted(glob.glob(str(root / "build*" / "gpu_check" / "libk3gc.so"))):
        yield p
    yield str(Path(__file__).resolve().parent / "libk3gc.so")


def load(path=None):
    """Loads the library (once); returns True when it is usable."""
    global _lib, _error
    if _lib is not None and path is None:
        return True
    tried = []
    for p in [path] if path else _candidates():
        if not p or not os.path.exists(p):
            tried.append(f"{p}: missing")
            continue
        try:
            lib = _core().K3gc(str(p))
        except (ImportError, RuntimeError) as e:
            tried.append(f"{p}: {e}")
            continue
        _lib, _error = lib, ""
        return True
    _error = "libk3gc.so not found or not loadable (" + "; ".join(tried) + "); set K3GC_LIB"
    return False


def available():
    return _lib is not None or (torch.cuda.is_available() and load())


def load_error():
    return _error


def _ptr(t):
    return t.data_ptr() if t is not None else 0  # 0: NULL


def _code(kind, name):
    """The library's code of a name (its enums): a format of the policy table (a torch dtype,
    named as k3ref.policy.FORMAT_OF names it), a gate or a beta mode."""
    text = FORMAT_NAMES.get(str(name).removeprefix("torch.")) if kind == "format" else name
    code = _core().k3gc_code(kind, str(text))
    if code < 0:
        raise ValueError(f"libk3gc: no {kind} named {name}")
    return code


def _stream():
    return torch.cuda.current_stream().cuda_stream


def compare(candidate, reference, fmt, atol=0.0, rtol=0.0, window_shape=None):
    assert available(), _error
    cand = candidate.contiguous()
    ref = reference.contiguous()
    inner = extent = window = 0
    we = wr = None
    if window_shape is not None:
        inner, extent, window = window_shape
        nw = (extent + window - 1) // window
        we = torch.empty(nw, dtype=torch.float64, device=cand.device)
        wr = torch.empty(nw, dtype=torch.float64, device=cand.device)
    # The comparator's sums as a plain dict: metrics.compare makes them figures in the one
    # judge (k3ref._core); this module binds the library and knows nothing of the harness.
    out = _lib.compare(_ptr(cand), _code("format", cand.dtype), _ptr(ref), _code("format", ref.dtype),
                       cand.numel(), _code("format", fmt), atol, rtol, inner, extent, window, _ptr(we), _ptr(wr),
                       _stream())
    if we is not None:
        out["window_err_sq"], out["window_ref_sq"] = we.tolist(), wr.tolist()
    return out


def _kda_args(inputs, params, precision, output_dtype=None, state_dtype=None, out=None, outputs=True):
    """k3gc_kda_args for the library's forward and backward from (inputs, params), with the
    forward's outputs allocated unless `outputs` is False (the backward reads none):
    (args, o, final_state, the state's shape in the params' layout, the tensors the pointers
    need alive)."""
    q, k, v, g, beta = (inputs[n] for n in ("q", "k", "v", "g", "beta"))
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    cu = inputs.get("cu_seqlens")
    N = cu.numel() - 1 if cu is not None else B
    h0 = inputs.get("initial_state")
    state_dtype = state_dtype or (h0.dtype if h0 is not None else (torch.float64 if precision in (0, 2) else torch.float32))
    v_first = params.get("state_layout") == "v_first"
    state_shape = (N, HV, V, K) if v_first else (N, HV, K, V)
    if h0 is not None:
        h0 = h0.to(state_dtype).contiguous()
    final = torch.empty(state_shape, dtype=state_dtype, device=q.device) if outputs else None
    o = out if out is not None or not outputs else torch.empty((B, T, HV, V), dtype=output_dtype, device=q.device)
    dt = q.dtype
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t.dtype != dt:
            raise ValueError(f"kda: {name} is {t.dtype}, q is {dt}")
    A_log = inputs.get("A_log")
    dt_bias = inputs.get("dt_bias")
    A_log = A_log.float().contiguous() if A_log is not None else None
    dt_bias = dt_bias.float().contiguous() if dt_bias is not None else None
    scale = params.get("scale")
    for t in (q, k, v, g, beta):
        assert t.is_contiguous() and t.is_cuda
    args = dict(
        q=_ptr(q), k=_ptr(k), v=_ptr(v), g=_ptr(g), beta=_ptr(beta), input_dtype=_code("format", dt),
        A_log=_ptr(A_log), dt_bias=_ptr(dt_bias), gate=_code("gate", params.get("gate", "log_decay")),
        lower_bound=float(params.get("lower_bound") or 0.0), beta_mode=_code("beta", params.get("beta", "as_given")),
        qk_l2norm=int(bool(params.get("qk_l2norm"))), scale=float(scale if scale is not None else K ** -0.5),
        B=B, T=T, H=H, HV=HV, K=K, V=V, cu_seqlens=_ptr(cu), N=N, initial_state=_ptr(h0), final_state=_ptr(final),
        state_dtype=_code("format", state_dtype), state_v_first=int(v_first), o=_ptr(o),
        output_dtype=_code("format", o.dtype if o is not None else torch.float64))
    # the tensors the pointers point into stay alive with the call
    return args, o, final, state_shape, (h0, A_log, dt_bias)


def kda_forward(inputs, params, precision=0, mutation=0, output_dtype=torch.float64, state_dtype=None, out=None):
    """Runs the library's KDA forward. inputs: q, k, v, g, beta (one dtype), optional A_log, dt_bias,
    initial_state, cu_seqlens (CUDA tensors); params: golden params (gate, lower_bound, beta, qk_l2norm,
    scale, state_layout). precision 0: the fp64 reference (its plain kernel, the definition);
    1: the fp32 kernel (mutation = its mistake); 2: the fp64 reference's fast form, bit for bit
    precision 0's results, what long references run (k3gc.h). The state defaults to fp64 for 0 and 2, fp32 for 1.
    Returns (o, final_state)."""
    assert available(), _error
    args, o, final, _shape, _keep = _kda_args(inputs, params, precision, output_dtype, state_dtype, out)
    _lib.kda_forward(args, precision, mutation, _stream())
    return o, final


def kda_backward(inputs, params, d_o, d_final_state=None):
    """The fp64 reference's gradients (k3gc_kda_backward) of the forward of precision 0 on
    (inputs, params), as kda_forward takes them, given d_o [B,T,HV,V] and d_final_state (the
    state layout; None: zero): a dict of fp64 tensors named as the backward check names them
    (dq, dk, dv, dg, dbeta, d_initial_state, and dA_log, ddt_bias where the inputs have A_log
    and dt_bias), each of its input's shape."""
    assert available(), _error
    args, _o, _final, state_shape, _keep = _kda_args(inputs, params, 0, outputs=False)
    q, v = inputs["q"], inputs["v"]
    dev, f64 = q.device, torch.float64
    grads = {"dq": torch.empty(q.shape, dtype=f64, device=dev), "dk": torch.empty(q.shape, dtype=f64, device=dev),
             "dv": torch.empty(v.shape, dtype=f64, device=dev),
             "dg": torch.empty(inputs["g"].shape, dtype=f64, device=dev),
             "dbeta": torch.empty(inputs["beta"].shape, dtype=f64, device=dev),
             "d_initial_state": torch.empty(state_shape, dtype=f64, device=dev)}
    if inputs.get("A_log") is not None:
        grads["dA_log"] = torch.empty(inputs["A_log"].shape, dtype=f64, device=dev)
    if inputs.get("dt_bias") is not None:
        grads["ddt_bias"] = torch.empty(inputs["dt_bias"].shape, dtype=f64, device=dev)
    d_o = d_o.to(dev).contiguous()
    if d_final_state is not None:
        d_final_state = d_final_state.to(dev).reshape(state_shape).contiguous()
    _lib.kda_backward(args, dict(
        d_o=_ptr(d_o), d_o_dtype=_code("format", d_o.dtype), d_final_state=_ptr(d_final_state),
        d_final_state_dtype=_code("format", d_final_state.dtype if d_final_state is not None else f64),
        **{name: _ptr(grads.get(name)) for name in
           ("dq", "dk", "dv", "dg", "dbeta", "d_initial_state", "dA_log", "ddt_bias")}), _stream())
    return grads
