"""Isolation: every adapter's checks run in a child process (_worker.py), one child per group.

A group is an adapter (`Adapter.isolation_group`, default its name): its child loads the
kernel once and runs all of the group's checks, so the import, CUDA context and Triton's
in-memory kernels are paid once per group, not per check. When the child dies (an abort, a
segfault, a CUDA error that kills the process) or does not answer within the per-check
timeout (it is then killed), that check is recorded as an error with the cause and the last
lines of the child's stderr, and the next check of the group starts a fresh child. After a
check whose error names CUDA, the child is replaced too (a CUDA context that saw an illegal
address is unusable). An adapter that cannot be pickled runs in this process, and its
results say so (extra['isolated'] = False).
"""
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .checks import CheckResult

STDERR_TAIL_LINES = 40
CUDA_WORDS = ("CUDA", "cuda", "illegal memory access", "device-side assert", "cudaError")


def _tail(path, lines=STDERR_TAIL_LINES, limit=3000):
    try:
        text = Path(path).read_bytes()[-64 * 1024:].decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])[-limit:]


def stderr_summary(tail):
    """One line from a child's stderr: Python's fatal-error line and the innermost frame when
    faulthandler printed them (abort, segfault), else the last line that is not empty."""
    lines = [l.strip() for l in tail.splitlines() if l.strip()]
    if not lines:
        return "(nothing on stderr)"
    at = next((i for i, l in enumerate(lines) if l.startswith("Fatal Python error")), None)
    if at is not None:
        frames = [l for l in lines[at:] if l.startswith("File ")]
        # What the process printed just before it died (a C++ assertion, a CUDA error).
        said = [l for l in lines[:at] if not l.startswith(("File ", "Thread ", "Current thread", "Extension modules"))]
        return ((said[-1] + "; ") if said else "") + lines[at] + (f"; innermost frame: {frames[0]}" if frames else "")
    return lines[-1]


def _signal_name(returncode):
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


class ChildDied(Exception):
    pass


class Worker:
    """One child process holding one loaded adapter."""

    def __init__(self, adapter, device, load_timeout, env=None, timing=True):
        self.adapter = adapter
        self.log = tempfile.NamedTemporaryFile(prefix="k3ref_child_", suffix=".stderr", delete=False)
        package_root = str(Path(__file__).resolve().parents[2])
        child_env = dict(os.environ)
        child_env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in child_env.get("PYTHONPATH", "").split(os.pathsep) if p])
        child_env.setdefault("PYTHONFAULTHANDLER", "1")  # a Python traceback on SIGSEGV/SIGABRT in the log
        t0 = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, "-m", "k3ref.gpu_check._worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=child_env, cwd=os.getcwd())
        spec = getattr(adapter, "_k3ref_spec", None)
        self.failed = None
        self.loaded = None
        try:
            self._send({"sys_path": list(sys.path), "env": dict(env or {}), "device": str(device), "timing": timing,
                        "modules": [spec] if spec else [], "adapter": pickle.dumps(adapter)})
            self.loaded = self._recv(load_timeout, "loading the adapter")
        except (ChildDied, TimeoutError) as e:
            tail = self.stderr_tail()
            self.failed = f"{e}; stderr: {stderr_summary(tail)}"
            self.failed_tail = tail
        self.startup_s = time.perf_counter() - t0

    def _send(self, obj):
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self.proc.stdin.write(struct.pack("<Q", len(data)) + data)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise ChildDied(self._death("before receiving the request")) from e

    def _read_exact(self, n, deadline, what):
        fd = self.proc.stdout.fileno()
        chunks, got = [], 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(what)
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, n - got)
            if not chunk:
                raise ChildDied(self._death(what))
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def _recv(self, timeout, what):
        deadline = time.monotonic() + timeout
        try:
            (n,) = struct.unpack("<Q", self._read_exact(8, deadline, what))
            return pickle.loads(self._read_exact(n, deadline, what))
        except TimeoutError:
            self.kill()
            raise TimeoutError(f"no answer within {timeout:g} s while {what}: the child was killed "
                               f"(hang or too slow; --check-timeout sets the limit)")

    def _death(self, what):
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()
        return f"the child process {_signal_name(self.proc.returncode)} while {what}"

    def run(self, test, timeout):
        self._send({"op": "run", "check": test.check, "case": test.case, "case_path": test.case_path})
        return self._recv(timeout, f"running {test.check}[{test.case}]")

    def stderr_tail(self):
        self.log.flush()
        return _tail(self.log.name)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self):
        if self.proc.poll() is None:
            try:
                self._send({"op": "exit"})
                self.proc.wait(timeout=10)
            except Exception:
                self.kill()
        self.log.close()
        try:
            os.unlink(self.log.name)
        except OSError:
            pass


