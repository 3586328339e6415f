"""Finding adapters without editing source.

Three ways, all giving objects of the adapter protocol (adapters.Adapter):
- an entry point of group `k3ref.adapters` in an installed package's metadata, e.g. in
  pyproject.toml: `[project.entry-points."k3ref.adapters"] mykernel = "mypkg.k3ref:adapters"`;
- a spec on the command line: `--adapter mypkg.mod:MyKernel` (`python3 -m k3ref.gpu_check run`,
  `prop`) or `--k3ref-adapter mypkg.mod:MyKernel` (pytest); the module may also be a file,
  `path/to/file.py:MyKernel`;
- a list in a project's conftest.py: `k3ref_adapters = ["mypkg.mod:MyKernel", MyKernel(), ...]`.

What a spec names may be an Adapter subclass (instantiated without arguments), an adapter
instance, a function returning an adapter or a list of them (given the run's RunOptions when
it takes a parameter named `run_options`: its settings, --k3ref-set NAME=VALUE), or a list.
Every adapter made is given the run's options (`adapter.run_options`, frozen). The package's own
adapters come from `k3ref.gpu_check.registry:builtin_adapters`, its entry point (also used
when the package runs from a source tree without metadata).
"""
import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path

from .protocol import Adapter, BrokenAdapter, RunOptions

GROUP = "k3ref.adapters"
BUILTIN = "k3ref.gpu_check.registry:builtin_adapters"


class AdapterSpecError(ValueError):
    """A spec that does not name an adapter (one-line message)."""


def _file_module_name(path):
    path = Path(path).resolve()
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:8]
    return f"k3ref_adapter_file_{path.stem}_{digest}"


def import_module_of(spec):
    """Imports the module part of a spec ('pkg.mod' or 'path/file.py'); returns the module."""
    modpart = spec.rpartition(":")[0] if ":" in spec else spec
    if modpart.endswith(".py"):
        path = Path(modpart)
        if not path.is_file():
            raise AdapterSpecError(f"adapter '{spec}': no file {modpart}")
        name = _file_module_name(path)
        if name in sys.modules:
            return sys.modules[name]
        loader_spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = mod  # before executing it: pickling of its classes needs the name
        try:
            loader_spec.loader.exec_module(mod)
        except Exception as e:
            del sys.modules[name]
            raise AdapterSpecError(f"adapter '{spec}': importing {modpart} raised {type(e).__name__}: "
                                   f"{str(e).splitlines()[0] if str(e) else ''}") from e
        return mod
    try:
        return importlib.import_module(modpart)
    except Exception as e:
        raise AdapterSpecError(f"adapter '{spec}': cannot import {modpart} ({type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''})") from e


def _takes_options(fn):
    import inspect

    try:
        return "run_options" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _instances(obj, where, options=None):
    if isinstance(obj, type):
        if not issubclass(obj, Adapter):
            raise AdapterSpecError(f"{where}: {obj.__name__} is not a subclass of k3ref.gpu_check.adapters.Adapter")
        obj = obj()
    elif callable(obj) and not isinstance(obj, Adapter):
        obj = obj(run_options=options if options is not None else RunOptions()) if _takes_options(obj) else obj()
    items = list(obj) if isinstance(obj, (list, tuple)) else [obj]
    out = []
    for a in items:
        if isinstance(a, str):
            out += resolve(a, options)
        elif isinstance(a, Adapter):
            out.append(a)
        else:
            raise AdapterSpecError(f"{where}: gave {type(a).__name__}, not an adapter")
    for a in out:
        # Remember where it came from: the child process imports that module before unpickling.
        a._k3ref_spec = where if isinstance(where, str) and ":" in where else getattr(a, "_k3ref_spec", None)
        if options is not None:
            a.run_options = options
    return out


def resolve(spec, options=None):
    """The adapters a spec names (a list), given `options` (the run's RunOptions; None: the
    defaults); raises AdapterSpecError with a one-line reason."""
    if not isinstance(spec, str) or ":" not in spec:
        raise AdapterSpecError(f"adapter '{spec}': expected MODULE:NAME (e.g. mypkg.kernels:MyKernel or file.py:MyKernel)")
    mod = import_module_of(spec)
    attr = spec.rpartition(":")[2]
    obj = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AdapterSpecError(f"adapter '{spec}': {mod.__name__} has no attribute '{attr}'")
        obj = getattr(obj, part)
    try:
        return _instances(obj, spec, options)
    except AdapterSpecError:
        raise
    except Exception as e:
        raise AdapterSpecError(f"adapter '{spec}': constructing it raised {type(e).__name__}: {e}".splitlines()[0]) from e


