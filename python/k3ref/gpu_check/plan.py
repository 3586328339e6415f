"""What a run will do, decided once: the run's options (frozen), the adapters they select, the
tests collected from them, the shape plan and the warm-up.

The pytest plugin is the only runner. Its controller process never imports adapter code: it
asks a *planning child* (`pytest --collect-only` with `--k3ref-plan-out FILE`, the same
arguments and conftest files) for the plan, a JSON file this module writes and reads; the
pytest-xdist workers build their test items from that file and import the adapters they
run. Without isolation (`--k3ref-no-isolation`) the plan is made in the test process itself.
"""
import json
import os
import threading
import time
from dataclasses import asdict
from pathlib import Path

from .protocol import KERNEL_PATHS, MutantTest, RunOptions, UsageError, write_json
from .selection import device_of, select_adapters

PLAN_VERSION = 1

def _csv(text):
    return tuple(s for s in text.split(",") if s) if text else None


def options_of(config):
    """The RunOptions of a pytest config (the plugin's options)."""
    g = config.getoption
    paths = tuple((env, str(Path(g("k3ref_" + dest)).resolve())) for dest, env, _ in KERNEL_PATHS
                  if g("k3ref_" + dest))
    return RunOptions(
        adapters=tuple(g("k3ref_adapter")), builtin=bool(g("k3ref_builtin")),
        only=_csv(g("k3ref_only")), no_mutants=bool(g("k3ref_no_mutants")), checks=_csv(g("k3ref_checks")),
        cases=_csv(g("k3ref_cases")), goldens=g("k3ref_goldens"), device=g("k3ref_device"),
        known_limitations=g("k3ref_known_limitations"), policy=g("k3ref_policy"), check_timeout=float(g("k3ref_check_timeout")),
        load_timeout=float(g("k3ref_load_timeout")), budget=float(g("k3ref_budget")),
        isolate=not g("k3ref_no_isolation"), report=g("k3ref_report"), warmup=not g("k3ref_no_warmup"),
        warmup_jobs=g("k3ref_warmup_jobs"), warmup_timeout=float(g("k3ref_warmup_timeout")),
        warmup_shards=g("k3ref_warmup_shards"),
        autotune_configs=g("k3ref_autotune_configs"), cache_dir=g("k3ref_cache_dir"), kernel_paths=paths,
        tier=g("k3ref_tier"), backward=g("k3ref_backward"))


def apply_environment(opts):
    """The kernels' checkout paths and the cache directory as the environment variables the
    adapters and the warm-up's workers read (before any kernel is imported; pytest-xdist's
    workers inherit them)."""
    for env, path in opts.kernel_paths:
        os.environ[env] = path
    from . import autotune, warmup

    warmup.configure_cache(opts.cache_dir)
    os.environ[autotune.MODE_VARIABLE] = opts.autotune_configs or "winner"


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
    from . import collection, selection, shapes, warmup

    if opts.tier == "scale":
        return make_scale(opts, conftest_objects), None
    adapters, requested, suite = select_adapters(opts, conftest_objects)
    try:
        limitations = collection.load_limitations(opts.known_limitations)
        tests = collection.collect(adapters, suite, checks=opts.checks, cases=opts.cases, limitations=limitations,
                                   backward=opts.backward)
    except ValueError as e:
        raise UsageError(str(e)) from e
    device = device_of(opts)
    shape_plan = shapes.build(tests, suite, goldens.load_case)
    tests = shapes.order(tests, shape_plan)
    speed = {"cache_dir": os.environ.get(warmup.CACHE_VARIABLE), "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR"),
             "shape_plan": shape_plan.summary(), "autotune_configs": opts.autotune_configs}
    s = speed["shape_plan"]
    progress(f"shape plan: {s['distinct_compiled_shapes']} distinct compiled shapes in {s['groups']} groups "
             f"({s['distinct_compiled_shapes_before']} with the metamorphic configs of problems.CONFIGS)")
    warm_up = None
    if opts.warmup and shape_plan.shapes:
        selected = warmup.select(warmup.units(shape_plan, adapters), device,
                                 warmup.warm_keys(os.environ.get(warmup.CACHE_VARIABLE)))
        pending = {}
        for unit in selected[0]:
            key = warmup.pending_key(unit[0].name, warmup.is_backward(unit[1]))
            pending[key] = pending.get(key, 0) + 1
        speed["warmup_pending"] = pending
        warm_up = _warm_up_of(selected, opts, device, speed, progress)
        if not pending:  # nothing to compile: the record of the warm units, at once
            warm_up()
            warm_up = None
        # stable: the shape order within each part
        tests.sort(key=lambda t: warmup.pending_key(t.adapter.name, t.check == "backward") in pending)
    groups = {a.name: group_of(a) for a in adapters}
    entries = []
    for t in tests:
        e = {"id": t.id, "group": groups[t.adapter.name], "xfail": t.xfail, **_entry(t)}
        if isinstance(t, MutantTest):
            e["mutant"] = [_entry(x) for x in t.tests]
        e["nodeid"] = f"k3ref/{scope_name(e['group'])}::{t.id}"
        entries.append(e)
    plan = {
        "version": PLAN_VERSION, "device": device, "requested": sorted(requested), "n_goldens": len(suite),
        "golden_dir": str(opts.goldens or selection.default_goldens("--k3ref-goldens")),
        "adapters": {a.name: _facts(a, requested, groups[a.name]) for a in adapters},
        "tests": entries, "speed": speed,
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
    first case. The limits ($K3REF_SCALE_LIMITS) go into the plan, for the workers."""
    from . import registry, selection

    scale = registry.tier("scale")
    if opts.checks:
        raise UsageError("--checks: the scale tier has no checks to pick; --cases picks its cases "
                                   f"({', '.join(scale.CASES)})")
    kernels, requested = scale.select_kernels(opts, conftest_objects)
    cases = scale.cases_of(opts.cases)
    limits = scale.environment_limits()
    device = device_of(opts)
    ref = scale.reference_adapter(device)
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
    golden_dir = (str(opts.goldens or selection.default_goldens("--k3ref-goldens"))
                  if "reference_vs_goldens" in cases else opts.goldens)
    return {"version": PLAN_VERSION, "tier": "scale", "device": device, "requested": sorted(requested),
            "n_goldens": None, "golden_dir": golden_dir, "adapters": facts, "tests": entries, "speed": {},
            "scale": {"limits": asdict(limits), "cases": list(cases), "gpu": gpu}}


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
            warmup.write_record(record, os.environ.get(warmup.CACHE_VARIABLE) or ".")
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
