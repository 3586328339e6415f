"""The k3ref harness's runner: real kernels against the k3ref references, one pytest test per
adapter x case x check.

    pytest -p k3ref.pytest_plugin --k3ref-adapter mypkg.kernels:MyKda      # or in conftest.py:
    k3ref_adapters = ["mypkg.kernels:MyKda"]

Tests are named `ADAPTER-CASE-CHECK` (e.g. `my.kda-kda_t100-golden`), node ids
`k3ref/GROUP::NAME`, so `-k`, `-x`, `--junitxml` work as for any test.
`python3 -m k3ref.gpu_check run` calls pytest with this plugin.

Isolation, on pytest-xdist and pytest-timeout: this process never imports adapter code. A
planning child (`pytest --collect-only` with the same arguments) selects the adapters and
collects the tests; the workers (`-n`, at least one), started beside it, build their items
from its plan, each isolation group on one worker (`--dist loadscope`). A crash, abort or exit
of a worker fails the test it was running (with the last lines of its stderr), and the rest of
its work goes to an idle worker or, when none took it, to a replacement; a
test that runs past `--k3ref-check-timeout` (plus `--k3ref-load-timeout` when it loads its
kernel) is stopped by pytest-timeout, which ends the worker. After a check whose error names
CUDA the worker ends too, so the next check gets a fresh CUDA context.

Fail closed: an adapter spec that does not load, or a planning child that dies, is a usage
error; an adapter you named that is not available fails its tests; a known limitation
(known_limitations.json, or --k3ref-known-limitations FILE) runs as a strict xfail; a mutant
is one test that passes when a check catches it; a session in which no k3ref check executed,
or in which a collected test has no result, fails; `--k3ref-report DIR` writes report.html and
report.json after the session, and a report that cannot be written fails the session.

`--k3ref-tier scale` runs the scale tier instead (k3ref.gpu_check.scale, docs/gpu_check.md):
one test per kernel x scale case through the same planning child and workers, a scale
mutant's `MUTANT-scale-caught` test judged here from its cases' results, and DIR/scale.json
(`--k3ref-report DIR`) in place of report.html and report.json.

The plugin is registered by the package's `pytest11` entry point; from a source tree, pass
`-p k3ref.pytest_plugin`.
"""
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

PLAN = pytest.StashKey()
STATE = pytest.StashKey()
PROGRESS = "k3ref-plan: "
CUDA_WORDS = ("CUDA", "cuda", "illegal memory access", "device-side assert", "cudaError")


def pytest_addoption(parser):
    from k3ref.gpu_check.protocol import KERNEL_PATHS
    from k3ref.gpu_check.warmup import SHARDS_HELP

    g = parser.getgroup("k3ref", "kernels against the k3ref goldens")
    add = g.addoption
    add("--k3ref-adapter", action="append", default=[], metavar="MODULE:NAME",
        help="an adapter to check (class, instance or function returning adapters; MODULE may be a file.py); "
             "repeatable")
    add("--k3ref-builtin", action="store_true",
        help="also collect the built-in adapters and installed entry points (not asked for: unavailable ones skip)")
    add("--k3ref-only", metavar="NAMES", help="comma-separated adapter names to run (each must exist; each counts as "
                                               "asked for)")
    add("--k3ref-no-mutants", action="store_true", help="leave out mutants not named in --k3ref-only or --k3ref-adapter")
    add("--k3ref-checks", metavar="NAMES", help="comma-separated check names (default all)")
    add("--k3ref-cases", metavar="NAMES", help="comma-separated golden case names (default all; checks that build "
                                               "their own inputs are not filtered); under --k3ref-tier scale, the "
                                               "scale tier's case names")
    add("--k3ref-tier", choices=("default", "scale"), default="default",
        help="scale: the built-in KDA kernels, the scale mutants and the KDA adapters given at K3's production "
             "shapes and index limits, one test per kernel x scale case (k3ref.gpu_check.scale; "
             "--k3ref-report DIR writes DIR/scale.json); default: the golden and metamorphic checks")
    add("--k3ref-backward", choices=("default", "all"), default="default",
        help="the gradient goldens of the backward check: default, the four whose shapes share two of FLA's "
             "backward autotune keys (k3ref.gpu_check.collection.DEFAULT_BACKWARD_GOLDENS), or those --k3ref-cases names; "
             "all, every gradient golden (each further shape costs its backward autotuning, minutes on a cold cache)")
    add("--k3ref-goldens", metavar="DIR", help="golden directory (default: $K3REF_GOLDENS, else the checkout's "
                                               "goldens/, else the suite installed with the package)")
    add("--k3ref-device", metavar="DEVICE", help="torch device (default: cuda when available, else cpu)")
    add("--k3ref-known-limitations", metavar="FILE", help="known-limitations file (default: the package's)")
    add("--k3ref-policy", metavar="NAME", help="judge every KDA kernel under this policy instead of the one its adapter "
                                               "declares (a policy of the table, floor:<m>, rel-rms:<r>)")
    add("--k3ref-check-timeout", type=float, default=900.0, metavar="S",
        help="seconds one check may take before its worker is ended (default 900)")
    add("--k3ref-load-timeout", type=float, default=900.0, metavar="S",
        help="seconds planning, or loading a kernel in a worker, may take (default 900)")
    add("--k3ref-budget", type=float, default=0.0, metavar="S",
        help="seconds per kernel; its later checks are skipped (0: none)")
    add("--k3ref-no-isolation", action="store_true",
        help="run the checks in the pytest process (no workers: a crash ends the run; for debugging)")
    add("--k3ref-report", metavar="DIR", help="write report.html, report.json and plots/ into DIR after the session")
    add("--k3ref-no-warmup", action="store_true", help="skip the warm-up (compiling the planned shapes) before the "
                                                       "checks")
    add("--k3ref-warmup-jobs", type=int, default=None, metavar="N",
        help="warm-up worker processes at a time (default: the CPU count)")
    add("--k3ref-warmup-timeout", type=float, default=1800.0, metavar="S", help="seconds one warm-up worker may take")
    add("--k3ref-warmup-shards", type=int, default=None, metavar="N", help=SHARDS_HELP)
    add("--k3ref-autotune-configs", choices=("winner", "all"), default="winner",
        help="all: every golden check once per autotune configuration of each autotuned kernel (deep mode); "
             "winner: the configuration the autotuner picks (default)")
    add("--k3ref-cache-dir", metavar="DIR",
        help="cache directory (default: $K3REF_CACHE_DIR, else ~/.cache/k3ref): Triton's compiled kernels and "
             "autotune results in DIR/triton; save and restore DIR between CI runs")
    add("--k3ref-scale-limits", metavar="NAME=VALUE,...",
        help="the scale tier at smaller limits, names of k3ref.gpu_check.scale.Limits (default: $K3REF_SCALE_LIMITS, "
             "else K3's full sizes)")
    add("--k3ref-set", action="append", default=[], metavar="NAME=VALUE",
        help="a setting of an adapter factory that takes `run_options` (run_options.setting(NAME)); repeatable")
    for dest, env, text in KERNEL_PATHS:
        add("--k3ref-" + dest.replace("_", "-"), dest="k3ref_" + dest, metavar="PATH", help=f"{text} (default: ${env})")
    add("--k3ref-plan-out", metavar="FILE", help=argparse_suppress())


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


