"""Isolation through pytest-xdist and pytest-timeout, one test per rule: a kernel that aborts,
segfaults, calls os._exit(0) or raises SystemExit inside its check, hangs, or allocates 50 GB
fails that one test with its reason; the run's exit code is 1, every other test ran and the
report is complete. Adapter code that exits or hangs while it is imported stops the run with a
usage error (exit 2), never a pass. This process imports no adapter: the runs are children.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("xdist")
pytest.importorskip("pytest_timeout")

ROOT = Path(__file__).resolve().parents[2]
HOSTILE = Path(__file__).with_name("data") / "hostile_adapters.py"
CASES = "kda_t1,kda_b2_t37,kda_t100"
REASONS = {"abort": "Fatal Python error: Aborted", "segfault": "Fatal Python error: Segmentation fault",
           "exit0": "nothing on stderr (os._exit or a kill)", "sysexit": "SystemExit: 0", "hang": "timed out",
           "alloc50g": "", "nonfinite": "NaN/Inf"}


def run(out, *extra, env=None, timeout=600):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"), **(env or {}))
    cmd = [sys.executable, "-m", "k3ref.gpu_check", "run", "--no-builtin", "--adapter", f"{HOSTILE}:adapters",
           "--goldens", str(ROOT / "goldens"), "--device", "cpu", "--no-warmup", "--checks", "golden,causality",
           "--cases", CASES, "--out", str(out), *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory):
    """One run of every misdeed side by side (two workers), with a 20 s check timeout."""
    out = tmp_path_factory.mktemp("isolation") / "r"
    proc = run(out, "--check-jobs", "2", "--check-timeout", "20", "--load-timeout", "60")
    data = json.loads((out / "report.json").read_text())
    by_adapter = {}
    for r in data["results"]:
        by_adapter.setdefault(r["adapter"], {})[f"{r['case']}/{r['check']}"] = r
    return proc, by_adapter, data["summary"], out


@pytest.mark.parametrize("misdeed", sorted(REASONS))
def test_a_misbehaving_check_fails_alone(hostile_run, misdeed):
    proc, by_adapter, summary, out = hostile_run
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = dict(by_adapter[f"hostile.{misdeed}"])
    bad = results.pop("kda_t100/golden")
    assert bad["status"] == ("fail" if misdeed == "nonfinite" else "error"), bad
    assert REASONS[misdeed] in bad["reason"], bad["reason"]
    # every other test of the kernel ran and passed: two goldens and the causality check
    assert sorted(results) == ["generic_k100/causality", "kda_b2_t37/golden", "kda_t1/golden"]
    assert all(r["status"] == "pass" for r in results.values()), {k: r["reason"] for k, r in results.items()}


def test_the_report_of_the_hostile_run_is_complete(hostile_run):
    proc, by_adapter, summary, out = hostile_run
    assert sorted(by_adapter) == sorted(f"hostile.{m}" for m in list(REASONS) + ["none"])
    assert all(r["status"] == "pass" for r in by_adapter["hostile.none"].values())
    assert summary["verdict"] == "FAIL" and summary["tests"] == 4 * 8 and summary["failed"] == 7
    # the report is written with non-finite figures in it (an o of +inf: its windows are inf)
    assert "hostile.nonfinite-kda_t100-golden" in (out / "report.html").read_text()
    assert (out / "report.html").is_file() and (out / "report.xml").is_file()
    assert f"FAIL hostile.abort-kda_t100-golden" in proc.stdout


@pytest.mark.parametrize("misdeed,expect", [("exit", "exited with status 0 without a plan"),
                                            ("hang", "took more than 10 s")])
def test_adapter_code_that_exits_or_hangs_at_import_is_a_usage_error(tmp_path, misdeed, expect):
    proc = run(tmp_path / "r", "--load-timeout", "10", env={"K3REF_HOSTILE_IMPORT": misdeed})
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and expect in lines[0], proc.stderr
    assert not (tmp_path / "r" / "report.json").exists()


def test_a_known_limitation_that_crashes_is_an_xfail_and_runs_once(tmp_path):
    """A strict known limitation whose test kills its worker (FlashKDA's varlen abort) is that
    limitation, not a failure; with idle workers beside it, the crashed test is not run again."""
    limits = tmp_path / "limits.json"
    limits.write_text(json.dumps({"entries": [{"adapter": "hostile.abort", "check": "golden", "case": "kda_t100",
                                               "reason": "aborts on T = 100 (the test's stand-in)"}]}))
    proc = run(tmp_path / "r", "--only", "hostile.abort,hostile.none", "--known-limitations", str(limits),
               "--check-jobs", "3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "r" / "report.json").read_text())
    summary = data["summary"]
    assert summary["xfailed"] == 1 and summary["failed"] == 0 and summary["verdict"] == "PASS"
    crashed = next(r for r in data["results"] if r["adapter"] == "hostile.abort" and r["case"] == "kda_t100")
    assert "Fatal Python error: Aborted" in crashed["reason"], crashed["reason"]  # the crash, not "no result"
    assert proc.stdout.count("node down") + proc.stderr.count("node down") == 1  # one crash: not run again


def test_a_limitation_that_ends_its_process_runs_in_a_scope_of_its_own(tmp_path):
    """Marked ends_process, the crashing limitation is planned in a pytest-xdist scope of its
    own (so its worker's replacement holds up none of its group's tests): the group's other
    tests share one scope, the crash another; the run still passes with it as its xfail."""
    import xml.etree.ElementTree as ET

    limits = tmp_path / "limits.json"
    limits.write_text(json.dumps({"entries": [{"adapter": "hostile.abort", "check": "golden", "case": "kda_t100",
                                               "reason": "aborts on T = 100 (the test's stand-in)",
                                               "ends_process": True}]}))
    proc = run(tmp_path / "r", "--only", "hostile.abort", "--known-limitations", str(limits), "--check-jobs", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "r" / "report.json").read_text())["summary"]
    assert summary["xfailed"] == 1 and summary["passed"] == 3 and summary["verdict"] == "PASS"
    scopes = {tc.get("name"): tc.get("classname") for tc in ET.parse(tmp_path / "r" / "report.xml").getroot().iter("testcase")}
    crash = scopes.pop("hostile.abort-kda_t100-golden")
    assert len(set(scopes.values())) == 1 and crash not in scopes.values(), (crash, scopes)
    assert "ends_its_process" in crash, crash


def test_without_isolation_an_exit_in_adapter_code_is_no_pass(tmp_path):
    """`run --no-isolation` runs the adapters in the pytest process; an os._exit(0) there ends
    it with status 0 and no report, which the front end reads as a failure."""
    proc = run(tmp_path / "r", "--only", "hostile.exit0", "--no-isolation")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "wrote no report" in proc.stderr


def test_prop_with_a_kernel_that_exits_0_is_no_pass(tmp_path):
    """`prop` runs the kernel in a child; an exit 0 of the kernel leaves no verdict: exit 1."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    proc = subprocess.run([sys.executable, "-m", "k3ref.gpu_check", "prop", "--kernel", "hostile.exit_always",
                           "--adapter", f"{HOSTILE}:ExitAlways", "--examples", "3", "--device", "cpu", "--no-warmup",
                           "--out", str(tmp_path / "p")], env=env, capture_output=True, text=True, timeout=300,
                          cwd=str(ROOT))
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "recorded no verdict" in proc.stderr


