"""Where a kernel's time goes: import, Triton compilation, autotune benchmarking, checking.

Best effort, in the process that runs the kernel (a pytest-xdist worker). Before the adapter
is loaded, `install()` wraps Triton's compiler entry (`triton.compiler.compile`, the function
`JITFunction.run` calls for a new specialisation; a load from Triton's disk cache goes through
it too and costs little) and the autotuner's benchmark of one configuration
(`Autotuner._bench`, which compiles that configuration on its first call). Compilation inside
a benchmark is counted as compilation, not as benchmarking. Without Triton (the CPU test
kernels, CUDA-only kernels) both are zero and `status` says why.
"""
import time


class Counters:
    def __init__(self):
        self.compile_s = 0.0
        self.compiles = 0
        self.autotune_s = 0.0
        self.configs_benchmarked = 0
        self._bench_depth = 0
        self._compile_in_bench = 0.0

    def snapshot(self):
        return {"compile_s": self.compile_s, "compiles": self.compiles, "autotune_s": self.autotune_s,
                "configs_benchmarked": self.configs_benchmarked}


COUNTERS = Counters()
STATUS = {"triton": None, "compile": "not measured: hooks not installed", "autotune": "not measured: hooks not installed"}


def _wrap_compile(fn):
    if getattr(fn, "_k3ref_timed", False):
        return fn

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            COUNTERS.compile_s += dt
            COUNTERS.compiles += 1
            if COUNTERS._bench_depth:
                COUNTERS._compile_in_bench += dt

    timed._k3ref_timed = True
    return timed


def _wrap_bench(fn):
    if getattr(fn, "_k3ref_timed", False):
        return fn

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        before = COUNTERS._compile_in_bench
        COUNTERS._bench_depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            COUNTERS._bench_depth -= 1
            COUNTERS.autotune_s += time.perf_counter() - t0 - (COUNTERS._compile_in_bench - before)
            COUNTERS.configs_benchmarked += 1

    timed._k3ref_timed = True
    return timed


def install():
    """Installs the hooks when Triton is importable; returns STATUS."""
    try:
        import triton
    except Exception as e:  # not installed, or broken: nothing of Triton's to time
        STATUS.update(triton=None, compile=f"absent: triton is not importable ({type(e).__name__})",
                      autotune=f"absent: triton is not importable ({type(e).__name__})")
        return STATUS
    STATUS["triton"] = getattr(triton, "__version__", "?")
    patched = []
    import importlib

    for modname in ("triton.compiler.compiler", "triton.compiler", "triton.runtime.jit", "triton"):
        try:
            mod = importlib.import_module(modname)
        except Exception:
            continue
        if callable(getattr(mod, "compile", None)):
            mod.compile = _wrap_compile(mod.compile)
            patched.append(f"{modname}.compile")
    try:
        from triton.runtime.jit import JITFunction

        attr = JITFunction.__dict__.get("compile")
        if isinstance(attr, staticmethod):
            JITFunction.compile = staticmethod(_wrap_compile(attr.__func__))
            patched.append("JITFunction.compile")
        elif callable(attr):  # a plain function: the wrapper binds self like the original
            JITFunction.compile = _wrap_compile(attr)
            patched.append("JITFunction.compile")
    except Exception:
        pass
    STATUS["compile"] = ("measured around " + ", ".join(patched)) if patched else "not measured: no compile entry found"
    try:
        from triton.runtime.autotuner import Autotuner

        Autotuner._bench = _wrap_bench(Autotuner._bench)
        STATUS["autotune"] = "measured around Autotuner._bench (compilation inside it counted as compile)"
    except Exception as e:
        STATUS["autotune"] = f"not measured: {type(e).__name__}: {e}"[:200]
    return STATUS
