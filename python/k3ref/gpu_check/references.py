"""The one Python path to a KDA reference: k3ref's compiled references (k3ref._core, in double
or at 256 bits) for CPU-sized cases, libk3gc's fp64 recurrence on the GPU for long ones.
Nothing else is a reference: the PyTorch recurrence (torch_model.py) is a kernel under test."""
import torch

from .. import _references
from . import lib
from .protocol import shapes_of

LONG_CASE_ELEMENTS = 1 << 22  # T * HV * K * V above which the GPU fp64 reference is used, when present


class ReferenceUnavailable(RuntimeError):
    """Neither k3ref._core nor (on a CUDA device) libk3gc is here: nothing to vouch with."""


def _module():
    """k3ref's references (k3ref._references, as `import k3ref` hands them on) when their
    compiled half (k3ref._core) imports, else None."""
    try:
        _references._compiled()
    except ImportError:
        return None
    return _references


def module_reference(inputs, params, precision="double"):
    """(o, final_state) as float64 torch tensors from k3ref.kda (public API)."""
    k3ref = _module()
    if k3ref is None:
        raise ReferenceUnavailable("no KDA reference: k3ref._core is not importable (build it: meson setup build && "
                                   "meson compile -C build, then K3REF_CORE_PATH=build/python; or pip install k3ref)")
    out = k3ref.kda({n: t.cpu() for n, t in inputs.items()}, **k3ref.kda_options(params), precision=precision,
                    threads=2)
    return out["o"], out["final_state"]


def compute_reference(inputs, params, device="cpu"):
    """(o, final_state, source) in float64 on the CPU: libk3gc's fp64 kernel (its fast form) for long cases on
    a CUDA device (or when k3ref._core is absent there), else k3ref._core in double."""
    s = shapes_of(inputs)
    size = s["T"] * s["HV"] * s["K"] * s["V"]
    gpu_ok = str(device).startswith("cuda") and lib.available() and s["K"] <= 128 and s["V"] <= 128
    if gpu_ok and (size >= LONG_CASE_ELEMENTS or _module() is None):
        gpu = {k: v.to(device) for k, v in inputs.items()}
        o, f = lib.kda_forward(gpu, params, precision=2, output_dtype=torch.float64, state_dtype=torch.float64)
        return o.cpu(), f.cpu(), "libk3gc fp64"
    o, f = module_reference(inputs, params)
    return o, f, "k3ref module (double)"


def kda(inputs, params, device="cpu"):
    """(o, final_state) of the reference, float64 on the CPU."""
    o, f, _ = compute_reference(inputs, params, device)
    return o, f


def module_gradients(inputs, params, d_o, d_final_state=None):
    """The gradients (dq, dk, dv, dg, dbeta, d_initial_state, dA_log, ddt_bias) of the forward
    on (inputs, params) for the cotangents, float64 on the CPU, from k3ref.kda_backward (the
    adjoint recurrence in double)."""
    k3ref = _module()
    if k3ref is None:
        raise ReferenceUnavailable("no KDA gradient reference: k3ref._core is not importable")
    cot = {"d_o": d_o.cpu()}
    if d_final_state is not None:
        cot["d_final_state"] = d_final_state.cpu()
    return k3ref.kda_backward({n: t.detach().cpu() for n, t in inputs.items()}, cot, **k3ref.kda_options(params),
                              threads=2)


def gradients(inputs, params, d_o, d_final_state=None, device="cpu"):
    """The reference gradients in float64 on `device`: libk3gc's fp64 backward on a CUDA device,
    else k3ref.kda_backward in double (module_gradients)."""
    if str(device).startswith("cuda"):
        if not lib.available():
            raise ReferenceUnavailable("the gradient reference on a GPU is libk3gc's fp64 backward: " + lib.load_error())
        return lib.kda_backward({n: t.detach() for n, t in inputs.items()}, params, d_o, d_final_state)
    return module_gradients(inputs, params, d_o, d_final_state)
