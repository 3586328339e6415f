"""A harness run, for the pytest plugin (its only runner) and the `warmup` command: what it
selects, its plan (decided once) and the execution of one planned test.

Selecting: the adapters after --only / --no-mutants / --no-builtin, the golden directory and
suite, and the usage error that names a bad selection in one line (select_adapters).

Planning: the run's options (frozen), the adapters they select, the tests collected from
them, the shape plan and the warm-up (make). The plugin's controller process never imports
adapter code: it asks a *planning child* (`pytest --collect-only` with `--k3ref-plan-out
FILE`, the same arguments and conftest files) for the plan, a JSON file this module writes
and reads; the pytest-xdist workers build their test items from that file and import the
adapters they run. Without isolation (`--k3ref-no-isolation`) the plan is made in the test
process itself.

Executing (Executor): one planned test in the process that holds its kernel (a pytest-xdist
worker). The adapters are selected there as the plan selected them (select_adapters, the
first time a test needs them), each kernel is loaded once per process, and every call into
adapter code is guarded: an exception, a SystemExit or any other BaseException but
KeyboardInterrupt becomes that check's error with its traceback. A crash, a hang or an exit
of the process is the plugin's (pytest-xdist replaces the worker, pytest-timeout bounds the
time).
"""
import json
import os
import threading
import time
import traceback
from dataclasses import asdict
from pathlib import Path

from . import collection
from .collection import mutant_outcome, outcome
from .protocol import KERNEL_PATHS, CheckResult, MutantTest, RunOptions, Test, UsageError, kernel_paths_of, settings_of, write_json
from .registry import AdapterSpecError, discover, tier


# --------------------------------------------------------------------------- selecting

def default_goldens(option="--goldens"):
    """The golden directory when none is given: $K3REF_GOLDENS, else the checkout's goldens/,
    else the suite installed with the package (k3ref.goldens.directory). `option`: how the
    front end in use spells the option that names one (pytest: --k3ref-goldens)."""
    from .. import goldens

    try:
        return str(goldens.directory())
    except FileNotFoundError as e:
        raise UsageError(f"{e} (or pass {option} DIR)") from None


def csv_list(text):
    return tuple(s for s in text.split(",") if s) if text else None


def load_suite(directory, ops):
    """The golden cases of `directory` whose operator is in `ops`, read by k3ref.goldens: the
    cases its MANIFEST.json lists, or every *.safetensors file of a directory without one."""
    from .. import goldens

    directory = Path(directory)
    if (directory / "MANIFEST.json").is_file():
        return goldens.load_suite(directory, ops=tuple(ops))
    cases = [goldens.load_case(p) for p in sorted(directory.glob("*.safetensors"))]
    return [c for c in cases if c.op in ops]


def suite_of(goldens, adapters):
    """The cases of directory `goldens` that the adapters' checks read."""
    ops = sorted({op for a in adapters for op in a.suite_ops()})
    if not Path(goldens).is_dir():
        raise UsageError(f"--goldens {goldens}: not a directory")
    return load_suite(goldens, ops) if ops else []


def device_of(device):
    """The device a run or command names, else cuda when there is one (the front end imports
    no torch: its processes pick)."""
    if device:
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def select_adapters(opts, conftest_objects=(), goldens_option="--k3ref-goldens"):
    """(adapters, requested names, golden suite) of a run; raises UsageError (one
    line) for a selector that names nothing or an adapter spec that does not load. The
    metamorphic configurations are chosen on the suite's shapes (shapes.choose_all), the
    same in every process that calls this."""
    from . import shapes

    try:
        adapters, requested = discover(specs=opts.adapters, conftest_specs=conftest_objects,
                                       entry_points=opts.builtin, options=opts)
    except AdapterSpecError as e:
        raise UsageError(str(e)) from e
    try:
        if opts.only:
            collection.validate(adapters, [], only=opts.only)
            adapters = [a for a in adapters if a.name in opts.only]
            requested |= set(opts.only)
        if opts.no_mutants:
            adapters = [a for a in adapters if a.kind != "mutant" or a.name in requested]
        suite = suite_of(opts.goldens or default_goldens(goldens_option), adapters)
        collection.validate(adapters, suite, checks=opts.checks, cases=opts.cases)
    except collection.SelectorError as e:
        raise UsageError(str(e)) from e
    if opts.policy:  # --policy: the user's choice of bound for every KDA kernel, validated below
        for a in adapters:
            if a.family == "kda":
                a.policy, a.policy_reason = opts.policy, "given on the command line (--policy / --k3ref-policy)"
        try:
            collection.validate(adapters, suite)
        except collection.SelectorError as e:
            raise UsageError(str(e)) from e
    shapes.choose_all(adapters, suite)
    return adapters, requested, suite


