"""The harness's verdicts fail closed, its checks run isolated, and the pytest plugin collects
one test per adapter x case x check (python3 -m k3ref.gpu_check, k3ref.pytest_plugin), on
the CPU with pure-PyTorch kernels (tests/gpu_check/test_adapters.py, examples/).

Each rule of the verdict is shown by a run that must exit non-zero with its one-line reason:
nothing executed, a kernel asked for that cannot be loaded, an unknown name in --only,
--checks, --cases, --kernel or --adapter, prop on an unavailable kernel, a mutant that could
not run, a mutant not caught, a known limitation that passes. A skip of a kernel nobody asked
for is a pass. An abort, a segfault and a hang each become that check's failure while the
run goes on (pytest-xdist replaces the worker) and writes its report. Skipped without torch,
pytest-xdist or pytest-timeout. Tests marked xfail(strict) show a defect of the runner: they
fail as soon as it is fixed, and their marker goes then.
"""
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("xdist")
pytest.importorskip("pytest_timeout")

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "tests" / "gpu_check"
EXAMPLE = f"{ROOT / 'examples' / 'torch_kda_adapter.py'}:TorchKda"


@pytest.fixture
def out(tmp_path):
    return tmp_path


@pytest.fixture
def run_ok(gpu_check_here, out):
    """A run in this process into OUT/r: asserts its exit code and that `message` is in its output."""
    def run(*args, code, message):
        r = gpu_check_here(*args, "--out", str(out / "r"))
        assert r.returncode == code, r.stdout[-3000:] + r.stderr[-3000:]
        assert message in r.stdout + r.stderr, r.stdout[-3000:] + r.stderr[-3000:]
        return r

    return run


# --------------------------------------------------------------------------- the verdict's rules

SELECTOR_ERRORS = [
    (["--only", "no.such_kernel"], "--only: no kernel named 'no.such_kernel'"),
    (["--checks", "golden,no_such_check"], "--checks: no check named 'no_such_check'"),
    (["--cases", "kda_t1,no_such_case"], "--cases: no golden case named 'no_such_case'"),
    (["--adapter", "no_such_module:Kernel"], "cannot import no_such_module"),
    (["--adapter", "test_adapters:NoSuchClass"], "has no attribute 'NoSuchClass'"),
    (["--adapter", "test_adapters:UnknownPolicy"], "unknown tolerance policy 'no-such-policy'"),
    (["--warmup-shards", "0"], "--k3ref-warmup-shards 0: must be at least 1"),
    (["--jobs", "-1"], "--k3ref-warmup-jobs -1: must be at least 1")]


@pytest.mark.parametrize("args,message", SELECTOR_ERRORS, ids=[a[1] for a, _ in SELECTOR_ERRORS])
def test_unknown_names_in_selectors_are_usage_errors(run_ok, args, message):
    r = run_ok("run", "--no-builtin", "--adapter", "test_adapters:Correct", *args, code=2, message=message)
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr  # one line