def entry_point_specs():
    """[(entry point name, 'module:attr')] of group k3ref.adapters, the built-in one included."""
    found = []
    try:
        from importlib.metadata import entry_points

        eps = entry_points()
        group = eps.select(group=GROUP) if hasattr(eps, "select") else eps.get(GROUP, [])
        found = [(ep.name, ep.value) for ep in group]
    except Exception:
        found = []
    if not any(value.replace(" ", "") == BUILTIN for _, value in found):
        found.insert(0, ("builtin", BUILTIN))
    return found


def discover(specs=(), conftest_specs=(), entry_points=True, options=None):
    """All adapters, given the run's `options`: entry points (unless entry_points=False), then
    conftest's, then the specs given. Returns (adapters, requested names). Explicitly given specs that fail raise
    AdapterSpecError; an installed entry point that fails becomes an adapter that is not
    available, with the reason. Names must be unique."""
    adapters, requested = [], set()
    if entry_points:
        for name, value in entry_point_specs():
            try:
                adapters += resolve(value, options)
            except AdapterSpecError as e:
                adapters.append(BrokenAdapter(f"entry-point:{name}", str(e)))
    for spec in list(conftest_specs) + list(specs):
        got = resolve(spec, options) if isinstance(spec, str) else _instances(spec, "conftest k3ref_adapters", options)
        requested.update(a.name for a in got)
        adapters += got
    unique, seen = [], {}
    for a in adapters:
        if a.name in seen:
            if type(seen[a.name]) is type(a) and seen[a.name].__dict__.keys() == a.__dict__.keys():
                continue  # the same adapter named twice (an entry point and its spec)
            raise AdapterSpecError(f"two adapters are named '{a.name}' ({type(seen[a.name]).__name__} and "
                                   f"{type(a).__name__}); names must be unique")
        seen[a.name] = a
        unique.append(a)
    assert all(isinstance(a, Adapter) for a in unique)
    return unique, requested


# The built-in adapters, one spec per upstream project's module, resolved as any entry point
# is (never imported here): adding one is one line.
BUILTIN_SPECS = ("k3ref.gpu_check.adapters:kda_adapters",          # libk3gc, FLA, FlashKDA
                 "k3ref.gpu_check.attnres_check:LigerAttnResAdapter",
                 "k3ref.gpu_check.qb_check:torchtitan_adapters",
                 "k3ref.gpu_check.serving_check:serving_adapters")  # FLA's serving paths
# The serving engines' own kernels (their table: serving_check --engines).
ENGINE_SPECS = ("k3ref.gpu_check.engine_vllm:adapters", "k3ref.gpu_check.engine_sglang:adapters",
                "k3ref.gpu_check.engine_tokenspeed:adapters")
TEST_KERNELS = "k3ref.gpu_check.adapters:torch_test_kernels"
# The scale tier's kernels and its reference on either device (scale.py).
SCALE_KERNELS = "k3ref.gpu_check.adapters:scale_kernels"
SCALE_REFERENCE_CUDA = "k3ref.gpu_check.adapters:LibReferenceAdapter"
SCALE_REFERENCE_HOST = "k3ref.gpu_check.adapters:HostReferenceAdapter"
# The tiers beside the default one, by their --k3ref-tier name, resolved as the built-in
# adapters are (never imported here): a tier's module stands on the checks and the adapters,
# which the planner, the executor and the reports that run it need not stand on.
TIERS = {"scale": "k3ref.gpu_check.scale"}


def builtin_adapters(run_options=None):
    """The adapters of the kernels k3ref knows (the package's own `k3ref.adapters` entry
    point): libk3gc's fp64 reference and fp32 kernel and its mutants, FLA, FlashKDA, Liger's
    AttnRes, torchtitan's Quantile Balancing, FLA's serving paths (serving_check.py) and the serving
    engines' own kernels (engine_vllm.py, engine_sglang.py, engine_tokenspeed.py)."""
    return [a for spec in BUILTIN_SPECS + ENGINE_SPECS for a in resolve(spec, run_options)]


def kernel_by_name(name, extra=(), options=None):
    """The adapter called `name` (as reports print it): built-in, a CPU test kernel, or one of
    `extra`. Unknown names raise ValueError with the known ones."""
    known = list(extra) + builtin_adapters(options) + resolve(TEST_KERNELS, options)
    for a in known:
        if a.name == name:
            return a
    raise ValueError(f"no kernel named '{name}'; known: {', '.join(dict.fromkeys(a.name for a in known))}")


def tier(name):
    """The module of tier `name` (scale: scale.py), which plans its kernels and cases, runs a
    case and keeps the tier's record."""
    return import_module_of(TIERS[name])
