"""The hostile corpus (corpus.py) against the k3ref command, one test per case
(test_hostile.py), run by meson as

    python3 -m pytest -q -p no:cacheprovider tests/hostile/test_hostile.py \\
        --exe BUILD/k3ref --golden-dir goldens [--sanitized] [--keep DIR]

The command is --exe, else $K3REF_EXE; the goldens --golden-dir, else $K3REF_GOLDENS, else the
checkout's goldens/. --sanitized (an ASan/UBSan build) shrinks the cases that are hostile only
by their volume and allows 4 times the time; --keep DIR generates the corpus in DIR and keeps
it. The corpus is generated once, when the tests are collected (every case's crafted files in
its own directory, some 250 MB in all), and each case's directory is removed after its test;
-k NAME selects cases as run_hostile.py's --only did. The session ends with one line per case
and the count per class and outcome.
"""
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

import corpus

CHECKOUT_GOLDENS = Path(__file__).resolve().parents[2] / "goldens"


def pytest_addoption(parser):
    group = parser.getgroup("hostile", "the hostile corpus against the k3ref command")
    group.addoption("--exe", metavar="PATH", help="the k3ref command (default: $K3REF_EXE)")
    group.addoption("--golden-dir", metavar="DIR",
                    help="golden directory (default: $K3REF_GOLDENS, else the checkout's goldens/)")
    group.addoption("--sanitized", action="store_true",
                    help="an instrumented (ASan/UBSan) build: volume-only cases at 1/4, 4 x the time limit")
    group.addoption("--keep", metavar="DIR", help="generate the corpus in DIR and keep it")


def exe(config):
    given = config.getoption("--exe") or os.environ.get("K3REF_EXE")
    if not given:
        raise pytest.UsageError("the k3ref command is --exe PATH or $K3REF_EXE")
    path = os.path.abspath(given)
    if not os.access(path, os.X_OK):
        raise pytest.UsageError(f"the k3ref command {path} is not an executable file")
    return path


def goldens(config):
    given = config.getoption("--golden-dir") or os.environ.get("K3REF_GOLDENS")
    return os.path.abspath(given) if given else str(CHECKOUT_GOLDENS)


class Corpus:
    """The generated cases (by name, in corpus order), their work directory, the generation's
    seconds and, filled by the tests, one record per case run."""

    def __init__(self, config):
        self.keep = config.getoption("--keep")
        self.work = os.path.abspath(self.keep) if self.keep else tempfile.mkdtemp(prefix="k3ref_hostile_")
        os.makedirs(self.work, exist_ok=True)
        start = time.monotonic()
        self.cases = corpus.cases(self.work, goldens(config), scale=0.25 if config.getoption("--sanitized") else 1.0)
        self.generation_seconds = time.monotonic() - start
        self.names = [c.name for c in self.cases]
        self.records = []

    def remove(self):
        if not self.keep:
            shutil.rmtree(self.work, ignore_errors=True)


_CORPUS = pytest.StashKey()


def hostile_corpus_of(config):
    if _CORPUS not in config.stash:
        config.stash[_CORPUS] = Corpus(config)
    return config.stash[_CORPUS]


def pytest_generate_tests(metafunc):
    """`case`: one case of the corpus, named by the case (ids are the case names)."""
    if "case" in metafunc.fixturenames:
        exe(metafunc.config)  # a usage error before 250 MB are written
        c = hostile_corpus_of(metafunc.config)
        metafunc.parametrize("case", c.cases, ids=c.names)


def pytest_unconfigure(config):
    if _CORPUS in config.stash:
        config.stash[_CORPUS].remove()


@pytest.fixture(scope="session")
def hostile_corpus(request):
    return hostile_corpus_of(request.config)


@pytest.fixture(scope="session")
def k3ref_exe(request):
    return exe(request.config)


@pytest.fixture(scope="session")
def sanitized(request):
    return request.config.getoption("--sanitized")


@pytest.fixture
def replay(request, k3ref_exe):
    """The command that runs this test alone (what a failing case prints)."""
    config = request.config
    words = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             f"{request.node.path}::{request.node.name}", "--exe", k3ref_exe, "--golden-dir", goldens(config)]
    if config.getoption("--sanitized"):
        words.append("--sanitized")
    return shlex.join(words)


def pytest_terminal_summary(terminalreporter, config):
    if _CORPUS not in config.stash or not config.stash[_CORPUS].records:
        return
    c = config.stash[_CORPUS]
    write = terminalreporter.write_line
    outcomes, by_class, slowest = {}, {}, (0.0, "")
    for r in c.records:
        write(f"{r['verdict']:11} {r['outcome']:7} {r['seconds']:6.2f} s {r['rss'] >> 20:5} MiB  {r['name']}  "
              f"[{r['klass']}]  {r['first_line']}")
        for p in r["problems"]:
            write(f"            - {p}")
        outcomes[(r["outcome"], r["verdict"])] = outcomes.get((r["outcome"], r["verdict"]), 0) + 1
        per_class = by_class.setdefault(r["klass"].split(":")[0], {})
        per_class[r["outcome"]] = per_class.get(r["outcome"], 0) + 1
        slowest = max(slowest, (r["seconds"], r["name"]))
    write("by class: " + "; ".join(f"{k} {sum(v.values())} (" + ", ".join(f"{n} {o}" for o, n in sorted(v.items()))
                                   + ")" for k, v in sorted(by_class.items())))
    summary = ", ".join(f"{n} {verdict} with {outcome}" for (outcome, verdict), n in sorted(outcomes.items()))
    write(f"{len(c.records)} of {len(c.cases)} hostile cases run ({summary}); corpus generated in "
          f"{c.generation_seconds:.1f} s, slowest {slowest[0]:.2f} s ({slowest[1]})")
