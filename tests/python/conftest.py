"""Tests of the Python package k3ref (python/k3ref/), run by `meson test` as
/usr/bin/python3 -m pytest tests/python. They import the package from the source tree and
its compiled half from the build directory (K3REF_CORE_PATH, set by tests/meson.build);
K3REF_EXE is the `k3ref` command of the same build. Tests that need the compiled half skip,
saying so, in a build without it (the sanitizer build)."""
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if os.environ.get("K3REF_TEST_INSTALLED") != "1":
    sys.path.insert(0, str(ROOT / "python"))
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
