"""The adapter protocol: what every check, adapter and front end of the harness agrees on.

An adapter (a subclass of `Adapter`) states what it is (`name`, `family`, `kind`), what it
supports (`checks`, `golden_ops`, `domain`, `case_unsupported`), how it runs (`load`, `run_check`,
returning a `CheckResult`) and its precision contract and policy (adapters.py documents
the fields in full); `source_identity` names the source a kernel module was loaded from. The
run configuration is `RunOptions` (frozen) with `KERNEL_PATHS`, the kernels' checkout paths.
This module imports nothing else of the harness: the checks import it, the adapters import
it and the checks, the registry resolves the adapters by name (never importing them), the
front ends use the registry.
"""
import hashlib
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from .._data import FORMAT_NAMES
from ..kernel_domains import domain_of


# The checkout paths of the kernels: (RunOptions name, environment variable, what it holds). An
# option of a front end (--fla-path, --k3ref-fla-path) wins over its variable; kernel_paths_of
# reads the variables, once, for the run's RunOptions, and adapters read only those (path_of).
KERNEL_PATHS = (("fla_path", "K3REF_FLA_PATH", "directory holding the fla package"),
                ("flashkda_path", "K3REF_FLASHKDA_PATH", "directory holding the flash_kda package and its extension"),
                ("liger_path", "K3REF_LIGER_PATH", "Liger-Kernel checkout (holding src/liger_kernel) for its AttnRes "
                                                   "kernel"),
                ("torchtitan_path", "K3REF_TORCHTITAN_PATH", "torchtitan checkout (holding torchtitan/) for its "
                                                             "Quantile Balancing"),
                ("vllm_path", "K3REF_VLLM_PATH", "directory holding vllm/model_executor/layers/fla/ops/ (vLLM's kernels)"),
                ("tokenspeed_path", "K3REF_TOKENSPEED_PATH", "directory holding the tokenspeed_kernel package"),
                ("sglang_path", "K3REF_SGLANG_PATH", "directory holding sglang/srt/layers/attention/fla/ (SGLang's kernels)"),
                ("lib", "K3GC_LIB", "path of libk3gc.so (without one, the build directories' build*/gpu_check/)"))


# This module is imported by the plugin's controller, which imports no torch (its start-up is
# the run's): torch is imported where a tensor or a device is met.

# A float format's bits as the integers of its width: bitwise comparison, where -0.0 differs
# from 0.0 and a NaN's payload counts.
BITS_OF = {"float64": "int64", "float32": "int32", "bfloat16": "int16", "float16": "int16"}


def bits(t):
    """t's elements as the integers of their bits (the float formats; other dtypes as they are)."""
    import torch

    t = t.contiguous()
    name = str(t.dtype).removeprefix("torch.")
    return t.view(getattr(torch, BITS_OF[name])) if name in BITS_OF else t


class TorchDtype:
    """A class attribute naming a torch dtype, which reads as the dtype (torch imported then)."""

    def __init__(self, name):
        self.name = name

    def __get__(self, obj, owner=None):
        import torch

        return getattr(torch, self.name)


class NotSupported(Exception):
    """A case needs what this version of the kernel does not accept (reported not applicable)."""


class UsageError(Exception):
    """A run's options or selection that cannot be run: one line that names them (exit 2)."""


@dataclass(frozen=True)
class RunOptions:
    """Every option of a run, as the plugin's command line gave it (`--k3ref-*`)."""

    adapters: tuple = ()          # MODULE:NAME specs
    builtin: bool = False         # also the built-in adapters and installed entry points
    only: tuple = None            # adapter names (each must exist)
    no_mutants: bool = False
    checks: tuple = None
    cases: tuple = None
    goldens: str = None
    device: str = None
    known_limitations: str = None
    policy: str = None            # every KDA adapter judged under this policy instead of its own
    check_timeout: float = 900.0
    load_timeout: float = 900.0
    budget: float = 0.0
    isolate: bool = True
    report: str = None            # directory of report.html / report.json
    warmup: bool = True
    warmup_jobs: int = None
    warmup_timeout: float = 1800.0
    warmup_shards: int = None     # None: warmup.BACKWARD_SHARDS
    autotune_configs: str = "winner"
    cache_dir: str = None
    kernel_paths: tuple = ()      # ((KERNEL_PATHS name, absolute path), ...): kernel_paths_of
    tier: str = "default"         # default | scale (the scale tier's cases, scale.py)
    backward: str = "default"     # default | all: the gradient goldens of the backward check (backward.py)
    scale_limits: str = None      # the scale tier's "name=value,..." (scale.limits_from; None: full size)
    settings: tuple = ()          # ((name, value), ...): an adapter factory's own settings (--k3ref-set)

    def kernel_path(self, name):
        """The path the run gives for KERNEL_PATHS `name` ('fla_path', 'lib', ...), or None."""
        return dict(self.kernel_paths).get(name)

    def setting(self, name, default=None):
        """The value of setting `name` (a string), else `default`."""
        return dict(self.settings).get(name, default)