# --------------------------------------------------------------------------- planning

PLAN_VERSION = 1

def options_of(config):
    """The RunOptions of a pytest config (the plugin's options; a kernel path or the cache
    directory not given there comes from its environment variable, read here once)."""
    from . import warmup

    g = config.getoption
    return RunOptions(
        adapters=tuple(g("k3ref_adapter")), builtin=bool(g("k3ref_builtin")),
        only=csv_list(g("k3ref_only")), no_mutants=bool(g("k3ref_no_mutants")), checks=csv_list(g("k3ref_checks")),
        cases=csv_list(g("k3ref_cases")), goldens=g("k3ref_goldens"), device=g("k3ref_device"),
        known_limitations=g("k3ref_known_limitations"), policy=g("k3ref_policy"), check_timeout=float(g("k3ref_check_timeout")),
        load_timeout=float(g("k3ref_load_timeout")), budget=float(g("k3ref_budget")),
        isolate=not g("k3ref_no_isolation"), report=g("k3ref_report"), warmup=not g("k3ref_no_warmup"),
        warmup_jobs=g("k3ref_warmup_jobs"), warmup_timeout=float(g("k3ref_warmup_timeout")),
        warmup_shards=g("k3ref_warmup_shards"), autotune_configs=g("k3ref_autotune_configs"),
        cache_dir=str(warmup.cache_dir(g("k3ref_cache_dir"))),
        kernel_paths=kernel_paths_of({name: g("k3ref_" + name) for name, _, _ in KERNEL_PATHS}),
        tier=g("k3ref_tier"), backward=g("k3ref_backward"),
        scale_limits=g("k3ref_scale_limits") or os.environ.get("K3REF_SCALE_LIMITS"),
        settings=settings_of(g("k3ref_set")))


def apply_environment(opts):
    """What the run's third-party libraries read from the environment, set before any kernel is
    imported (pytest-xdist's and the warm-up's workers inherit it): Triton's cache directory
    under the run's. libk3gc's path is the run's (lib.use), where one is given."""
    from . import warmup

    warmup.configure_cache(opts.cache_dir)


def group_of(adapter):
    """The adapter's isolation group: the tests of one group run on one worker, in order."""
    fn = getattr(adapter, "isolation_group", None)
    return fn() if callable(fn) else (fn or adapter.name)


def scope_name(group):
    """pytest-xdist's --dist loadscope keeps one scope on one worker: the part of a node id
    before its last '::'. Brackets would start pytest's parameter part, so they are spelled
    as '(' and ')' here."""
    return "".join(ch if ch.isalnum() or ch in "-_.()" else {"[": "(", "]": ")"}.get(ch, "_") for ch in group)


def _entry(t):
    return {"adapter": t.adapter.name, "check": t.check, "case": t.case, "case_path": getattr(t, "case_path", None),
            "skip": getattr(t, "skip", None)}