def _picklable(adapter):
    try:
        pickle.dumps(adapter)
        return None
    except Exception as e:
        return f"{type(e).__name__}: {e}".splitlines()[0][:200]


class Runner:
    """Runs collection.Test objects, each in its group's child process (or in this process
    when isolate=False). Keeps per-adapter timing: child start-up and import, Triton
    compilation, autotune benchmarking, checking."""

    def __init__(self, device="cpu", check_timeout=900.0, load_timeout=900.0, isolate=True, budget_s=0.0,
                 env=None, progress=None):
        self.device = device
        self.check_timeout = float(check_timeout)
        self.load_timeout = float(load_timeout)
        self.isolate = isolate
        self.budget_s = budget_s
        self.env = env or {}
        self.progress = progress
        self.workers = {}
        self.dead = {}       # group -> reason the group's child cannot be started
        self.loaded = {}     # adapter name -> what loading it gave (available, reason, version, timing)
        self.timing = {}     # adapter name -> seconds by part
        self.started = {}    # group -> time its first check started (for the budget)

    # ------------------------------------------------------------------ timing

    def _time(self, adapter):
        return self.timing.setdefault(adapter.name, {
            "children_started": 0, "startup_and_import_s": 0.0, "compile_s": 0.0, "compiles": 0, "autotune_s": 0.0,
            "configs_benchmarked": 0, "check_s": 0.0, "checks_run": 0, "wall_s": 0.0, "triton": None,
            "compile_timing": "", "autotune_timing": ""})

    def _account(self, adapter, cost):
        t = self._time(adapter)
        t["compile_s"] += cost.get("compile_s", 0.0)
        t["compiles"] += cost.get("compiles", 0)
        t["autotune_s"] += cost.get("autotune_s", 0.0)
        t["configs_benchmarked"] += cost.get("configs_benchmarked", 0)
        t["check_s"] += max(0.0, cost.get("wall_s", 0.0) - cost.get("compile_s", 0.0) - cost.get("autotune_s", 0.0))
        t["checks_run"] += 1

    # ------------------------------------------------------------------ children

    def _group(self, adapter):
        fn = getattr(adapter, "isolation_group", None)
        return fn() if callable(fn) else adapter.name

    def _worker(self, adapter):
        group = self._group(adapter)
        w = self.workers.get(group)
        if w is not None and w.proc.poll() is None:
            return w
        if group in self.dead:
            raise ChildDied(self.dead[group])
        t = self._time(adapter)
        w = Worker(adapter, self.device, self.load_timeout, env=self.env)
        if w.failed:
            self.dead[group] = w.failed
            w.close()
            raise ChildDied(w.failed)
        t["children_started"] += 1
        t["startup_and_import_s"] += w.startup_s
        timing_status = w.loaded.get("timing") or {}
        t["triton"] = timing_status.get("triton")
        t["compile_timing"] = timing_status.get("compile", "")
        t["autotune_timing"] = timing_status.get("autotune", "")
        self.loaded[adapter.name] = w.loaded
        self.workers[group] = w
        return w

    def _in_process_load(self, adapter):
        if adapter.name not in self.loaded:
            from . import timing

            t0 = time.perf_counter()
            status = timing.install()
            ok = adapter.available()
            version = ""
            if ok:
                try:
                    version = adapter.version()
                except Exception as e:
                    version = f"version() raised {type(e).__name__}"
            self.loaded[adapter.name] = {"available": ok, "reason": adapter.unavailable_reason,
                                         "import_s": time.perf_counter() - t0, "version": version, "timing": dict(status)}
            t = self._time(adapter)
            t["startup_and_import_s"] += time.perf_counter() - t0
            t["triton"], t["compile_timing"], t["autotune_timing"] = (status.get("triton"), status.get("compile", ""),
                                                                      status.get("autotune", ""))
        return self.loaded[adapter.name]

    # ------------------------------------------------------------------ one test

    def run(self, test):
        """The CheckResult of one collection.Test (skip, pass, fail or error; never raises)."""
        a = test.adapter
        t0 = time.perf_counter()
        if test.skip:
            return self._done(CheckResult(a.name, test.check, test.case, "skip", test.skip), test)
        group = self._group(a)
        first = self.started.setdefault(group, time.monotonic())
        if self.budget_s and time.monotonic() - first > self.budget_s:
            return self._done(CheckResult(a.name, test.check, test.case, "skip",
                                          f"time budget of {self.budget_s:g} s for this kernel exhausted"), test)
        if a.name not in self.loaded:
            why = a.probe(self.device) if hasattr(a, "probe") else None
            if why:
                self.loaded[a.name] = {"available": False, "reason": why + " (probed without loading)"}
        if self.loaded.get(a.name, {}).get("available") is False:
            return self._done(self._unavailable(test, self.loaded[a.name]), test)
        why_not = _picklable(a) if self.isolate else "isolation turned off"
        if why_not:
            res = self._run_here(test, why_not)
        else:
            res = self._run_isolated(test)
        self._time(a)["wall_s"] += time.perf_counter() - t0
        return self._done(res, test)

    def _done(self, res, test):
        if self.progress:
            self.progress(f"{res.adapter} {res.check}[{res.case}] {res.status} {res.seconds:.1f}s: {res.reason[:160]}")
        return res

    def _unavailable(self, test, loaded):
        reason = loaded.get("reason") or loaded.get("error") or "unknown"
        return CheckResult(test.adapter.name, test.check, test.case, "skip", "not available: " + reason,
                           extra={"unavailable": True})

    def _run_here(self, test, why):
        a = test.adapter
        loaded = self._in_process_load(a)
        if not loaded["available"]:
            return self._unavailable(test, loaded)
        from .. import goldens
        from . import timing

        before = timing.COUNTERS.snapshot()
        t0 = time.perf_counter()
        try:
            case = goldens.load_case(test.case_path) if test.case_path else None
            res = a.run_check(test.check, case, self.device)
        except Exception as e:
            import traceback

            res = CheckResult(a.name, test.check, test.case, "error", f"{type(e).__name__}: {e}".splitlines()[0][:300],
                              extra={"traceback": traceback.format_exc()[-2000:]})
        after = timing.COUNTERS.snapshot()
        cost = {k: after[k] - before[k] for k in after}
        cost["wall_s"] = time.perf_counter() - t0
        res.seconds = res.seconds or cost["wall_s"]
        self._account(a, cost)
        res.extra["isolated"] = False
        res.extra["not_isolated_because"] = why
        return res

    def _run_isolated(self, test):
        a = test.adapter
        group = self._group(a)
        t0 = time.perf_counter()
        try:
            w = self._worker(a)
        except ChildDied as e:
            return CheckResult(a.name, test.check, test.case, "error", f"could not load the kernel: {e}",
                               extra={"crash": True, "load_failed": True})
        if not w.loaded.get("available"):
            return self._unavailable(test, w.loaded)
        try:
            reply = w.run(test, self.check_timeout)
        except (ChildDied, TimeoutError) as e:
            tail = w.stderr_tail()
            self.workers.pop(group, None)
            w.close()
            res = CheckResult(a.name, test.check, test.case, "error", f"{e}; stderr: {stderr_summary(tail)}"[:600],
                              extra={"crash": True, "stderr_tail": tail})
            res.seconds = time.perf_counter() - t0
            self._time(a)["check_s"] += res.seconds
            return res
        res = reply["result"]
        self._account(a, reply["timing"])
        res.extra["isolated"] = True
        if res.status == "error" and any(word in res.reason for word in CUDA_WORDS):
            # The CUDA context may be corrupt: the next check gets a fresh child.
            self.workers.pop(group, None)
            w.close()
        return res

    def availability(self, adapter):
        """What loading the adapter gave, or None when no check of it ran."""
        return self.loaded.get(adapter.name)

    def close(self):
        for w in self.workers.values():
            w.close()
        self.workers.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