def kernel_paths_of(given):
    """The kernel paths of a run: for each KERNEL_PATHS name, the value `given` maps it to (the
    front end's option), else its environment variable; absolute. The one place those
    variables are read (a front end calls this once; the run's processes get the result)."""
    import os

    out = []
    for name, env, _ in KERNEL_PATHS:
        value = given.get(name) or os.environ.get(env)
        if value:
            out.append((name, str(Path(value).expanduser().resolve())))
    return tuple(out)


def settings_of(items):
    """((name, value), ...) of NAME=VALUE strings (--k3ref-set); a malformed one is a UsageError."""
    out = []
    for item in items or ():
        name, eq, value = item.partition("=")
        if not eq or not name.strip():
            raise UsageError(f"setting {item!r} (--set, --k3ref-set): expected NAME=VALUE")
        out.append((name.strip(), value))
    return tuple(out)


@dataclass
class CheckResult:
    adapter: str
    check: str
    case: str
    status: str
    reason: str
    ratio: float = None          # rel RMS / floor, where it applies
    metrics: dict = None
    windows: list = None         # error by token window (golden checks)
    window_tokens: int = None
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)


# A test: one adapter x case x check (collection.py collects them); a mutant's one test runs all its checks.
@dataclass
class Test:
    adapter: object
    check: str
    case: str
    case_path: str = None
    skip: str = None        # the adapter does not support this case: the reason
    xfail: str = None       # a known limitation: the reason
    ends_process: bool = False  # that limitation ends its process: the test runs in a scope of its own

    @property
    def id(self):
        if self.case == "-":  # a check that takes no case
            return f"{self.adapter.name}-{self.check}"
        return f"{self.adapter.name}-{self.case}-{self.check}"


@dataclass
class MutantTest:
    adapter: object
    tests: list = field(default_factory=list)
    xfail: str = None

    @property
    def id(self):
        return f"{self.adapter.name}-zoo-caught"

    check = "caught"
    case = "zoo"


def shapes_of(inputs):
    q, v = inputs["q"], inputs["v"]
    B, T, H, K = q.shape
    return dict(B=B, T=T, H=H, K=K, HV=v.shape[2], V=v.shape[3])


def input_dtype_of(inputs: dict) -> str | None:
    """The format name ("bf16") of a case's q, for the input_dtypes key; None without q."""
    q = inputs.get("q") if inputs else None
    if q is None:
        return None
    name = str(q.dtype)
    return FORMAT_NAMES.get(name.removeprefix("torch."), name)


def outside_domain(why):
    """The reason a report gives a case outside the kernel's domain (not a failure): None stays None."""
    return None if why is None else f"n/a (outside the kernel's domain: {why})"


KDA_METAMORPHIC = ("causality", "suffix", "varlen", "split", "determinism", "poisoned_memory", "inputs_unchanged")


class Adapter:
    """The protocol every adapter follows (see the module's docstring)."""

    name = "?"
    family = "kda"
    kind = "kernel"  # kernel | reference | mutant
    checks = ("golden",)
    golden_ops = ()
    policy = "recurrent"
    policy_reason = ""
    contract = ""
    output_dtype = TorchDtype("bfloat16")  # the format of the outputs (o): their rounding floor
    state_dtype = TorchDtype("float32")    # the format of the state it returns and takes back (final, initial)
    requires_cuda = False  # True: reported unavailable without a CUDA device, without loading it
    # The run's configuration, frozen: the registry gives every adapter it makes the run's
    # options (registry.resolve(spec, options)); an adapter made by hand has the defaults.
    run_options = RunOptions()
    # What the kernel accepts, in the schema of policy/kernel_domains.json (k3ref.kernel_domains,
    # docs/kernel-domains.md): a dict or a KernelDomain; None accepts everything.
    domain = None

    def __init__(self):
        self._loaded = None
        self._reason = ""

    def __getstate__(self):
        # A loaded kernel (modules, function handles) stays in the process that loaded it.
        state = dict(self.__dict__)
        state["_loaded"], state["_reason"] = None, ""
        for key in getattr(self, "_unpicklable", ()):
            state.pop(key, None)
        return state

    def load(self):
        """Imports the kernel; raises (any exception) when it is not available."""

    def path_of(self, name):
        """The checkout of KERNEL_PATHS `name` ('fla_path', ...): the adapter's own attribute of
        that name when one is set (a user's adapter made with a path), else the run's."""
        return getattr(self, name, None) or self.run_options.kernel_path(name)

    def available(self):
        if self._loaded is None:
            try:
                self.load()
                self._loaded = True
            except Exception as e:  # any import failure means "not available", with the reason
                self._loaded = False
                self._reason = f"{type(e).__name__}: {e}".splitlines()[0][:500]
        return self._loaded

    @property
    def unavailable_reason(self):
        return self._reason

    def version(self):
        """A one-line version of the kernel (package version, commit), or ''."""
        return ""

    def probe(self, device):
        """A cheap test in the parent process, before any child is started: None, or why the
        kernel cannot be available on this host (no CUDA device for a CUDA kernel, a missing
        checkout). It must not import the kernel."""
        if self.requires_cuda:
            if not str(device).startswith("cuda"):
                return f"needs a CUDA device; the run is on {device}"
            import torch

            if not torch.cuda.is_available():
                return "no CUDA device"
        return None

    def domain_reason(self, op, params, shapes=None, input_dtype=None):
        """None, or why a case (operator `op`, or None: not checked; golden params; shapes as
        shapes_of gives them) is outside the kernel's declared `domain`."""
        domain = domain_of(self.domain, self.name)
        return domain.outside(op, params, shapes, input_dtype) if domain is not None else None

    def suite_ops(self):
        """The golden operators whose cases this adapter's checks read from the suite."""
        return tuple(self.golden_ops)

    def case_unsupported(self, case):
        """None, or why this golden case is outside the kernel's scope."""
        if case.op not in self.golden_ops:
            return f"takes {', '.join(self.golden_ops) or 'no golden operator'}"
        return outside_domain(self.domain_reason(case.op, case.params))

    def cases(self, check, suite):
        """(case id, case or None, None or the reason it is not supported) for each case of
        this check. The golden check runs on every case of `golden_ops` in the suite; other
        checks build their own inputs and run once, on the case id '-'."""
        if check == "golden":
            for case in suite:
                if case.op in self.golden_ops:
                    yield case.name, case, self.case_unsupported(case)
        else:
            yield "-", None, None

    def run_check(self, check, case, device):
        raise NotImplementedError(f"{type(self).__name__} does not implement run_check")


