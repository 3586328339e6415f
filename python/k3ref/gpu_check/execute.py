"""Running one planned test in the process that holds its kernel (a pytest-xdist worker).

The adapters are selected here as the plan selected them (selection.select_adapters, the first time
a test needs them), each kernel is loaded once per process, and every call into adapter code
is guarded: an exception, a SystemExit or any other BaseException but KeyboardInterrupt
becomes that check's error with its traceback. A crash, a hang or an exit of the process is
the plugin's (pytest-xdist replaces the worker, pytest-timeout bounds the time).
"""
import os
import time
import traceback

from . import selection
from .collection import mutant_outcome, outcome
from .protocol import CheckResult, Test
from .registry import tier


def _error(adapter, check, case, what, e):
    return CheckResult(adapter, check, case, "error", f"{what}{type(e).__name__}: {e}".splitlines()[0][:300],
                       extra={"traceback": traceback.format_exc()[-2000:]})


class Executor:
    """One per process: the adapters of the run, what loading each gave, and the time split."""

    def __init__(self, opts, conftest_objects=(), scale=None):
        self.opts = opts
        self.scale = scale   # the plan's scale section (limits, ...) of a --k3ref-tier scale run
        self.conftest_objects = conftest_objects
        self.device = selection.device_of(opts)
        self._adapters = None
        self.requested = set()
        self.loaded = {}     # adapter name -> {available, reason, version, import_s, timing}
        self.started = {}    # adapter name -> monotonic time of its first check (the budget)

    def adapter(self, name):
        if self._adapters is None:
            if self.scale is not None:  # as the scale tier's plan selected them
                adapters, self.requested = tier("scale").select_kernels(self.opts, self.conftest_objects)
            else:
                adapters, self.requested, _ = selection.select_adapters(self.opts, self.conftest_objects)
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
            res = tier("scale").reference_vs_goldens(self.device, self.opts.goldens)[0]
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