def make(opts, conftest_objects=(), progress=print):
    """(plan, warm_up) of a run. The plan is a JSON-able dict: every test in the order it should
    run, each with its node id, isolation group and known-limitation reason; the adapters'
    static facts; the shape plan. warm_up(status=None) compiles the planned shapes (None when
    nothing is left to compile: warm-up off, no run-time-compiled shape, or every unit warm in
    the cache directory); the plan names the adapters it compiles for and how many units each
    (speed.warmup_pending), and their tests come last, so the checks of the other kernels can
    run while it compiles (docs/gpu_check.md)."""
    from .. import goldens
    from . import shapes, warmup

    if opts.tier == "scale":
        return make_scale(opts, conftest_objects), None
    t0 = time.perf_counter()
    phases = {}  # the planning's seconds, by step (the report's timeline)

    def lap(name):
        phases[name] = time.perf_counter() - t0 - sum(phases.values())

    adapters, requested, suite = select_adapters(opts, conftest_objects)
    lap("select_s")
    try:
        limitations = collection.load_limitations(opts.known_limitations)
        tests = collection.collect(adapters, suite, checks=opts.checks, cases=opts.cases, limitations=limitations,
                                   backward=opts.backward)
    except ValueError as e:
        raise UsageError(str(e)) from e
    device = device_of(opts.device)
    lap("collect_s")
    shape_plan = shapes.build(tests, suite, goldens.load_case)
    tests = shapes.order(tests, shape_plan)
    lap("shape_plan_s")
    speed = {"planning_phases": phases, "cache_dir": opts.cache_dir, "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR"),
             "shape_plan": shape_plan.summary(), "autotune_configs": opts.autotune_configs}
    progress(shapes.plan_line(speed["shape_plan"]))
    warm_up = None
    pending = {}
    if opts.warmup and shape_plan.shapes:
        selected = warmup.select(shapes.units(shape_plan, adapters), device,
                                 warmup.warm_keys(opts.cache_dir))
        for unit in selected[0]:
            key = warmup.pending_key(unit[0].name, warmup.is_backward(unit[1]))
            pending[key] = pending.get(key, 0) + 1
        speed["warmup_pending"] = pending
        warm_up = _warm_up_of(selected, opts, device, speed, progress)
        if not pending:  # nothing to compile: the record of the warm units, at once
            warm_up()
            warm_up = None
        lap("warm_keys_s")
    # Stable, the shape order kept within each part: a known limitation last in its group (when
    # it crashes its worker, the replacement has no other test of the group left to run; one
    # marked ends_process, FlashKDA's aborts, gets a scope of its own below), and the tests of
    # kernels whose shapes are still compiling after the others.
    tests.sort(key=lambda t: (bool(t.xfail), warmup.pending_key(t.adapter.name, t.check == "backward") in pending))
    groups = {a.name: group_of(a) for a in adapters}
    entries = []
    for t in tests:
        # A known limitation that ends its process runs in a scope of its own, on whichever
        # worker is free: its replacement worker holds up none of its group's other tests.
        group = groups[t.adapter.name] + (f" ends its process: {t.check} {t.case}" if getattr(t, "ends_process", False)
                                           else "")
        e = {"id": t.id, "group": group, "xfail": t.xfail, **_entry(t)}
        if isinstance(t, MutantTest):
            e["mutant"] = [_entry(x) for x in t.tests]
        e["nodeid"] = f"k3ref/{scope_name(e['group'])}::{t.id}"
        entries.append(e)
    plan = {
        "version": PLAN_VERSION, "device": device, "requested": sorted(requested), "n_goldens": len(suite),
        "golden_dir": str(opts.goldens or default_goldens("--k3ref-goldens")),
        "adapters": {a.name: _facts(a, requested, groups[a.name]) for a in adapters},
        "tests": entries, "speed": speed, "run_options": asdict(opts),
    }
    return plan, warm_up


def _facts(a, requested, group):
    return {"family": a.family, "kind": a.kind, "policy": a.policy, "policy_reason": a.policy_reason,
            "contract": a.contract, "asked_for": a.name in requested, "group": group}