# The name the adapters of earlier versions derived from.
LoadableAdapter = Adapter


class BrokenAdapter(Adapter):
    """Stands for an installed entry point that cannot be resolved: one check, 'load', that
    is never available (a skip with the reason, a failure when that kernel was asked for)."""

    checks = ("load",)

    def __init__(self, name, reason):
        super().__init__()
        self.name = name
        self.reason = reason

    def load(self):
        raise RuntimeError(self.reason)


def _tracked_by_git(where):
    """Whether git tracks the files of `where` in the work tree holding it: a package copied
    into an ignored folder of another checkout (k3ref's own .thirdparty/, measured on the H200:
    FLA was reported as k3ref's commit) is not that checkout's source. False without git."""
    try:
        out = subprocess.run(["git", "-C", str(where), "ls-files", "--", "."], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and bool(out.stdout.strip())


def _git_commit(start):
    """The commit checked out in the git work tree holding `start` (read from .git's files),
    or None; None too when that work tree does not track `start`'s files (_tracked_by_git)."""
    if not _tracked_by_git(start):
        return None
    for d in [start, *start.parents][:6]:
        git = d / ".git"
        try:
            if git.is_file():  # a worktree or submodule: "gitdir: <path>"
                git = (d / git.read_text(errors="replace").strip().partition("gitdir:")[2].strip()).resolve()
            if not git.is_dir():
                continue
            head = (git / "HEAD").read_text().strip()
            if not head.startswith("ref:"):
                return head[:40]
            ref = head.partition("ref:")[2].strip()
            bases = [git]
            if (git / "commondir").is_file():  # a worktree keeps its refs in the main .git
                bases.append((git / (git / "commondir").read_text().strip()).resolve())
            for base in bases:
                if (base / ref).is_file():
                    return (base / ref).read_text().strip()[:40]
                if (base / "packed-refs").is_file():
                    for line in (base / "packed-refs").read_text().splitlines():
                        if line.endswith(" " + ref):
                            return line.split()[0][:40]
        except OSError:
            return None
    return None


_SOURCE_IDENTITY = {}


def source_identity(mod):
    """Which source a kernel module is: 'git <commit>' of the checkout it lies in, else
    'files sha256:<12 hex>' over its package's .py files (relative paths and contents), so that
    two trees of one package version months apart are told apart in every report."""
    where = Path(getattr(mod, "__file__", "") or "").resolve().parent
    if where in _SOURCE_IDENTITY:
        return _SOURCE_IDENTITY[where]
    commit = _git_commit(where) if where.name else None
    if commit:
        ident = f"git {commit}"
    else:
        h = hashlib.sha256()
        for f in sorted(where.rglob("*.py")):
            h.update(str(f.relative_to(where)).encode() + b"\0" + f.read_bytes() + b"\0")
        ident = f"files sha256:{h.hexdigest()[:12]}"
    _SOURCE_IDENTITY[where] = ident
    return ident


def write_json(obj, path, **dumps):
    """`obj` as JSON at `path`, replaced atomically: a reader sees the last whole file or none."""
    import json
    import os

    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(obj, **dumps))
    os.replace(tmp, path)

