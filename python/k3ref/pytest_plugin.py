"""pytest plugin: your kernel against the k3ref goldens, one pytest test per adapter x case x check.

    pytest --k3ref-adapter mypkg.kernels:MyKda            # or list them in conftest.py:
    # conftest.py
    k3ref_adapters = ["mypkg.kernels:MyKda"]

Tests are named `ADAPTER-CASE-CHECK` (e.g. `my.kda-kda_t100-golden`) under `k3ref::`, so
`-k`, `-x`, `--junitxml` and pytest-xdist (`-n`) work as for any test. The collection is the
one `python3 -m k3ref.gpu_check run` uses (k3ref.gpu_check.collection): each adapter's checks
run in a child process (a crash or hang fails that test only), known limitations
(known_limitations.json, or --k3ref-known-limitations FILE) run as strict xfail, and a
mutant is one test that passes when some check catches it. Fail closed: an adapter spec
that does not load is a usage error; an adapter you named that is not available fails its
tests; a session in which k3ref tests were collected but none executed a check fails.

The plugin is registered by the package's `pytest11` entry point; from a source tree, pass
`-p k3ref.pytest_plugin`.
"""
import os

import pytest

_STATE = {}


def pytest_addoption(parser):
    g = parser.getgroup("k3ref", "kernels against the k3ref goldens")
    g.addoption("--k3ref-adapter", action="append", default=[], metavar="MODULE:NAME",
                help="an adapter to check (class, instance or function returning adapters; MODULE may be a file.py); "
                     "repeatable")
    g.addoption("--k3ref-builtin", action="store_true",
                help="also collect the built-in adapters and installed entry points (not asked for: unavailable ones skip)")
    g.addoption("--k3ref-goldens", metavar="DIR", help="golden directory (default: $K3REF_GOLDENS, else the checkout's goldens/)")
    g.addoption("--k3ref-device", metavar="DEVICE", help="torch device (default: cuda when available, else cpu)")
    g.addoption("--k3ref-known-limitations", metavar="FILE", help="known-limitations file (default: the package's)")
    g.addoption("--k3ref-check-timeout", type=float, default=900.0, metavar="S",
                help="seconds one check may take before its child process is killed (default 900)")
    g.addoption("--k3ref-load-timeout", type=float, default=900.0, metavar="S",
                help="seconds starting a child process and loading its kernel may take (default 900)")
    g.addoption("--k3ref-no-isolation", action="store_true", help="run the checks in the pytest process")


def _conftest_specs(config):
    specs = []
    for plugin in config.pluginmanager.get_plugins():
        listed = getattr(plugin, "k3ref_adapters", None)
        if listed is not None and getattr(plugin, "__name__", "").rpartition(".")[2] == "conftest":
            specs += list(listed)
    return specs


class K3refFailure(Exception):
    pass


class K3refItem(pytest.Item):
    def __init__(self, *, test, **kw):
        super().__init__(**kw)
        self.test = test
        if test.xfail:
            self.add_marker(pytest.mark.xfail(reason=test.xfail, strict=True))

    def _runner(self):
        return _STATE["runner"]

    def runtest(self):
        from k3ref.gpu_check.collection import MutantTest, mutant_outcome

        requested = _STATE["requested"]
        if isinstance(self.test, MutantTest):
            results = [self._runner().run(t) for t in self.test.tests]
            # Judged without its known-limitation entry: pytest's strict xfail marker handles that.
            verdict, reason = mutant_outcome(MutantTest(self.test.adapter, self.test.tests), results, requested)
            if verdict == "pass":
                return
            raise K3refFailure(reason)
        res = self._runner().run(self.test)
        self.user_properties.append(("k3ref_status", res.status))
        if res.ratio is not None:
            self.user_properties.append(("k3ref_ratio", res.ratio))
        if res.status == "skip":
            if res.extra.get("unavailable") and self.test.adapter.name in requested:
                why = res.reason[len("not available: "):] if res.reason.startswith("not available: ") else res.reason
                raise K3refFailure(f"{self.test.adapter.name} was asked for but is not available: {why}")
            pytest.skip(res.reason)
        if res.status == "pass":
            return
        lines = [f"{res.check}[{res.case}] {res.status}: {res.reason}"]
        for key in ("worst_element", "final_state_worst_element"):
            w = res.extra.get(key)
            if w:
                lines.append(f"{key}: index {w['index']}: candidate {w['candidate']!r}, reference {w['reference']!r}")
        if res.extra.get("stderr_tail"):
            lines.append("last lines of the child's stderr:\n" + res.extra["stderr_tail"])
        raise K3refFailure("\n".join(lines))

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, K3refFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"k3ref {self.test.id}"


def _build(config):
    from k3ref.gpu_check import collection, selection
    from k3ref.gpu_check.registry import AdapterSpecError, discover

    specs = list(config.getoption("k3ref_adapter")) + _conftest_specs(config)
    if not specs and not config.getoption("k3ref_builtin"):
        return None
    try:
        adapters, requested = discover(specs=config.getoption("k3ref_adapter"), conftest_specs=_conftest_specs(config),
                                       entry_points=config.getoption("k3ref_builtin"))
        goldens = config.getoption("k3ref_goldens") or selection.default_goldens("--k3ref-goldens")
        suite = selection.load_suite(goldens, adapters)
        limitations = collection.load_limitations(config.getoption("k3ref_known_limitations"))
        collection.validate(adapters, suite)
        from k3ref.gpu_check import shapes

        shapes.choose_all(adapters, suite)  # the metamorphic configs `run` uses (same test ids)
        tests = collection.collect(adapters, suite, limitations=limitations)
    except (AdapterSpecError, selection.UsageError, ValueError) as e:
        raise pytest.UsageError(f"k3ref: {e}") from e
    return adapters, requested, tests


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    built = _build(config)
    if built is None:
        return
    adapters, requested, tests = built
    import torch

    from k3ref.gpu_check.isolation import Runner

    device = config.getoption("k3ref_device") or ("cuda" if torch.cuda.is_available() else "cpu")
    _STATE["requested"] = requested
    _STATE["runner"] = Runner(device, check_timeout=config.getoption("k3ref_check_timeout"),
                              load_timeout=config.getoption("k3ref_load_timeout"),
                              isolate=not config.getoption("k3ref_no_isolation"))
    for t in tests:
        items.append(K3refItem.from_parent(session, name=t.id, nodeid=f"k3ref::{t.id}", test=t))


def pytest_runtest_logreport(report):
    if not report.nodeid.startswith("k3ref::"):
        return
    counts = _STATE.setdefault("counts", {"seen": 0, "executed": 0})
    if report.when == "call" or (report.when == "setup" and report.skipped):
        counts["seen"] += 1
        if report.when == "call" and (report.passed or report.failed or hasattr(report, "wasxfail")):
            counts["executed"] += 1


def pytest_sessionfinish(session, exitstatus):
    runner = _STATE.pop("runner", None)
    if runner is not None:
        runner.close()
    counts = _STATE.get("counts")
    if counts and counts["seen"] and not counts["executed"] and exitstatus == 0 and \
            not os.environ.get("PYTEST_XDIST_WORKER"):
        session.exitstatus = 1
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.write_line(f"k3ref: FAIL: {counts['seen']} k3ref tests collected, none executed a check "
                          "(all skipped): nothing was verified", red=True)