def make_scale(opts, conftest_objects=()):
    """The plan of the scale tier (--k3ref-tier scale, scale.py): one test per kernel x case,
    `KERNEL-CASE-scale`, after the reference's `REFERENCE-reference_vs_goldens-scale`; a scale
    mutant's case tests record whether that case caught it and never fail, and its test
    `MUTANT-scale-caught`, last in its group, fails when none did (the controller judges it
    from their results: pytest_plugin). No warm-up: each kernel compiles its shapes in its
    first case. The limits (--k3ref-scale-limits) go into the plan, for the workers."""
    scale = tier("scale")
    if opts.checks:
        raise UsageError("--checks: the scale tier has no checks to pick; --cases picks its cases "
                                   f"({', '.join(scale.CASES)})")
    kernels, requested = scale.select_kernels(opts, conftest_objects)
    cases = scale.cases_of(opts.cases)
    limits = scale.limits_of(opts)
    device = device_of(opts.device)
    ref = scale.reference_adapter(device, opts)
    entries, facts = [], {}

    def add(a, check, case, **extra):
        group = group_of(a)
        facts[a.name] = _facts(a, requested, group)
        e = {"id": f"{a.name}-{case}-{check}", "group": group, "xfail": None, "adapter": a.name, "check": check,
             "case": case, "case_path": None, "skip": None, "tier": "scale", **extra}
        e["nodeid"] = f"k3ref/{scope_name(group)}::{e['id']}"
        entries.append(e)
        return e

    if "reference_vs_goldens" in cases:
        add(ref, "scale", "reference_vs_goldens")
    for a in kernels:
        mutant = a.kind == "mutant"
        mine = [add(a, "scale", c, of_mutant=mutant) for c in cases if c in scale.CASE_FUNCTIONS]
        if mutant and mine:
            add(a, "caught", "scale", cases=[e["nodeid"] for e in mine])
    gpu = None
    if str(device).startswith("cuda"):
        import torch

        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    golden_dir = (str(opts.goldens or default_goldens("--k3ref-goldens"))
                  if "reference_vs_goldens" in cases else opts.goldens)
    return {"version": PLAN_VERSION, "tier": "scale", "device": device, "requested": sorted(requested),
            "n_goldens": None, "golden_dir": golden_dir, "adapters": facts, "tests": entries, "speed": {},
            "scale": {"limits": asdict(limits), "cases": list(cases), "gpu": gpu}, "run_options": asdict(opts)}


def _warm_up_of(selected, opts, device, speed, progress):
    from . import warmup

    def warm_up(status=None):
        """Runs the warm-up; its record goes into speed['warmup'] (and DIR/warmup.json). With
        `status` (a path), the units still pending per adapter are kept there, replaced
        atomically after each unit, for the workers that wait on them (wait_for_warmup)."""
        pending = dict(speed.get("warmup_pending") or {})
        lock = threading.Lock()

        def write_status(done=False, record=None):
            if status is not None:
                write_json({"pid": os.getpid(), "pending": pending, "done": done, "record": record}, status,
                           default=str)

        def on_unit_done(name):
            with lock:
                pending[name] = pending.get(name, 1) - 1
                write_status()

        write_status()
        try:
            record = warmup.run_selected(selected, device, jobs=opts.warmup_jobs, timeout=opts.warmup_timeout,
                                         progress=progress, on_unit_done=on_unit_done, shards=opts.warmup_shards)
        except Exception as e:  # the scheduler itself broke: the checks compile what they need
            reason = f"the warm-up stopped: {type(e).__name__}: {e}"[:300]
            record = {"jobs": 0, "wall_s": 0.0, "errors": 1, "error": reason,
                      "groups": [{"adapter": "-", "group": {}, "status": "error", "reason": reason}],
                      "totals": {"compile_s": 0.0, "autotune_s": 0.0, "compiles": 0, "configs_benchmarked": 0}}
        speed["warmup"] = record
        if any(g.get("status") not in ("skipped", "warm") for g in record["groups"]):
            warmup.write_record(record, opts.cache_dir or ".")
        progress(warmup.table(record))
        with lock:
            write_status(done=True, record=record)
        return record

    return warm_up


def wait_for_warmup(status, key, limit, poll=0.2):
    """Returns (seconds waited, why it stopped waiting) once the warm-up (status file of
    warm_up) has no unit of `key` left (warmup.pending_key: an adapter's forward or backward
    units), has ended, or its process is gone; or after `limit` seconds. Never an error: a check whose shapes are not compiled compiles them itself."""
    t0 = time.monotonic()
    while True:
        try:
            s = json.loads(Path(status).read_text())
        except (OSError, ValueError):
            s = None
        if s is not None:
            if s.get("done"):
                return time.monotonic() - t0, "the warm-up ended"
            if (s.get("pending") or {}).get(key, 0) <= 0:
                return time.monotonic() - t0, "its units are compiled"
            try:
                os.kill(int(s["pid"]), 0)
            except (ProcessLookupError, KeyError, TypeError, ValueError):
                return time.monotonic() - t0, "the warm-up's process is gone"
            except PermissionError:
                pass
        if time.monotonic() - t0 >= limit:
            return time.monotonic() - t0, f"waited {limit:g} s (--k3ref-warmup-timeout)"
        time.sleep(poll)