def _conftest_specs(config):
    specs = []
    for plugin in config.pluginmanager.get_plugins():
        listed = getattr(plugin, "k3ref_adapters", None)
        if listed is not None and getattr(plugin, "__name__", "").rpartition(".")[2] == "conftest":
            specs += list(listed)
    return specs


def _role(config):
    """worker (a pytest-xdist worker), planner (the planning child), isolated (the controller
    of an isolated run), in_process (--k3ref-no-isolation), or None (k3ref not asked for)."""
    if hasattr(config, "workerinput"):
        return "worker" if config.workerinput.get("k3ref_plan") else None
    if config.getoption("k3ref_plan_out"):
        return "planner"
    if not (config.getoption("k3ref_adapter") or config.getoption("k3ref_builtin") or _conftest_specs(config)
            or config.getoption("k3ref_tier") == "scale"):  # the scale tier has built-in kernels of its own
        return None
    return "in_process" if config.getoption("k3ref_no_isolation") else "isolated"


class UsageError(pytest.UsageError):
    pass


# --------------------------------------------------------------------------- the controller


def _stderr_line(text):
    """The line of a child's stderr that says why it stopped: pytest's 'ERROR: k3ref: ...'
    usage line, else faulthandler's fatal-error line, else the last line."""
    from k3ref.gpu_check.report import stderr_summary

    for line in text.splitlines():
        if line.startswith("ERROR: k3ref: "):
            return line[len("ERROR: "):]
    return stderr_summary(text)


