"""What the harness's tests share (tests/gpu_check/test_*.py, run as
`K3REF_CORE_PATH=BUILD/python python3 -m pytest -q tests/gpu_check/`): the source root, the
environment of the child processes they start, and three ways to run the harness:

- gpu_check_here(*args): `python3 -m k3ref.gpu_check ARGS` in this process (cli.main; the
  checks still run in the plugin's planning child and pytest-xdist workers);
- gpu_check(*args): the same command in a child process;
- run_pytest(*args, cwd=DIR): `python3 -m pytest -p k3ref.pytest_plugin ARGS` in a child.

The import paths (the package's source tree, this directory's adapters, the oracle) are
pytest.ini's `pythonpath`; the children get them through PYTHONPATH.
"""
import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "tests" / "gpu_check"

# The harness judges through k3ref._core (the one judge): its children, which run in
# temporary directories, need the build's module at the path the command gave, which the
# documented command gives relative to the checkout (K3REF_CORE_PATH=build/python).
if os.environ.get("K3REF_CORE_PATH"):
    os.environ["K3REF_CORE_PATH"] = os.path.abspath(os.environ["K3REF_CORE_PATH"])


def _child_env(**extra):
    """The environment of a child that runs the harness: the package from the source tree
    and this directory's adapters on PYTHONPATH, no PYTEST_ADDOPTS of the caller's."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), str(HERE)]), **extra)
    env.pop("PYTEST_ADDOPTS", None)
    return env


def package_on_startup_path():
    """Whether this interpreter started with the source tree's package on its path
    (PYTHONPATH), as the pytest-xdist workers of an in-process run need it."""
    return any(p and Path(p).resolve() == (ROOT / "python").resolve()
               for p in os.environ.get("PYTHONPATH", "").split(os.pathsep))


class Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture(scope="session")
def root():
    return ROOT


@pytest.fixture(scope="session")
def child_env():
    """child_env(**extra): the environment of a child that runs the harness."""
    return _child_env


# What a run sets in its own process's environment (run.apply_environment: Triton's own settings).
RUN_ENVIRONMENT = ("TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING")


@pytest.fixture
def gpu_check_here():
    """`python3 -m k3ref.gpu_check ARGS` in this process: a Result of its exit code, stdout and
    stderr. What the run set in this process's environment is undone after the test."""
    from k3ref.gpu_check import cli

    keys = set(RUN_ENVIRONMENT) | {"PYTEST_ADDOPTS"}
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.pop("PYTEST_ADDOPTS", None)

    def run(*args):
        if "--no-isolation" not in args and not package_on_startup_path():
            pytest.fail("the harness's pytest-xdist workers start with the sys.path this interpreter started with "
                        "(xdist), without pytest.ini's pythonpath: they cannot import k3ref.pytest_plugin unless "
                        f"PYTHONPATH names {ROOT / 'python'} (meson's gpu_check_env does); see "
                        "test_fail_closed.py::test_a_run_inside_a_pytest_session_finds_the_package_on_its_pythonpath")
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main([str(a) for a in args])
        return Result(code, out.getvalue(), err.getvalue())

    yield run
    for k, v in saved.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture(scope="session")
def gpu_check():
    """`python3 -m k3ref.gpu_check ARGS` in a child (a CompletedProcess, text)."""
    def run(*args, cwd=None, env=None, timeout=300):
        return subprocess.run([sys.executable, "-m", "k3ref.gpu_check", *map(str, args)], env=env or _child_env(),
                              cwd=cwd, capture_output=True, text=True, timeout=timeout)

    return run


@pytest.fixture(scope="session")
def run_pytest():
    """`python3 -m pytest -p k3ref.pytest_plugin -p no:cacheprovider ARGS` in a child, in `cwd`."""
    def run(*args, cwd, env=None, timeout=300):
        return subprocess.run([sys.executable, "-m", "pytest", "-p", "k3ref.pytest_plugin", "-p", "no:cacheprovider",
                               *map(str, args)], env=env or _child_env(), cwd=cwd, capture_output=True, text=True,
                              timeout=timeout)

    return run


_SKIPPED_AT_COLLECTION = []


def pytest_collectreport(report):
    if report.skipped:
        _SKIPPED_AT_COLLECTION.append(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    # Every module skipped at collection (a module's pytest.importorskip of torch where it is
    # missing) is "no tests collected" (5) to pytest; to meson it is a skip (77).
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and _SKIPPED_AT_COLLECTION:
        session.exitstatus = 77
