"""Loading the upstream projects' kernels, for every adapter module: a checkout's directory
on sys.path (add_path; the adapter finds it with path_of), the CUDA device a kernel needs, a
module's version line, FLA's fla.ops.kda imported without its packages' __init__ (and an
engine's modules the same way: bare_packages), FLA's version line and its keyword arguments
for k3ref's KDA options."""
import importlib
import os
import sys
from pathlib import Path

import torch

from .protocol import source_identity


def add_path(path):
    if path and path not in sys.path:
        sys.path.insert(0, path)


def need_cuda():
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device")


def module_version(name):
    mod = sys.modules.get(name)
    if not mod:
        return ""
    version = getattr(mod, "__version__", "")
    where = getattr(mod, "__file__", "")
    try:
        ident = source_identity(mod)
    except OSError as e:
        ident = f"source not identified ({e.strerror})"
    return f"{name} {version or '(no __version__)'} from {where}, {ident}"


# FLA may dispatch chunk_kda to another backend (FlashKDA, TileLang) by environment: pinned so
# that an adapter named after FLA's Triton kernel runs that kernel (the findings scripts pin the
# same). Recorded in every FLA adapter's version line.
FLA_DISPATCH = {"FLA_DISABLE_BACKEND_DISPATCH": "1", "FLA_FLASH_KDA": "0", "FLA_TILELANG": "0"}


# The packages whose __init__ imports every FLA op, layer and model (transformers and
# torch._dynamo with them): 22.7 s for `import fla.ops.kda` on the H200, 28-32 s in each of 16
# processes started together. Their __init__ files only import and re-export, so fla.ops.kda
# is imported with them as bare packages; FLA_FULL_IMPORT=1 (or a failure) imports as usual.
FLA_BARE_PACKAGES = ("fla", "fla.ops", "fla.modules")


def bare_packages(root, names):
    """Registers each dotted package of `names` (outer ones first) as an empty module whose path
    is its folder under `root`, without running its __init__ (FLA's, and an engine's, import the
    whole library); a package already imported is left as it is. Returns the names made."""
    import types

    made = []
    for name in names:
        if name in sys.modules:
            continue
        d = Path(root).joinpath(*name.split("."))
        mod = types.ModuleType(name)
        mod.__path__, mod.__file__, mod.__package__ = [str(d)], str(d / "__init__.py"), name
        mod.__k3ref_bare__ = True  # recorded in the version line
        sys.modules[name] = mod
        made.append(name)
        parent, _, leaf = name.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], leaf, mod)
    return made


def import_bare(module, packages):
    """Imports `module` with `packages` (its parents, outer ones first) as bare packages:
    their __init__ files, which import every op of the library, are not run; the outermost
    gets the __version__ its __init__ states. On any failure the bare packages are taken back
    out and the exception stands. Returns the module."""
    import importlib.util

    top = packages[0]
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"no {top} package on the path")
    root = Path(list(spec.submodule_search_locations)[0])
    version = ""
    for line in (root / "__init__.py").read_text(errors="replace").splitlines() if (root / "__init__.py").is_file() else ():
        if line.startswith("__version__"):
            version = line.partition("=")[2].strip().strip("'\"")
    try:
        if top in bare_packages(root.parent, packages):
            sys.modules[top].__version__ = version
        return importlib.import_module(module)
    except Exception:
        for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
            del sys.modules[name]
        raise


def import_lean(module, packages):
    """`module` imported bare (import_bare), else as usual (an op that needs its package's
    exports); a library already imported is used as it is."""
    if packages[0] in sys.modules:
        return importlib.import_module(module)
    try:
        return import_bare(module, packages)
    except Exception:
        return importlib.import_module(module)


def load_fla(path):
    """Pins FLA_DISPATCH, puts `path` (a directory holding the fla package; None: the installed
    one) first on sys.path, and imports fla.ops.kda (FLA_BARE_PACKAGES)."""
    os.environ.update(FLA_DISPATCH)
    add_path(path)
    if os.environ.get("FLA_FULL_IMPORT") == "1":
        return importlib.import_module("fla.ops.kda")
    return import_lean("fla.ops.kda", FLA_BARE_PACKAGES)


def fla_version():
    pins = ", ".join(f"{k}={os.environ.get(k, '(unset)')}" for k in FLA_DISPATCH)
    bare = getattr(sys.modules.get("fla"), "__k3ref_bare__", False)
    return f"{module_version('fla')}; {pins}" + ("; fla.ops.kda imported without the packages' __init__" if bare else "")


def fla_option_kwargs(inputs, params):
    """FLA's KDA keyword arguments for k3ref's options (every FLA entry point takes them alike:
    chunk_kda, fused_recurrent_kda, their serving and context-parallel forms): the scale, the L2
    norm, the gate computed in kernel (A_log, dt_bias flattened to HV * K, lower bound) and
    beta's sigmoid (two_sigmoid: allow_neg_eigval)."""
    kw = dict(scale=params.get("scale"), use_qk_l2norm_in_kernel=bool(params.get("qk_l2norm")))
    gate = params.get("gate", "log_decay")
    if gate != "log_decay":
        kw["use_gate_in_kernel"] = True
        kw["A_log"] = inputs["A_log"].float() if inputs.get("A_log") is not None else None
        if inputs.get("dt_bias") is not None:
            kw["dt_bias"] = inputs["dt_bias"].float().reshape(-1)
        if gate == "lower_bound":
            kw["lower_bound"] = float(params["lower_bound"])
    beta = params.get("beta", "as_given")
    if beta != "as_given":
        kw["use_beta_sigmoid_in_kernel"] = True
        kw["allow_neg_eigval"] = beta == "two_sigmoid"
    return kw