def write(plan, path):
    """Atomically: a reader sees the whole plan or none."""
    write_json(plan, path)


def read(path):
    from .._bounded import load_json

    plan = load_json(Path(path), "run plan", limit=256 * 1024 * 1024)
    if not isinstance(plan, dict) or plan.get("version") != PLAN_VERSION:
        raise ValueError(f"run plan {path}: not a plan of this k3ref version")
    return plan


# --------------------------------------------------------------------------- executing

def _error(adapter, check, case, what, e):
    return CheckResult(adapter, check, case, "error", f"{what}{type(e).__name__}: {e}".splitlines()[0][:300],
                       extra={"traceback": traceback.format_exc()[-2000:]})


class Executor:
    """One per process: the adapters of the run, what loading each gave, and the time split."""

    def __init__(self, opts, conftest_objects=(), scale=None):
        self.opts = opts
        self.scale = scale   # the plan's scale section (limits, ...) of a --k3ref-tier scale run
        self.conftest_objects = conftest_objects
        self.device = device_of(opts.device)
        if opts.kernel_path("lib"):
            from . import lib

            lib.use(opts.kernel_path("lib"))
        self._adapters = None
        self.requested = set()
        self.loaded = {}     # adapter name -> {available, reason, version, import_s, timing}
        self.started = {}    # adapter name -> monotonic time of its first check (the budget)

    def adapter(self, name):
        if self._adapters is None:
            if self.scale is not None:  # as the scale tier's plan selected them
                adapters, self.requested = tier("scale").select_kernels(self.opts, self.conftest_objects)
            else:
                adapters, self.requested, _ = select_adapters(self.opts, self.conftest_objects)
            self._adapters = {a.name: a for a in adapters}
        if name not in self._adapters:
            raise LookupError(f"adapter {name} is in the plan but not selected in this process")
        return self._adapters[name]

    def is_loaded(self, name):
        return name in self.loaded

    def load(self, a):
        """What loading adapter `a` gave (cached): available, reason, version, import seconds."""
        if a.name in self.loaded:
            return self.loaded[a.name]
        from . import timing

        t0 = time.perf_counter()
        status = timing.install()
        why = a.probe(self.device) if hasattr(a, "probe") else None
        if why:
            info = {"available": False, "reason": why + " (probed without loading)"}
        else:
            try:
                ok = bool(a.available())
                info = {"available": ok, "reason": a.unavailable_reason}
            except (KeyboardInterrupt, GeneratorExit):
                raise
            except BaseException as e:  # an exit in the kernel's import is its failure to load
                info = {"available": False, "reason": f"loading raised {type(e).__name__}: {e}".splitlines()[0][:500]}
            if info["available"]:
                try:
                    info["version"] = a.version()
                except Exception as e:
                    info["version"] = f"version() raised {type(e).__name__}"
        info["import_s"] = time.perf_counter() - t0
        info["pid"] = os.getpid()  # the controller counts the processes that loaded a kernel by it
        info["timing"] = dict(status)
        self.loaded[a.name] = info
        return info

    def _not_run(self, a, check, case_id):
        """A skip when the kernel's time budget is spent or it is not available (loading it
        first), else None."""
        first = self.started.setdefault(a.name, time.monotonic())
        if self.opts.budget and time.monotonic() - first > self.opts.budget:
            return CheckResult(a.name, check, case_id, "skip",
                               f"time budget of {self.opts.budget:g} s for this kernel exhausted")
        info = self.load(a)
        if not info["available"]:
            return CheckResult(a.name, check, case_id, "skip", "not available: " + (info.get("reason") or "unknown"),
                               extra={"unavailable": True})
        return None

    def run_one(self, a, entry):
        """The CheckResult of one (check, case) of adapter `a`, with its time split."""
        from .. import goldens
        from . import timing

        check, case_id = entry["check"], entry["case"]
        if entry.get("skip"):
            return CheckResult(a.name, check, case_id, "skip", entry["skip"])
        not_run = self._not_run(a, check, case_id)
        if not_run is not None:
            return not_run
        before = timing.COUNTERS.snapshot()
        t0 = time.perf_counter()
        try:
            case = goldens.load_case(entry["case_path"]) if entry.get("case_path") else None
            res = a.run_check(check, case, self.device)
            if not isinstance(res, CheckResult):
                raise TypeError(f"run_check returned {type(res).__name__}, not a CheckResult")
        except (KeyboardInterrupt, GeneratorExit):
            raise
        except BaseException as e:  # SystemExit included: any way out but returning is this check's error
            res = _error(a.name, check, case_id, "", e)
        after = timing.COUNTERS.snapshot()
        cost = {k: after[k] - before[k] for k in after}
        cost["wall_s"] = time.perf_counter() - t0
        res.seconds = res.seconds or cost["wall_s"]
        res.extra["timing"] = cost
        return res

    def run(self, entry):
        """(verdict, reason, results) of one planned test: verdict pass | fail | skip (a known
        limitation's xfail is pytest's strict marker, applied by the plugin)."""
        if entry.get("tier") == "scale" and entry["case"] == "reference_vs_goldens":
            return self.run_reference(entry)
        try:
            a = self.adapter(entry["adapter"])
        except (KeyboardInterrupt, GeneratorExit):
            raise
        except BaseException as e:
            res = _error(entry["adapter"], entry["check"], entry["case"], "selecting the adapters: ", e)
            return "fail", res.reason, [res]
        test = Test(a, entry["check"], entry["case"])
        if entry.get("tier") == "scale":
            return self.run_scale(a, test, entry)
        if entry.get("mutant") is not None:
            results = [self.run_one(a, x) for x in entry["mutant"]]
            verdict, reason = mutant_outcome(_Mutant(a, test), results, self.requested)
            return verdict, reason, results
        res = self.run_one(a, entry)
        verdict, reason = outcome(test, res, self.requested)
        return verdict, reason, [res]


    def run_reference(self, entry):
        """The scale tier's reference_vs_goldens test: the reference the tier computes with, on
        the goldens (not a selected adapter: scale.reference_adapter of the device)."""
        try:
            res = tier("scale").reference_vs_goldens(self.device, self.opts.goldens, options=self.opts)[0]
        except (KeyboardInterrupt, GeneratorExit):
            raise
        except BaseException as e:
            res = _error(entry["adapter"], entry["check"], entry["case"], "", e)
        return ("pass" if res.status == "pass" else "fail"), res.reason, [res]

    def run_scale(self, a, test, entry):
        """One case of the scale tier (scale.run_case at the plan's limits). A scale mutant's
        case test passes whatever the case found (its result says whether the case caught
        it); its `caught` test runs nothing here: the controller judges it from the results of
        the mutant's cases, which may come from several workers (pytest_plugin)."""
        scale = tier("scale")
        if entry["check"] == "caught":
            return "pass", "judged from the results of its cases", []
        res = self._not_run(a, entry["check"], entry["case"])
        if res is None:
            t0 = time.perf_counter()
            try:
                res = scale.run_case(a, entry["case"], scale.Limits(**self.scale["limits"]), self.device)
            except (KeyboardInterrupt, GeneratorExit):
                raise
            except BaseException as e:  # run_case guards the case; this is what is outside it
                res = _error(a.name, entry["check"], entry["case"], "", e)
            res.seconds = res.seconds or time.perf_counter() - t0
        if entry.get("of_mutant"):
            if res.status == "skip":
                return "skip", res.reason, [res]
            return "pass", ("caught by this case: " if res.status in ("fail", "error") else
                            "not caught by this case: ") + res.reason, [res]
        verdict, reason = outcome(test, res, self.requested)
        return verdict, reason, [res]


class _Mutant:
    """What collection.mutant_outcome reads of a mutant test (its known limitation is pytest's)."""

    def __init__(self, adapter, test):
        self.adapter = adapter
        self.xfail = None