def warmup(tmp_path, *extra, env=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"), **(env or {}))
    cmd = [sys.executable, "-m", "k3ref.gpu_check", "warmup", "--no-builtin", "--adapter", f"{HOSTILE}:adapters",
           "--goldens", str(ROOT / "goldens"), "--device", "cpu", "--cache-dir", str(tmp_path / "cache"), *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=str(ROOT))


def test_warmup_plans_in_a_child_whose_output_and_exit_code_are_the_commands(tmp_path):
    """`warmup` loads the adapters (adapter code) in a child: its output and exit code pass
    through, a usage error included."""
    proc = warmup(tmp_path, "--only", "hostile.none", "--cases", "kda_t1", "--plan")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.startswith("shape plan: ") and proc.stdout.splitlines()[-1] == "[]", proc.stdout
    assert str(tmp_path / "cache") in proc.stdout
    proc = warmup(tmp_path, "--jobs", "0")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.splitlines() == ["python3 -m k3ref.gpu_check warmup: error: --jobs 0: must be at least 1"]


@pytest.mark.parametrize("misdeed,expect", [("exit", "ended with exit 0 but recorded no verdict"),
                                            ("kill", "ended with signal SIGKILL and recorded no verdict")])
def test_warmup_with_adapter_code_that_ends_its_child_fails(tmp_path, misdeed, expect):
    """Adapter code that ends the warm-up's child while it is imported (os._exit(0), a kill)
    fails the command with one line: no exit 0 without the command's own."""
    proc = warmup(tmp_path, "--plan", env={"K3REF_HOSTILE_IMPORT": misdeed})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and expect in lines[0], proc.stderr


class _Node:
    """A pytest-xdist worker as its scheduler sees it: the tests sent to it, its shutdown."""

    def __init__(self, name):
        self.gateway = type("Gateway", (), {"id": name})()
        self.shutting_down, self.sent = False, []

    def send_runtest_some(self, indexes):
        self.sent += indexes

    def shutdown(self):
        self.shutting_down = True


def _scheduler(clones):
    """The plugin's scheduler for two workers, over a fake configuration and pytest-xdist session
    whose replacement of a dead worker is recorded in `clones`."""
    from types import SimpleNamespace

    from k3ref import pytest_plugin

    options = {"k3ref_plan_out": None, "k3ref_adapter": ["a"], "k3ref_no_isolation": False}
    dsession = SimpleNamespace(_clone_node=clones.append)
    config = SimpleNamespace(option=SimpleNamespace(dist="loadscope", numprocesses=2),
                             getoption=lambda name: options.get(name), getvalue=lambda name: ["2*popen"],
                             pluginmanager=SimpleNamespace(getplugin=lambda name: dsession))
    return pytest_plugin.pytest_xdist_make_scheduler(config, None), dsession


def test_a_dead_workers_group_goes_to_an_idle_worker_without_a_replacement():
    """A worker that finished its groups is kept while another still runs one; when that one
    dies, the rest of its group goes to the idle worker at once, and no replacement is started
    (a replacement takes seconds to start, and the session waits for it before it ends)."""
    pytest.importorskip("xdist.scheduler")
    clones = []
    sched, dsession = _scheduler(clones)
    a, b = _Node("gw0"), _Node("gw1")
    tests = [f"k3ref/big::t{i}" for i in range(4)] + [f"k3ref/small{g}::t0" for g in range(4)]
    for node in (a, b):
        sched.add_node(node)
        sched.add_node_collection(node, tests)
    sched.schedule()
    assert (a.sent, b.sent) == ([0, 1, 2, 3], [4, 5])  # two groups left in the queue
    for index in (4, 5, 6, 7):
        sched.mark_test_complete(b, index)
    assert b.sent == [4, 5, 6, 7] and not b.shutting_down  # idle, kept: gw0 has 4 tests to run
    sched.mark_test_complete(a, 0)
    crashed = sched.remove_node(a)  # gw0 dies while it runs its second test
    dsession._clone_node(a)
    assert crashed == "k3ref/big::t1" and b.sent == [4, 5, 6, 7, 2, 3] and clones == []
    sched.mark_test_complete(b, 2)
    sched.mark_test_complete(b, 3)
    assert sched.tests_finished


def test_a_dead_worker_is_replaced_when_its_work_is_left_queued():
    """A worker that dies before the tests are handed out, or whose group's rest no live worker
    took, is replaced."""
    pytest.importorskip("xdist.scheduler")
    clones = []
    sched, dsession = _scheduler(clones)
    early = _Node("gw9")
    sched.add_node(early)
    assert sched.remove_node(early) is None  # died while collecting
    dsession._clone_node(early)
    assert clones == [early]
    clones.clear()
    a, b = _Node("gw0"), _Node("gw1")
    tests = [f"k3ref/g{g}::t{i}" for g in range(3) for i in range(3)]
    for node in (a, b):
        sched.add_node(node)
        sched.add_node_collection(node, tests)
    sched.schedule()
    busy_b = list(b.sent)
    crashed = sched.remove_node(a)  # gw0 dies at its first test; gw1 has three of its own left
    dsession._clone_node(a)
    assert crashed == "k3ref/g0::t0" and clones == [a] and b.sent == busy_b