def test_a_usage_error_is_one_line_with_warnings_shown(child_env, out):
    # As `python3 -X dev` or a unittest runner would show them.
    r = subprocess.run([sys.executable, "-W", "default", "-m", "k3ref.gpu_check", "run", "--no-builtin", "--adapter",
                        "test_adapters:Correct", "--checks", "golden,no_such_check", "--out", str(out / "r")],
                       env=child_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stderr.strip().splitlines() == [
        "ERROR: k3ref: --checks: no check named 'no_such_check' (known: golden, causality, suffix, varlen, split, "
        "determinism, poisoned_memory, inputs_unchanged)"], r.stderr


def test_a_usage_error_comes_back_from_inside_an_outer_xdist_worker(child_env, out):
    # A run started by a test that itself runs in a pytest-xdist worker (this suite under -n):
    # its planning child is not a worker of it, and its stderr is not sent into a worker log.
    env = dict(child_env(), PYTEST_XDIST_WORKER="gw7", PYTEST_XDIST_WORKER_COUNT="8")
    r = subprocess.run([sys.executable, "-m", "k3ref.gpu_check", "run", "--no-builtin", "--adapter",
                        "test_adapters:Correct", "--checks", "golden,no_such_check", "--out", str(out / "r")],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    assert len(r.stderr.strip().splitlines()) == 1 and "no check named 'no_such_check'" in r.stderr, r.stderr


def test_prop_on_an_unknown_kernel_is_a_usage_error(gpu_check_here):
    r = gpu_check_here("prop", "--kernel", "no.such_kernel")
    assert r.returncode == 2, r.stderr
    assert "no kernel named 'no.such_kernel'" in r.stderr


def test_a_run_that_executes_no_check_fails(run_ok):
    run_ok("run", "--no-builtin", "--adapter", "test_adapters:SupportsNothing", code=1,
           message="FAIL: no check was executed (every test was skipped or nothing was collected)")
    # Every built-in unavailable on this CPU host and not asked for: all skipped, and the
    # run fails because nothing was verified, not because of the skips.
    r = run_ok("run", "--no-mutants", "--device", "cpu", code=1, message="FAIL: no check was executed")
    assert "asked for" not in r.stdout


def test_a_kernel_asked_for_that_cannot_be_loaded_fails(run_ok, out):
    run_ok("run", "--no-builtin", "--adapter", "test_adapters:Unloadable", "--cases", "kda_t1", code=1,
           message="test.unloadable was asked for but is not available: ImportError: No module named "
                   "'not_installed_kernel'")
    failures = ET.parse(out / "r" / "report.xml").getroot().findall("testsuite/testcase/failure")
    assert len(failures) == 8  # the golden and the 7 other checks: failures in JUnit too, not skips
    # Kernels that cannot load here and were not asked for (the built-ins on a CPU host): their
    # cells read "n/a", the reason on hover, not "skip".
    run_ok("run", "--no-mutants", "--device", "cpu", "--adapter", "test_adapters:Correct", "--cases", "kda_t1",
           "--checks", "golden", code=0, message='"verdict": "PASS"')
    page = (out / "r" / "report.html").read_text()
    assert re.search(r"<td style='background:#eee' title='not available: [^']+'>n/a</td>", page)
    assert ">skip: not available" not in page
    run_ok("run", "--only", "fla.chunk_kda", "--device", "cpu", code=1,
           message="fla.chunk_kda was asked for but is not available")


def test_prop_on_an_unavailable_kernel_fails(gpu_check_here):
    r = gpu_check_here("prop", "--kernel", "test.unloadable", "--adapter", "test_adapters:Unloadable", "--examples", "3")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAIL test.unloadable: not available, nothing was tested" in r.stdout


def test_mutants_that_cannot_run_or_survive_fail(run_ok, out):
    r = run_ok("run", "--no-builtin", "--adapter", "test_adapters:UnrunnableMutant", "--cases", "kda_t1",
               code=1, message="mutant mutant.test_unrunnable could not run: not available: RuntimeError: "
                               "needs a device this host lacks")
    assert "NOT CAUGHT" not in r.stdout
    # A mutant whose load kills its worker: the test fails with the worker's death, never "caught".
    r = run_ok("run", "--no-builtin", "--adapter", "test_adapters:CrashOnLoadMutant", "--cases", "kda_t1",
               code=1, message="FAIL mutant.test_crash_on_load-zoo-caught: the worker process died while running "
                               "this check: Fatal Python error: Aborted")
    assert "caught by" not in r.stdout
    assert "NOT CAUGHT" not in r.stdout
    summary = json.loads((out / "r" / "report.json").read_text())["summary"]
    assert summary["mutants"]["mutant.test_crash_on_load"]["verdict"] == "fail", summary["mutants"]
    assert summary["mutants_caught"] == 0
    run_ok("run", "--no-builtin", "--adapter", "test_adapters:UncaughtMutant", "--cases", "kda_t1,kda_t100",
           code=1, message="mutant mutant.test_no_mistake NOT CAUGHT by any of the 2 checks that ran")
    # libk3gc's mutants on a host without CUDA: could not run, a failure, never "not caught".
    r = run_ok("run", "--only", "mutant.read_ahead", "--device", "cpu", code=1,
               message="mutant mutant.read_ahead could not run: not available: needs a CUDA device")
    assert "NOT CAUGHT" not in r.stdout


def test_skips_of_kernels_nobody_asked_for_pass_and_known_limitations_are_strict(run_ok, out):
    # The built-ins (unavailable here, not asked for) skip; the example runs and passes.
    run_ok("run", "--no-mutants", "--device", "cpu", "--adapter", EXAMPLE, "--cases", "kda_t1",
           "--checks", "golden", code=0, message='"verdict": "PASS"')
    limits = out / "limits.json"
    entry = {"adapter": "test.leaky", "check": "golden", "case": "kda_t100", "reason": "reads q ahead"}
    limits.write_text(json.dumps({"entries": [entry]}))
    # A known failure is an expected failure ...
    run_ok("run", "--no-builtin", "--adapter", "test_adapters:Leaky", "--cases", "kda_t100", "--checks",
           "golden", "--known-limitations", str(limits), code=0, message='"xfailed": 1')
    # JUnit agrees with the exit code: the known failure is a skipped (xfail) case, not a failure.
    suite = ET.parse(out / "r" / "report.xml").getroot().find("testsuite")
    assert (int(suite.get("tests")), int(suite.get("failures")), int(suite.get("errors")),
            int(suite.get("skipped"))) == (1, 0, 0, 1)
    case = suite.find("testcase")
    assert (case.get("name"), case.find("skipped").get("type")) == ("test.leaky-kda_t100-golden", "pytest.xfail")
    assert "reads q ahead" in case.find("skipped").get("message")
    assert case.find("failure") is None
    # ... and the day it passes the run fails until the entry is removed.
    limits.write_text(json.dumps({"entries": [dict(entry, adapter="test.correct")]}))
    run_ok("run", "--no-builtin", "--adapter", "test_adapters:Correct", "--cases", "kda_t100", "--checks",
           "golden", "--known-limitations", str(limits), code=1,
           message="but it passed: the limitation is gone, remove its entry")
    # JUnit agrees: the strict xfail that passed is a failure there too.
    suite = ET.parse(out / "r" / "report.xml").getroot().find("testsuite")
    assert (int(suite.get("tests")), int(suite.get("failures"))) == (1, 1)
    limits.write_text(json.dumps({"entries": [{"adapter": "x", "check": "golden"}]}))
    run_ok("run", "--no-builtin", "--adapter", "test_adapters:Correct", "--known-limitations", str(limits),
           code=2, message="entry 0: missing reason")


def test_the_package_known_limitations_file_is_valid_and_names_real_cases():
    from k3ref import goldens
    from k3ref.gpu_check import collection, problems, shapes

    suite = goldens.load_suite(ROOT / "goldens", ops=("kda.recurrent", "kda.backward", "attnres.full", "attnres.block",
                                                      "attnres.phase1"))
    # golden cases, and the metamorphic checks' configurations (built in, and one per KDA golden)
    names = ({c.name for c in suite} | {c["name"] for c in problems.CONFIGS}
             | {c["name"] for c in shapes.golden_configs(suite)})
    entries = collection.load_limitations()
    assert len(entries) > 0
    for e in entries:
        assert "case" not in e or e["case"] in names, e
        assert "case_pattern" not in e, e


# --------------------------------------------------------------------------- known-limitation names
# Registry entries match names literally; no entry waives a whole kernel or check; the file is
# read under the bounded rules.

def _entries(tmp_path, *entries):
    from k3ref.gpu_check import collection

    p = tmp_path / "limits.json"
    p.write_text(json.dumps({"entries": [dict(reason="r", **e) for e in entries]}))
    return collection.load_limitations(p)


def test_bracketed_and_starred_names_are_literal(tmp_path):
    from k3ref.gpu_check.collection import limitation_for

    e = _entries(tmp_path, {"adapter": "fla.chunk_kda[safe_gate]", "check": "causality"},
                 {"adapter": "*", "check": "golden", "case": "kda_t1"})
    assert limitation_for(e, "fla.chunk_kda[safe_gate]", "causality", "b1_t70", ["b1_t70"]) is not None
    assert limitation_for(e, "fla.chunk_kdas", "causality", "b1_t70", ["b1_t70"]) is None  # '[...]' no class
    assert limitation_for(e, "mykernel", "golden", "kda_t1", ["kda_t1", "kda_t100"]) is None  # '*' no wildcard
    assert limitation_for(e, "*", "golden", "kda_t1", ["kda_t1", "kda_t100"]) is not None


def test_no_entry_waives_a_whole_check(tmp_path):
    from k3ref.gpu_check.collection import limitation_for

    with pytest.raises(ValueError, match="'case' is a literal case name"):
        _entries(tmp_path, {"adapter": "a", "check": "golden", "case": "*"})
    e = _entries(tmp_path, {"adapter": "a", "check": "golden", "case_pattern": "kda_*"})
    with pytest.raises(ValueError, match="matches all 2 cases"):
        limitation_for(e, "a", "golden", "kda_t1", ["kda_t1", "kda_t100"])
    got = limitation_for(e, "a", "golden", "kda_t1", ["kda_t1", "kda_t100", "attnres_full_l8"])
    assert "case_pattern 'kda_*', 2 of 3 cases" in got
    e = _entries(tmp_path, {"adapter": "a", "check": "golden"})
    with pytest.raises(ValueError, match="names no case, but the check has 2 cases"):
        limitation_for(e, "a", "golden", "kda_t1", ["kda_t1", "kda_t100"])


def test_ends_process_is_a_boolean_that_marks_the_entry_it_is_on(tmp_path):
    from k3ref.gpu_check.collection import limitation_entry

    with pytest.raises(ValueError, match="'ends_process' must be true or false"):
        _entries(tmp_path, {"adapter": "a", "check": "golden", "case": "kda_t1", "ends_process": "yes"})
    e = _entries(tmp_path, {"adapter": "a", "check": "golden", "case": "kda_t1", "ends_process": True},
                 {"adapter": "a", "check": "golden", "case": "kda_t100"})
    cases = ["kda_t1", "kda_t100", "kda_b2_t37"]
    assert limitation_entry(e, "a", "golden", "kda_t1", cases)[0]["ends_process"] is True
    assert "ends_process" not in limitation_entry(e, "a", "golden", "kda_t100", cases)[0]
    assert limitation_entry(e, "a", "golden", "kda_b2_t37", cases) is None


def test_a_nan_kernel_is_not_waived_by_a_catch_all_file(tmp_path, gpu_check):
    limits = tmp_path / "limits.json"
    run = ("run", "--no-builtin", "--adapter", "test_adapters:NanEverywhere", "--checks", "golden",
           "--cases", "kda_t1,kda_t100", "--known-limitations", str(limits), "--out", str(tmp_path / "out"))
    limits.write_text(json.dumps({"entries": [{"adapter": "*", "check": "golden", "case_pattern": "*",
                                               "reason": "everything"}]}))
    r = gpu_check(*run)
    assert r.returncode == 1, r.stdout + r.stderr  # '*' names no adapter: nothing waived
    assert json.loads((tmp_path / "out" / "report.json").read_text())["summary"]["failed"] == 2
    limits.write_text(json.dumps({"entries": [{"adapter": "test.nan", "check": "golden", "case_pattern": "*",
                                               "reason": "everything"}]}))
    r = gpu_check(*run)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "may not waive a whole check" in r.stderr


def test_the_file_is_read_under_the_bounded_rules(tmp_path):
    from k3ref.gpu_check import collection

    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        collection.load_limitations(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        collection.load_limitations("/dev/zero")
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(ValueError, match="nested more than 64 deep"):
        collection.load_limitations(deep)
    dup = tmp_path / "dup.json"
    dup.write_text('{"entries": [], "entries": []}')
    with pytest.raises(ValueError, match="duplicate key 'entries'"):
        collection.load_limitations(dup)
    nul = tmp_path / "nul.json"
    nul.write_bytes(b'{"entries": []}\0garbage')
    with pytest.raises(ValueError, match="NUL"):
        collection.load_limitations(nul)
    big = tmp_path / "big.json"
    big.write_text(" " * (2 << 20))
    with pytest.raises(ValueError, match="byte limit"):
        collection.load_limitations(big)


# --------------------------------------------------------------------------- isolation

@pytest.fixture(scope="module")
def crashing_run(tmp_path_factory, gpu_check):
    """One run of test_adapters.Crashing: it aborts on kda_t1, segfaults on
    kda_t64_no_initial_state and hangs on kda_scale_half; kda_t100 and causality are correct."""
    d = tmp_path_factory.mktemp("crashing")
    r = gpu_check("run", "--no-builtin", "--adapter", "test_adapters:Crashing", "--cases",
                  "kda_t1,kda_t64_no_initial_state,kda_scale_half,kda_t100", "--check-timeout", "3", "--out", d)
    rep = json.loads((d / "report.json").read_text())
    by_case = {(x["check"], x["case"]): x for x in rep["results"]}
    return r, rep, by_case, d


def test_abort_segfault_and_hang_each_fail_one_check_and_the_run_goes_on(crashing_run):
    r, rep, by_case, d = crashing_run
    assert r.returncode == 1, r.stdout + r.stderr
    abort, segv, hang = (by_case[("golden", c)] for c in ("kda_t1", "kda_t64_no_initial_state", "kda_scale_half"))
    assert abort["status"] == segv["status"] == hang["status"] == "error"
    # The one-line reason says how it died and where (what it printed last: below).
    assert abort["reason"].startswith("the worker process died while running this check: "), abort["reason"]
    assert "Fatal Python error: Aborted; innermost frame: File " in abort["reason"], abort["reason"]
    assert segv["reason"].startswith("the worker process died while running this check: Fatal Python error: "
                                     "Segmentation fault; innermost frame: File "), segv["reason"]
    assert hang["reason"].startswith("timed out: the check ran past its limit of 3 s"), hang["reason"]
    for res in (abort, segv):  # the last lines of the worker's stderr: faulthandler's stacks (see below)
        assert '  File "' in res["extra"]["stderr_tail"], res["extra"]["stderr_tail"]
    # Every other check ran after the crashes and passed; the whole report was written.
    assert by_case[("golden", "kda_t100")]["status"] == "pass"
    assert by_case[("causality", "generic_k100")]["status"] == "pass"
    assert len(by_case) == 5
    assert rep["summary"]["executed"] == 5
    assert (rep["summary"]["failed"], rep["summary"]["passed"]) == (3, 2)
    for case in ("kda_t1", "kda_t64_no_initial_state", "kda_scale_half"):
        assert f"FAIL test.crashing-{case}-golden: " in r.stdout
    html = (d / "report.html").read_text()
    assert html.index("FAIL") < html.index("kernels x checks")  # the verdict comes first
    assert "Fatal Python error: Segmentation fault" in html
    # JUnit agrees: three failures, two passes.
    suite = ET.parse(d / "report.xml").getroot().find("testsuite")
    assert (int(suite.get("tests")), int(suite.get("failures")) + int(suite.get("errors"))) == (5, 3)
    t = rep["summary"]["kernels"]["test.crashing"]["timing"]
    assert t["compile_s"] == 0.0
    assert "absent" in t["compile_timing"]


def test_a_crash_s_reason_carries_what_the_kernel_printed_last(crashing_run):
    r, rep, by_case, d = crashing_run
    # test_adapters.Crashing prints a C++ assertion's message to stderr, then aborts.
    assert by_case[("golden", "kda_t1")]["reason"].startswith(
        "the worker process died while running this check: copy_traits_sm90_tma.hpp:949: make_tma_copy_desc: "
        "Assertion `aligned' failed.; Fatal Python error: Aborted; innermost frame: File "), \
        by_case[("golden", "kda_t1")]["reason"]


def test_a_crash_s_reason_names_the_frame_where_it_died(crashing_run):
    # The innermost frame of the thread that crashed (not of pytest-xdist's reader thread):
    # os.abort() is called in test_adapters.py, the segfault happens inside ctypes.string_at.
    r, rep, by_case, d = crashing_run
    abort = by_case[("golden", "kda_t1")]["reason"]
    assert f'innermost frame: File "{HERE / "test_adapters.py"}", line ' in abort, abort
    segv = by_case[("golden", "kda_t64_no_initial_state")]["reason"]
    assert "innermost frame: File " in segv and "ctypes" in segv and segv.endswith(" in string_at"), segv


def test_every_worker_that_loaded_the_kernel_is_counted(crashing_run):
    r, rep, by_case, d = crashing_run
    # One worker for the group, plus one after each of the three deaths.
    assert rep["summary"]["kernels"]["test.crashing"]["timing"]["children_started"] == 4


def test_a_run_inside_a_pytest_session_finds_the_package_on_its_pythonpath(tmp_path, run_pytest):
    # A project's own test suite that runs the harness (as these tests do), with k3ref on
    # pytest.ini's pythonpath and not on PYTHONPATH.
    (tmp_path / "pytest.ini").write_text(f"[pytest]\npythonpath = {ROOT / 'python'} {HERE}\n")
    (tmp_path / "test_embedded.py").write_text(
        "from k3ref.gpu_check import cli\n"
        "def test_run(tmp_path):\n"
        "    assert cli.main(['run', '--no-builtin', '--adapter', 'test_adapters:Correct', '--cases', 'kda_t1', "
        "'--checks', 'golden', '--device', 'cpu', '--out', str(tmp_path / 'r')]) == 0\n")
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.pop("PYTEST_ADDOPTS", None)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_embedded.py"], env=env,
                       cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "1 passed" in r.stdout


# --------------------------------------------------------------------------- the pytest plugin

def test_example_adapter_runs_on_every_golden_it_supports(tmp_path, run_pytest):
    r = run_pytest("--k3ref-adapter", EXAMPLE, "--junitxml", "j.xml", "-q", cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # 23 log-decay goldens and 7 metamorphic checks pass; the 27 goldens with other gates skip.
    assert "30 passed, 27 skipped" in r.stdout
    cases = list(ET.parse(tmp_path / "j.xml").getroot().iter("testcase"))
    names = {c.get("name") for c in cases}
    assert len(cases) == len(names) == 57
    assert "example.torch_kda-kda_varlen_gva-golden" in names
    assert "example.torch_kda-generic_k100-causality" in names
    assert {c.get("classname") for c in cases} == {"k3ref.example.torch_kda"}


def test_conftest_registration_k_selection_x_and_xdist(tmp_path, run_pytest):
    (tmp_path / "conftest.py").write_text(f"k3ref_adapters = [{EXAMPLE!r}, 'test_adapters:Leaky']\n")
    r = run_pytest("-q", "-k", "kda_t100 and golden", "-n", "2", cwd=tmp_path)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "1 failed, 1 passed" in r.stdout
    assert "FAILED k3ref/test.leaky::test.leaky-kda_t100-golden" in r.stdout
    r = run_pytest("-q", "-x", "-k", "test.leaky and golden", "-p", "no:randomly", cwd=tmp_path)
    assert "1 failed" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    assert "stopping after 1 failures" in r.stdout


def test_plugin_fails_closed(tmp_path, run_pytest):
    d = tmp_path
    r = run_pytest("-q", "--k3ref-adapter", "test_adapters:SupportsNothing", cwd=d)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAIL: no check was executed (every test was skipped or nothing was collected)" in r.stdout
    r = run_pytest("-q", "--k3ref-adapter", "test_adapters:Unloadable", "-k", "kda_t1-", cwd=d)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "asked for but is not available" in r.stdout
    limits = d / "limits.json"
    limits.write_text(json.dumps({"entries": [
        {"adapter": "test.leaky", "check": "golden", "case": "kda_t100", "reason": "reads q ahead"},
        {"adapter": "test.correct", "check": "golden", "case": "kda_t100", "reason": "fixed upstream"}]}))
    r = run_pytest("-q", "-rxX", "--k3ref-adapter", "test_adapters:Leaky", "--k3ref-adapter",
                   "test_adapters:Correct", "--k3ref-known-limitations", str(limits), "-k", "kda_t100-golden", cwd=d)
    assert r.returncode == 1, r.stdout + r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert "1 failed," in last  # strict: an entry that passes fails the session
    assert " 1 xfailed" in last
    assert "passed" not in last
    assert "[XPASS(strict)] known limitation: fixed upstream" in r.stdout
    r = run_pytest("-q", "--k3ref-adapter", "nope:Nope", cwd=d)
    assert r.returncode == 4, r.stdout + r.stderr
    assert "cannot import nope" in r.stderr


def test_entry_point_registration(tmp_path, child_env):
    dist = tmp_path / "my_kernels-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-kernels\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[k3ref.adapters]\nmine = test_adapters:Leaky\n")
    env = child_env()
    env["PYTHONPATH"] += os.pathsep + str(tmp_path)
    r = subprocess.run([sys.executable, "-m", "k3ref.gpu_check", "run", "--list", "--checks", "golden",
                        "--cases", "kda_t1"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    words = r.stdout.split()
    assert "k3ref/test.leaky::test.leaky-kda_t1-golden" in words
    assert "k3ref/fla.chunk_kda::fla.chunk_kda-kda_t1-golden" in words  # the built-ins, by their entry point
    # an isolation group's brackets are spelled as parentheses in the node id
    assert "k3ref/fla.chunk_kda(safe_gate)::fla.chunk_kda[safe_gate]-kda_t1-golden" in words
