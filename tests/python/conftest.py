"""Tests of the Python package k3ref (python/k3ref/), run by `meson test` as
/usr/bin/python3 -m pytest tests/python. They import the package from the source tree and
its compiled half from the build directory (K3REF_CORE_PATH, set by tests/meson.build);
K3REF_EXE is the `k3ref` command of the same build. Tests that need the compiled half skip,
saying so, in a build without it (the sanitizer build).

The import paths of these tests are set here, the one place: the package from the source tree
(python/, first; not with K3REF_TEST_INSTALLED=1, which tests an installed k3ref), and tests/
(last), so that the NumPy oracle imports as `oracle` and the hostile corpus as `hostile.corpus`;
the test modules edit no sys.path."""
import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if os.environ.get("K3REF_TEST_INSTALLED") != "1":
    sys.path.insert(0, str(ROOT / "python"))
sys.path.append(str(ROOT / "tests"))
# einops for FLA's layer code (test_layer_check_fla_code.py), from the checkout's pydeps where
# the interpreter has none.
if importlib.util.find_spec("einops") is None and (ROOT / ".thirdparty" / "pydeps" / "einops").exists():
    sys.path.append(str(ROOT / ".thirdparty" / "pydeps"))
GOLDENS = ROOT / "goldens"
os.environ.setdefault("K3REF_GOLDENS", str(GOLDENS))


def core_available():
    import k3ref
    try:
        k3ref._compiled()
        return True
    except ImportError:
        return False


needs_core = pytest.mark.skipif(not core_available(), reason="k3ref._core not built (instrumented build or no pybind11)")


def vocabulary_names(option):
    """The allowed names of a named-value option (the compiled options vocabulary), for
    parametrising at import time; () without the compiled half, whose tests skip."""
    import k3ref
    return k3ref.option_vocabulary()[option]["values"] if core_available() else ()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Without the compiled half (an instrumented build), a test that reaches it skips, as the
    module docstring says: k3ref.policy judges through k3ref._core, so a test of anything that
    judges needs it. Only that ImportError, and only when the module is not built, skips."""
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is not None and call.excinfo.errisinstance(ImportError) and "k3ref._core" in str(call.excinfo.value) \
            and not core_available():
        report.outcome, report.longrepr = "skipped", (str(item.path), item.location[1] or 0,
                                                     "Skipped: needs k3ref._core (not built in this build)")
