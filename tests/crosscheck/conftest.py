"""The independent NumPy cross-checks of the committed goldens, one pytest module per golden
family (test_*.py here), over the one NumPy oracle (tests/oracle/, importable as `oracle`
through pytest.ini's pythonpath).

    python3 -m pytest -q -p no:cacheprovider tests/crosscheck [--golden-dir DIR]

The golden directory is --golden-dir, else $K3REF_GOLDENS, else the checkout's goldens/.
Every test is one golden case (named by the case, so a failure names it); it evaluates its
checks through the `checks` fixture, which reports every failing check of the case at once,
as the former scripts did, and the session ends with the number of checks evaluated and the
worst figure of each module. A family with no case in the suite fails (test_family_present),
as the scripts failed when they checked nothing.
"""
import json
import os
from pathlib import Path

import pytest

CHECKOUT_GOLDENS = Path(__file__).resolve().parents[2] / "goldens"


def pytest_addoption(parser):
    parser.addoption("--golden-dir", metavar="DIR",
                     help="golden directory (default: $K3REF_GOLDENS, else the checkout's goldens/)")


def golden_directory(config):
    given = config.getoption("--golden-dir") or os.environ.get("K3REF_GOLDENS")
    return Path(given) if given else CHECKOUT_GOLDENS


def manifest_cases(config, accept):
    """The manifest entries whose operator `accept(op)` takes, in manifest order."""
    manifest = json.loads((golden_directory(config) / "MANIFEST.json").read_text())
    return [case for case in manifest["cases"] if accept(case["op"])]


def pytest_generate_tests(metafunc):
    """`case`: one manifest entry of the module's family (its accept_op); `golden_file`: one
    file of the golden directory matching the module's golden_glob, sorted by name."""
    if "case" in metafunc.fixturenames:
        cases = manifest_cases(metafunc.config, metafunc.module.accept_op)
        metafunc.parametrize("case", cases, ids=[case["name"] for case in cases])
    if "golden_file" in metafunc.fixturenames:
        files = sorted(golden_directory(metafunc.config).glob(metafunc.module.golden_glob))
        metafunc.parametrize("golden_file", files, ids=[path.stem for path in files])


@pytest.fixture(scope="session")
def golden_dir(request):
    return golden_directory(request.config)


@pytest.fixture(scope="module")
def family_cases(request):
    """Every manifest entry of the requesting module's family."""
    return manifest_cases(request.config, request.module.accept_op)


@pytest.fixture
def golden(case, golden_dir):
    """(tensors, metadata) of the case's file, read by the oracle's reader."""
    from oracle import load

    return load(golden_dir / case["file"])


class Checks:
    """The checks of one test: expect() records a failing condition, figure() the worst
    figure; verify() fails the test with every failure recorded."""

    def __init__(self, name):
        self.name = name
        self.count = 0
        self.failures = []
        self.worst = 0.0
        self.verified = False

    def expect(self, condition, what):
        self.count += 1
        if not condition:
            self.failures.append(what)
        return bool(condition)

    def figure(self, x):
        self.worst = max(self.worst, x)

    def verify(self):
        self.verified = True
        assert not self.failures, (f"{self.name}: {len(self.failures)} of {self.count} checks failed:\n"
                                   + "\n".join(self.failures[:50]))


_TOTALS = {}


@pytest.fixture
def checks(request):
    c = Checks(request.node.name)
    yield c
    total = _TOTALS.setdefault(request.module.__name__, {"checks": 0, "worst": 0.0})
    total["checks"] += c.count
    total["worst"] = max(total["worst"], c.worst)
    call = getattr(request.node, "crosscheck_call", None)
    if call is not None and call.passed and not c.verified:  # a test that cannot fail is a defect
        pytest.fail(f"{request.node.name} passed without verifying its {c.count} checks")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.crosscheck_call = report


def pytest_terminal_summary(terminalreporter):
    for module, total in sorted(_TOTALS.items()):
        terminalreporter.write_line(f"{module}: {total['checks']} checks evaluated, worst figure {total['worst']:.3e}")