def _start_planner(config, opts, path):
    """Starts the planning child, which writes the plan to `path`, says so (READY) and then
    runs the warm-up; returns it (a _PlanningChild). Nobody waits for it here: pytest-xdist
    starts the workers while it plans (_await_plan)."""
    # The child imports what this process would: this package first, then this process's path.
    package_root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([package_root] + [p for p in sys.path if p and os.path.isdir(p)]
                                                      + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.setdefault("PYTHONFAULTHANDLER", "1")
    # Not a worker of this run (nor of an outer xdist run holding this one): a worker's stderr
    # goes into its log, and the child's one-line usage error must come back here.
    for variable in (LOG_DIR_VARIABLE, "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
        env.pop(variable, None)
    args = [a for a in config.invocation_params.args]
    cmd = [sys.executable, "-m", "pytest", *args, "--collect-only", "-qq", "-p", "no:cacheprovider",
           "--k3ref-plan-out", str(path)]
    if "k3ref.pytest_plugin" not in " ".join(args):
        cmd += ["-p", "k3ref.pytest_plugin"]
    if config.getoption("collectonly"):  # nothing will run: nothing to compile for
        cmd += ["--k3ref-no-warmup"]
    return _PlanningChild(cmd, str(config.invocation_params.dir), env, opts.load_timeout + (
        opts.warmup_timeout if opts.warmup else 0.0))


PLAN_FILE, PLAN_FAILED_FILE = "plan.json", "plan.failed"


def _await_plan(config):
    """The controller's plan (config.stash[PLAN]): waits for the planning child the first time,
    or raises UsageError (one line) when it ended without a plan; the workers, waiting for the
    plan too (_worker_plan), are told by PLAN_FAILED_FILE."""
    if PLAN in config.stash:
        return config.stash[PLAN]
    from k3ref.gpu_check import run as run_plan

    state = config.stash[STATE]
    child, workdir = state["planner"], state["workdir"]
    error = None
    if not child.wait_ready():
        child.close()
        text = child.last_stderr
        if child.timed_out:
            error = (f"k3ref: planning the run (importing the adapters) took more than {child.timeout:g} s: "
                     f"stopped (--k3ref-load-timeout)")
        else:
            error = (f"{_stderr_line(text)}" if "ERROR: k3ref: " in text else
                     f"k3ref: the planning child (importing the adapters) exited with status "
                     f"{child.proc.returncode} without a plan: {_stderr_line(text)}")
    else:
        try:
            plan = run_plan.read(workdir / PLAN_FILE)
        except ValueError as e:
            child.close(kill=True)
            error = f"k3ref: {e}"
    if error is not None:
        state.pop("planner", None)
        (workdir / PLAN_FAILED_FILE).write_text(error)
        xml = _junit(config)
        if xml is not None:  # a usage error writes no JUnit file, as before the session began
            config.pluginmanager.unregister(xml)
        raise UsageError(error)
    config.stash[PLAN] = plan
    state["marks"]["plan ready"] = time.time()
    if config.option.maxworkerrestart is None:
        # Every crash is one test's: at most one per test. pytest-xdist read the bound when it
        # started (before the plan); its session keeps it in this attribute (3.1 to 3.8).
        dsession = config.pluginmanager.getplugin("dsession")
        if dsession is not None and hasattr(dsession, "_max_worker_restart"):
            dsession._max_worker_restart = config.option.maxworkerrestart = len(plan["tests"]) + 4
    return plan


def _worker_plan(config):
    """A worker's plan: the file the planning child writes, waited for while the controller
    has none yet (the worker started beside the planning child, and imports torch meanwhile);
    None when the planning failed (the controller reports it) or the controller is gone."""
    from k3ref.gpu_check import run as run_plan

    path = Path(config.workerinput["k3ref_plan"])
    parent, deadline = os.getppid(), time.monotonic() + run_plan.options_of(config).load_timeout + 60
    if not path.exists():  # the checks' first imports (torch, and Triton for FLA's and Liger's kernels), made meanwhile
        import importlib

        for module in ("torch", "triton"):
            try:
                importlib.import_module(module)
            except Exception:  # the check that needs it reports it
                pass
    while not path.exists():
        if (path.with_name(PLAN_FAILED_FILE).exists() or not path.parent.is_dir() or os.getppid() != parent):
            return None
        if time.monotonic() > deadline:
            raise UsageError(f"k3ref: no run plan at {path} after the planning child's time limit")
        time.sleep(0.02)
    return run_plan.read(path)


READY = "ready"


class _PlanningChild:
    """The planning child process: its progress lines echoed here as they come, its stderr
    kept in a file, a timer that stops it after `timeout` seconds."""

    def __init__(self, cmd, cwd, env, timeout):
        self.timeout, self.timed_out, self.last_stderr = timeout, False, ""
        self.err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=self.err)
        self.ready, self.saw_ready = threading.Event(), False
        self.timer = threading.Timer(timeout, self._kill_late)
        self.timer.start()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _kill_late(self):
        if self.proc.poll() is None:  # a child that ended in time is no timeout, however late it is collected
            self.timed_out = True
            self.proc.kill()

    def _read(self):
        try:
            for raw in self.proc.stdout:  # its progress (shape plan, warm-up), not its collection listing
                line = raw.decode(errors="replace")
                if line.startswith(PROGRESS):
                    if line[len(PROGRESS):].strip() == READY:
                        self.saw_ready = True
                        self.ready.set()
                    else:
                        print(line[len(PROGRESS):], end="", flush=True)
        finally:
            self.proc.stdout.close()
            self.proc.wait()
            self.timer.cancel()
            self.ready.set()

    def wait_ready(self):
        """True once the plan is written; False when the child ended (or was stopped) first."""
        self.ready.wait()
        return self.saw_ready

    def stderr_text(self):
        self.err.seek(0)
        return self.err.read()[-64 * 1024:].decode(errors="replace")

    def close(self, kill=False, timeout=None):
        """Waits for the child (the warm-up's end) at most `timeout` seconds, or stops it."""
        if kill:
            self.proc.kill()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.reader.join(timeout=5)
        self.timer.cancel()
        if not self.err.closed:
            self.last_stderr = self.stderr_text()
            self.err.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_cmdline_main(config):
    """Before pytest-xdist reads -n: the plan, made in a child, and the workers it needs."""
    role = _role(config)
    if role in ("isolated", "in_process", "planner"):
        from k3ref.gpu_check import protocol, run as run_plan

        try:
            opts = run_plan.options_of(config)
        except protocol.UsageError as e:
            raise UsageError(f"k3ref: {e}") from None
        if opts.report and Path(opts.report).exists() and not Path(opts.report).is_dir():
            raise UsageError(f"k3ref: --k3ref-report {opts.report}: exists and is not a directory")
        for flag, value in (("--k3ref-warmup-shards", opts.warmup_shards), ("--k3ref-warmup-jobs", opts.warmup_jobs)):
            if value is not None and value < 1:
                raise UsageError(f"k3ref: {flag} {value}: must be at least 1")
        run_plan.apply_environment(opts)
        config.stash[STATE] = {"opts": opts, "reports": {}, "collected": None, "t0": time.time(),
                                 "marks": {}}  # the timeline's moments (report.timeline)
        if role == "planner":  # the child plans; the reports are the session's
            config.option.xmlpath = None
        if role == "isolated":
            missing = [name for name, plugin in (("pytest-xdist", "xdist"), ("pytest-timeout", "timeout"))
                       if not config.pluginmanager.hasplugin(plugin)]
            if missing:
                raise UsageError(f"k3ref: the isolated run needs {' and '.join(missing)} (Debian: python3-pytest-xdist, "
                                 f"python3-pytest-timeout); or pass --k3ref-no-isolation to run in this process")
            workdir = Path(tempfile.mkdtemp(prefix="k3ref_run_"))
            config.stash[STATE]["workdir"] = workdir
            config.stash[STATE]["log_dir_before"] = os.environ.get(LOG_DIR_VARIABLE)
            os.environ[LOG_DIR_VARIABLE] = str(workdir)  # the workers inherit it (pytest_load_initial_conftests)
            # Workers import this plugin before any hook of it runs, with a sys.path pytest-xdist
            # froze when it was imported: the package's root goes in through the environment.
            config.stash[STATE]["pythonpath_before"] = os.environ.get("PYTHONPATH")
            package_root = str(Path(__file__).resolve().parents[1])
            os.environ["PYTHONPATH"] = os.pathsep.join(
                dict.fromkeys([package_root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
            config.stash[STATE]["planner"] = _start_planner(config, opts, workdir / PLAN_FILE)
            if not config.option.numprocesses:
                config.option.numprocesses = 1
            if config.option.dist in ("no", "load"):
                config.option.dist = "loadscope"
            # At most one crash per test, unless --max-worker-restart: set when the plan is known (_await_plan).
    yield


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """The plan's path to each pytest-xdist worker (workers parse the command line again)."""
    state = node.config.stash.get(STATE, None)
    if state is not None and state.get("workdir"):
        node.workerinput["k3ref_plan"] = str(state["workdir"] / PLAN_FILE)
        node.workerinput["k3ref_sys_path"] = [p for p in sys.path if p]  # as the planning child had it
        # pytest-xdist starts each worker with the sys.path it froze when it was imported
        # (xdist.plugin._sys_path; PYTHONPATH does not survive that), and the worker imports
        # this plugin before any hook of it runs: this package's root goes into that list.
        try:
            import xdist.plugin

            root = str(Path(__file__).resolve().parents[1])
            if root not in xdist.plugin._sys_path:
                xdist.plugin._sys_path.insert(0, root)
        except (ImportError, AttributeError):
            pass


def pytest_configure(config):
    role = _role(config)
    if role == "worker":
        sys.path[:0] = [p for p in config.workerinput.get("k3ref_sys_path", ()) if p not in sys.path]
        _worker_stderr(config)
    if role is not None:
        config.addinivalue_line("markers", "k3ref: a k3ref harness test")


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """A worker ends here, without the interpreter's teardown: its results and the end of its
    session (pytest-xdist's `workerfinished`) are sent, and the controller waits for every
    worker's process to end before it finishes; a worker that has run kernels would first
    unload CUDA, Triton and torch."""
    if _role(config) == "worker":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


LOG_DIR_VARIABLE = "K3REF_WORKER_LOG_DIR"  # set by the controller for the workers it starts


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    """A worker's file descriptor 2 into its log before pytest's capture saves it, so that
    what a kernel writes while it dies (a CUDA or C++ assertion, faulthandler's report,
    pytest-timeout's stacks) lands where the controller reads it."""
    log_dir, worker = os.environ.get(LOG_DIR_VARIABLE), os.environ.get("PYTEST_XDIST_WORKER")
    if log_dir and worker and Path(log_dir).is_dir():
        import faulthandler

        log = open(Path(log_dir) / f"{worker}.stderr", "ab", buffering=0)
        log.write(f"\n=== k3ref worker {worker} pid {os.getpid()} ===\n".encode())
        os.dup2(log.fileno(), 2)
        faulthandler.enable(file=log)
        _WORKER_LOG["log"] = log
    yield


_WORKER_LOG = {}


def _worker_stderr(config):
    config.stash[STATE] = {"log": _WORKER_LOG.get("log") or sys.stderr}


# --------------------------------------------------------------------------- collection


class K3refFailure(Exception):
    pass


class K3refItem(pytest.Item):
    def __init__(self, *, entry, **kw):
        super().__init__(**kw)
        self.entry = entry
        self.add_marker(pytest.mark.k3ref)
        if entry.get("xfail"):
            self.add_marker(pytest.mark.xfail(reason=entry["xfail"], strict=True))

    def runtest(self):
        from k3ref.gpu_check.report import result_record

        executor = self.config.stash[STATE]["executor"]
        log = _WORKER_LOG.get("log")
        if log is not None:  # where this test's own output starts in the worker's log
            log.write(f"--- k3ref test {self.nodeid} ---\n".encode())
        capman = self.config.pluginmanager.getplugin("capturemanager")
        started = time.time()
        if capman is not None and _role(self.config) == "worker":
            # Capture off while the kernel runs: what it prints as it dies goes to the log.
            with capman.global_and_fixture_disabled():
                verdict, reason, results = executor.run(self.entry)
        else:
            verdict, reason, results = executor.run(self.entry)
        loaded = executor.loaded.get(self.entry["adapter"])
        recycle = any(r.status == "error" and any(w in r.reason for w in CUDA_WORDS) for r in results)
        # Carried to the controller on the report (pytest_runtest_makereport), not as a user
        # property: those would be written into the JUnit file.
        self._k3ref_record = {"verdict": verdict, "reason": reason, "loaded": loaded, "recycle": recycle,
                              "results": [result_record(r) for r in results],
                              # the run's timeline (report.timeline): which process, when
                              "span": [os.environ.get("PYTEST_XDIST_WORKER", "main"), started, time.time()]}
        self.user_properties.append(("k3ref_status", ",".join(r.status for r in results)))
        ratios = [r.ratio for r in results if isinstance(r.ratio, float)]
        if ratios:
            self.user_properties.append(("k3ref_ratio", max(ratios)))
        self.config.stash[STATE]["recycle"] = recycle
        if verdict == "skip":
            pytest.skip(reason)
        if verdict == "fail":
            lines = [reason]
            for r in results:
                if r.status in ("fail", "error") and len(results) == 1:
                    for key in ("worst_element", "final_state_worst_element"):
                        w = r.extra.get(key)
                        if w:
                            lines.append(f"{key}: index {w['index']}: candidate {w['candidate']!r}, "
                                         f"reference {w['reference']!r}")
                    if r.extra.get("traceback"):
                        lines.append(r.extra["traceback"].rstrip())
            raise K3refFailure("\n".join(lines))

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, K3refFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"k3ref {self.entry['id']}"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    role = _role(config)
    if role is None:
        return
    from k3ref.gpu_check import run as run_plan
    from k3ref.gpu_check import protocol

    state = config.stash[STATE]
    if role == "worker":
        plan = _worker_plan(config)
        if plan is None:  # no plan: the controller says why and ends the run
            return
        state["plan_speed"] = plan.get("speed")
        from k3ref.gpu_check.run import Executor

        state["executor"] = Executor(run_plan.options_of(config), _conftest_specs(config), scale=plan.get("scale"))
    elif role == "isolated":
        plan = _await_plan(config)  # --collect-only in the controller: the items of the plan, no adapter imported
    else:
        try:
            # The planning child's progress lines are marked for the controller to echo.
            mark = PROGRESS if role == "planner" else ""
            progress = lambda text: print("\n".join(mark + line for line in str(text).splitlines()), flush=True)  # noqa: E731
            plan, warm_up = run_plan.make(state["opts"], _conftest_specs(config), progress=progress)
        except protocol.UsageError as e:
            raise UsageError(f"k3ref: {e}") from None
        if role == "planner":
            out = Path(config.getoption("k3ref_plan_out"))
            if warm_up is not None:
                plan["speed"]["warmup_status"] = str(out.with_name("warmup_status.json"))
            run_plan.write(plan, out)
            progress(READY)  # the controller starts the workers; the warm-up runs beside them
            # What the verdict depends on (report.versions imports torch and asks the driver):
            # found here, beside the workers, so that the controller never imports torch.
            from k3ref.gpu_check.report import versions

            try:
                found = versions(state["opts"].goldens)
            except Exception as e:  # the warm-up still runs; the controller finds them itself
                found = None
                print(f"k3ref: the versions were not found here: {type(e).__name__}: {e}", file=sys.stderr)
            if found is not None:
                protocol.write_json(found, out.with_name(VERSIONS_FILE))
            if warm_up is not None:
                warm_up(plan["speed"]["warmup_status"])
        elif warm_up is not None:
            warm_up()
        config.stash[PLAN] = plan
        if role == "in_process":
            from k3ref.gpu_check.run import Executor

            state["executor"] = Executor(state["opts"], _conftest_specs(config), scale=plan.get("scale"))
    for e in plan["tests"]:
        items.append(K3refItem.from_parent(session, name=e["id"], nodeid=e["nodeid"], entry=e))


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtestloop(session):
    """The controller waits for the plan here, once pytest-xdist has started the workers
    (pytest_sessionstart) and before it hands them tests."""
    if _role(session.config) == "isolated":
        _await_plan(session.config)
    yield


def pytest_collection_finish(session):
    state = session.config.stash.get(STATE, None)
    if state is not None and _role(session.config) in ("in_process", "isolated"):
        state["collected"] = [i.nodeid for i in session.items if isinstance(i, K3refItem)]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    state = node.config.stash.get(STATE, None)
    if state is None:
        return
    state["marks"][f"collected {node.gateway.id}"] = time.time()
    if state.get("collected") is None:
        state["collected"] = [i for i in ids if i.startswith("k3ref/")]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    state = node.config.stash.get(STATE, None)
    if state is not None:
        state["marks"][f"down {node.gateway.id}"] = time.time()


# --------------------------------------------------------------------------- running


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Each k3ref test's time limit, before pytest-timeout reads it: the check's, plus the
    load's when this worker has not loaded the test's kernel yet."""
    if isinstance(item, K3refItem) and _role(item.config) == "worker":
        state = item.config.stash[STATE]
        opts = state["executor"].opts
        speed = state.get("plan_speed") or {}
        from k3ref.gpu_check.warmup import pending_key

        key = pending_key(item.entry["adapter"], item.entry["check"] == "backward")
        if (speed.get("warmup_pending") or {}).get(key) and speed.get("warmup_status") and \
                key not in state.setdefault("warmed", set()):
            # Before the time limit starts: its shapes are being compiled by the warm-up.
            from k3ref.gpu_check.run import wait_for_warmup

            waited, why = wait_for_warmup(speed["warmup_status"], key, opts.warmup_timeout)
            state["warmed"].add(key)
            print(f"k3ref: {key}: waited {waited:.1f} s for the warm-up ({why})", file=sys.stderr)
        limit = opts.check_timeout + (0.0 if state["executor"].is_loaded(item.entry["adapter"]) else opts.load_timeout)
        if item.entry.get("mutant") is not None:
            limit *= max(1, len(item.entry["mutant"]))
        item.add_marker(pytest.mark.timeout(limit, method="thread"))
    yield


@pytest.hookimpl(optionalhook=True)
def pytest_timeout_set_timer(item, settings):
    """pytest-timeout's limit, stopped by faulthandler: it prints every thread's stack into the
    worker's log (pytest's capture owns file descriptor 2 during a test, where pytest-timeout
    would write) and ends the worker."""
    if not (isinstance(item, K3refItem) and _role(item.config) == "worker"):
        return None
    import faulthandler

    faulthandler.dump_traceback_later(settings.timeout, exit=True, file=item.config.stash[STATE]["log"])
    return True


@pytest.hookimpl(optionalhook=True)
def pytest_timeout_cancel_timer(item):
    if not (isinstance(item, K3refItem) and _role(item.config) == "worker"):
        return None
    import faulthandler

    faulthandler.cancel_dump_traceback_later()
    return True


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After a check whose error names CUDA this worker ends (its CUDA context may be
    corrupt); pytest-xdist starts a fresh one for the tests left (the controller does not
    count this end as a crash: the test's own result was already sent)."""
    if isinstance(item, K3refItem) and _role(item.config) == "worker" and item.config.stash[STATE].pop("recycle", False):
        sys.stderr.flush()
        os._exit(0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    record = getattr(item, "_k3ref_record", None)
    if record is not None and call.when == "call":
        outcome.get_result().k3ref = json.dumps(record)


# --------------------------------------------------------------------------- the controller's record


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logreport(report):
    """Each k3ref test's reports, kept by the controller (tryfirst: a scale mutant's `caught`
    test gets its verdict here, before pytest, the JUnit writer or the terminal read it)."""
    if not report.nodeid.startswith("k3ref/"):
        return
    config = _CONFIG.get("config")
    state = config.stash.get(STATE, None) if config is not None else None
    if state is None or "reports" not in state:
        return
    entry = _entries(config, state).get(report.nodeid)
    scale_test = entry is not None and entry.get("tier") == "scale"
    if scale_test and entry["check"] == "caught" and report.when == "call" and report.passed:
        _judge_caught(state, entry, report)
    state["reports"].setdefault(report.nodeid, []).append(report)
    if scale_test and (report.when == "call" or report.failed) and state["opts"].report:
        _scale_checkpoint(config, state)


def _entries(config, state):
    """The plan's tests by node id (the controller has no items of its own under pytest-xdist)."""
    if "entries" not in state:
        plan = config.stash.get(PLAN, None)
        if plan is None:
            return {}
        state["entries"] = {e["nodeid"]: e for e in plan["tests"]}
    return state["entries"]


def _judge_caught(state, entry, report):
    """A scale mutant's `caught` test: it passes when one of the mutant's cases (those
    collected) caught it. Judged here, in the controller, from the records of those cases:
    they may have run in several workers (a crash or a CUDA error ends one), so no worker
    holds them all."""
    from k3ref.gpu_check.registry import tier
    from k3ref.gpu_check.report import _result_of, record_of

    collected = state.get("collected")
    results = []
    for nodeid in entry["cases"]:
        if collected is not None and nodeid not in collected:
            continue  # deselected
        for rep in state["reports"].get(nodeid, ()):
            record = record_of(rep)
            if record:
                results += [_result_of(d) for d in record["results"]]
    verdict, caught_by = tier("scale").mutant_verdict(results)
    record = record_of(report) or {"loaded": None, "recycle": False, "results": []}
    if verdict == "caught":
        record.update(verdict="pass", reason="caught by " + ", ".join(caught_by))
    else:
        ran = [r for r in results if r.status != "skip"]
        reason = (f"mutant {entry['adapter']} NOT CAUGHT by any of the {len(ran)} scale cases that ran"
                  if verdict == "missed" else f"mutant {entry['adapter']} could not run: " +
                  (results[0].reason if results else "none of its cases ran"))
        record.update(verdict="fail", reason=reason)
        report.outcome, report.longrepr = "failed", reason
    report.k3ref = json.dumps(record)


def _scale_checkpoint(config, state):
    """DIR/scale.json after each result of the scale tier (a run ended from outside keeps the
    rows of the cases it finished); the session's end writes the whole one."""
    from k3ref.gpu_check import report as R

    done = {nodeid for nodeid, reps in state["reports"].items() if any(r.when == "call" or r.failed for r in reps)}
    try:
        R.write_scale(state["opts"].report, R.scale_from_pytest(config.stash[PLAN], state["reports"], done,
                                                                 time.time() - state["t0"]))
    except Exception:  # the session's end writes it, and fails when it cannot
        pass


_CONFIG = {}


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    _CONFIG["config"] = session.config
    if _role(session.config) in ("isolated", "in_process"):
        session.config.stash[STATE]["marks"]["session start"] = time.time()


def _junit(config):
    # pytest keeps its JUnit writer under a private key; its public fixture
    # (record_testsuite_property) is only reachable from inside a test.
    try:
        from _pytest.junitxml import xml_key
    except ImportError:
        return None
    return config.stash.get(xml_key, None)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadscope with three repairs of pytest-xdist's (3.1 to 3.8): a test that crashed its
    worker is not run again (its scope goes back to the queue with it undone, and another
    worker would run it), a replacement worker that is still collecting is not given work
    (3.1 raised KeyError when two workers died close together), and a worker given only a
    finished scope (a dead worker's finished scopes go back to the queue too) asks for more work
    at once (it waited for results it would never have, and the run hung). And two for time: an
    idle worker is kept while another still runs a group, to take that group's rest if its
    worker dies, and once the tests are handed out a dead worker is replaced only for work left
    queued (the rest of its group that no live worker took)."""
    if _role(config) != "isolated" or config.option.dist != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def remove_node(self, node):
            # The test a dead worker was running would go back to the queue with its scope,
            # undone, and another worker would run it: it is marked done first (its result is
            # the crash) and named as the crashed test.
            work = self.assigned_work.get(node, {})
            crashitem = next((nodeid for unit in work.values() for nodeid, done in unit.items() if not done), None)
            if crashitem is None:
                return super().remove_node(node)
            for unit in work.values():
                if crashitem in unit:
                    unit[crashitem] = True
            super().remove_node(node)  # queues the rest of its work again
            return crashitem

        def _assign_work_unit(self, node):
            # remove_node queues every scope of the dead worker again, finished ones too: a
            # worker given only a finished scope has no test to run, so no result of it would
            # ever ask for more work, and the run would hang. It asks again at once.
            super()._assign_work_unit(node)
            if not self._pending_of(self.assigned_work[node]):
                self._reschedule(node)

        def _reschedule(self, node):
            if node not in self.registered_collections:
                return
            if not self.workqueue and not node.shutting_down and any(
                    self._pending_of(work) >= 2 for other, work in self.assigned_work.items() if other is not node):
                # Kept, idle, not shut down: a worker still running a group may die, and the
                # group's rest then goes to this one at once (remove_node) instead of waiting
                # for a replacement to start. pytest-xdist shuts every worker down when each
                # has at most one test left (tests_finished), and at the start when its first
                # distribution hands out every group (at most two per worker).
                return
            super()._reschedule(node)

    scheduler = GroupScheduling(config, log)
    dsession = config.pluginmanager.getplugin("dsession")
    clone = getattr(dsession, "_clone_node", None)
    if clone is not None:
        def clone_if_needed(node):
            # pytest-xdist replaces every worker that dies; a replacement takes seconds to start,
            # and the session waits for it before it ends. Once the tests are handed out, it is
            # started only for work still queued (the dead worker's rest that no live worker took).
            if scheduler.collection is not None and not scheduler.workqueue:
                return None
            return clone(node)

        dsession._clone_node = clone_if_needed
    return scheduler


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    """A worker died while running `crashitem`: the test fails with the end of the worker's
    stderr (a timeout says so); when the worker ended itself after a CUDA error the test's
    result is already recorded and this is no failure."""
    config = _CONFIG.get("config")
    state = config.stash.get(STATE, {}) if config is not None else {}
    earlier = state.get("reports", {}).get(crashitem, [])
    from k3ref.gpu_check.report import crash_excerpt, crash_reason, record_of

    if any((record_of(r) or {}).get("recycle") for r in earlier):
        report.outcome, report.when, report.longrepr = "passed", "teardown", None
        return

    entry = _entries(config, state).get(crashitem) if config is not None else None

    workdir = state.get("workdir")
    worker = getattr(getattr(report, "node", None), "gateway", None)
    log = Path(workdir) / f"{worker.id}.stderr" if workdir and worker is not None else None
    text = log.read_bytes()[-64 * 1024:].decode(errors="replace") if log and log.is_file() else ""
    header, _, text = text.rpartition("=== k3ref worker ")[2].partition("\n") if "=== k3ref worker " in text \
        else ("", "", text)
    pid = header.rpartition(" pid ")[2].split(" ")[0] if " pid " in header else None
    # What this test's run printed: the log after the marker the worker wrote when it began.
    mark = f"--- k3ref test {crashitem} ---\n"
    text = text.rpartition(mark)[2] if mark in text else text
    report.longrepr = crash_reason(text, state["opts"].check_timeout if state.get("opts") else None) + (
        "\nthe worker's stderr:\n" + crash_excerpt(text) if text.strip() else "")
    if entry is not None:  # a worker that died had loaded (or was loading) this kernel
        state.setdefault("crashes", {}).setdefault(entry["adapter"], set()).add(pid or f"unknown {crashitem}")
    if entry is not None and entry.get("xfail"):  # a known limitation that crashes is still that limitation
        report.outcome, report.wasxfail = "skipped", entry["xfail"]
    if entry is not None and entry.get("of_mutant"):
        # A scale mutant's case that ended its worker caught it (a timeout is no catch): the
        # case's error result; the test itself passes, as a mutant's case tests do.
        from k3ref.gpu_check.protocol import CheckResult
        from k3ref.gpu_check.report import result_record

        reason = str(report.longrepr).splitlines()[0][:600]
        timed_out = reason.startswith("timed out")
        res = CheckResult(entry["adapter"], entry["check"], entry["case"], "error", reason,
                          extra={"crash": True, "timed_out": timed_out, "stderr_tail": str(report.longrepr)[-3000:]})
        report.k3ref = json.dumps({"verdict": "pass", "reason": ("not caught by this case (a timeout is no catch): "
                                   if timed_out else "caught by this case: ") + reason, "loaded": None,
                                   "recycle": False, "results": [result_record(res)]})
        report.outcome, report.when, report.longrepr = "passed", "call", None


@pytest.hookimpl(tryfirst=True)  # before the JUnit writer's: the versions go into its file
def pytest_sessionfinish(session, exitstatus):
    config = session.config
    role = _role(config)
    if role not in ("isolated", "in_process"):
        return
    state = config.stash[STATE]
    state["marks"]["session finish"] = time.time()
    plan = config.stash.get(PLAN, None)
    _collect_warmup(state, plan, stop=bool(plan is None or session.shouldstop or session.shouldfail
                                           or config.getoption("collectonly")))
    try:
        if plan is not None and not config.getoption("collectonly"):
            _record_session(session, config, state, plan)
    finally:
        _clean_workdir(state)


def _record_session(session, config, state, plan):
    """The run's report, the scale tier's record and the verdict, from the controller's reports."""
    state["versions"] = _versions(state)
    xml = _junit(config)
    if xml is not None:  # what the verdict depends on, for a CI that keeps only the XML
        for key, value in state["versions"].items():
            xml.add_global_property(f"k3ref.{key}", str(value))
    from k3ref.gpu_check import report as R

    seconds = time.time() - state["t0"]
    run = R.from_pytest(plan, state["reports"], state.get("collected"), seconds, versions_=state.get("versions"),
                        crashes=state.get("crashes"))
    run["summary"]["timeline"] = R.timeline(state["reports"], state["t0"], state["marks"])
    state["run"] = run
    failed = not run["passed"]
    if plan.get("tier") == "scale":
        # The scale tier's record is scale.json (scale.state), from the same reports.
        wanted = set(state["collected"]) if state.get("collected") is not None else {e["nodeid"] for e in plan["tests"]}
        run["scale"] = R.scale_from_pytest(plan, state["reports"], wanted, seconds)
        failed = failed or run["scale"]["summary"]["verdict"] != "PASS"
        if state["opts"].report:
            try:
                R.write_scale(state["opts"].report, run["scale"])
            except Exception as e:  # no record, no verdict
                run["failures"].append(f"FAIL: scale.json could not be written into {state['opts'].report}: "
                                       f"{type(e).__name__}: {e}".splitlines()[0])
                failed = True
        run["passed"] = not failed
    elif state["opts"].report:
        try:
            R.write_all(Path(state["opts"].report), run["rows"], run["results"], run["summary"])
        except Exception as e:  # no report, no verdict
            run["failures"].append(f"FAIL: the report could not be written into {state['opts'].report}: "
                                   f"{type(e).__name__}: {e}".splitlines()[0])
            failed = True
    if failed and session.exitstatus == 0:
        session.exitstatus = 1


def _clean_workdir(state):
    """The run's directory (plan, worker logs) goes, and the environment the workers inherited
    is as it was."""
    workdir = state.get("workdir")
    if workdir:
        import shutil

        for variable, before in ((LOG_DIR_VARIABLE, state.get("log_dir_before")),
                                 ("PYTHONPATH", state.get("pythonpath_before"))):
            if before is None:
                os.environ.pop(variable, None)
            else:
                os.environ[variable] = before

        shutil.rmtree(workdir, ignore_errors=True) if not os.environ.get("K3REF_DEBUG_KEEP") else None


VERSIONS_FILE = "versions.json"  # the planning child's, beside the plan


def _versions(state):
    """report.versions of the run: the planning child's file, else found here (a run without
    a planning child, or one whose child did not get that far)."""
    from k3ref.gpu_check.report import versions

    path = state["workdir"] / VERSIONS_FILE if state.get("workdir") else None
    if path is not None:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass
    return versions(state["opts"].goldens)


def _collect_warmup(state, plan, stop):
    """The planning child's end: the warm-up it ran beside the checks, its record into the
    plan's speed section (the report's). A session stopped early (-x, ^C) stops it."""
    child = state.pop("planner", None)
    if child is None:
        return
    child.close(kill=stop, timeout=state["opts"].warmup_timeout)
    speed = (plan or {}).get("speed") or {}
    if not speed.get("warmup_status"):
        return
    try:
        status = json.loads(Path(speed["warmup_status"]).read_text())
    except (OSError, ValueError):
        status = {}
    record = status.get("record")
    if record is None:  # the warm-up did not end: the checks compiled what they needed, no verdict changes
        reason = ("the run stopped before the warm-up ended" if stop else
                  f"the warm-up did not end (planning child: exit {child.proc.returncode}): "
                  f"{_stderr_line(child.last_stderr)}")
        record = {"jobs": 0, "wall_s": 0.0, "errors": 1, "error": reason,
                  "groups": [{"adapter": "-", "group": {}, "status": "error", "reason": reason}],
                  "totals": {"compile_s": 0.0, "autotune_s": 0.0, "compiles": 0, "configs_benchmarked": 0}}
    speed["warmup"] = record


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    state = config.stash.get(STATE, None) if _role(config) in ("isolated", "in_process") else None
    run = state.get("run") if state else None
    if not run:
        return
    from k3ref.gpu_check import report as R

    tr = terminalreporter
    if "scale" in run:
        _scale_summary(tr, state, run)
        return
    tr.section("k3ref")
    tr.write_line(R.markdown_table(run["results"]))
    for t, v, reason, _ in run["rows"]:
        if t.mutant:
            tr.write_line(f"{t.adapter.name}: {v}: {reason}")
    for line in R.timing_lines(run["summary"]):
        tr.write_line(line)
    for line in run["failures"]:
        tr.write_line(line, red=True)
    s = run["summary"]
    tr.write_line(json.dumps({k: s[k] for k in ("verdict", "tests", "executed", "passed", "failed", "skipped",
                                                "xfailed", "seconds")}))
    if state["opts"].report:
        out = Path(state["opts"].report)
        tr.write_line(f"reports: {out / 'report.html'}, {out / 'report.json'}"
                      + (f", {config.option.xmlpath}" if getattr(config.option, "xmlpath", None) else ""))


def _scale_summary(tr, state, run):
    """The scale tier's table (kernel x case: figure, bound, ratio, verdict, seconds), each
    mutant's verdict, the failures and the verdict line."""
    from k3ref.gpu_check.registry import tier

    result = run["scale"]
    s = result["summary"]
    tr.section("k3ref scale tier")
    tr.write_line(tier("scale").table(result["results"]))
    for n, v in s["mutants"].items():
        tr.write_line(f"mutant {n}: {v}" + (f" by {', '.join(s['mutant_catches'][n])}" if v == "caught" else ""))
    lines = ["FAIL " + line for line in s["failures"]]
    if s["verdict"] == "PASS":  # then what failed is pytest's record of the tests (a missing result, a report)
        lines += run["failures"]
    for line in lines:
        tr.write_line(line, red=True)
    path = Path(state["opts"].report) / "scale.json" if state["opts"].report else None
    tr.write_line(f"scale tier: {'PASS' if run['passed'] else 'FAIL'} in {result['wall_s']:.1f} s"
                  + (f"; {path}" if path else "")
                  + (f", {tr.config.option.xmlpath}" if getattr(tr.config.option, "xmlpath", None) else ""))
