#!/usr/bin/env python3
"""The harness's verdicts fail closed, its checks run isolated, and the pytest plugin collects
one test per adapter x case x check (python3 -m k3ref.gpu_check, k3ref.pytest_plugin), on
the CPU with pure-PyTorch kernels (tests/gpu_check/test_adapters.py, examples/).

Each rule of the verdict is shown by a run that must exit non-zero with its one-line reason:
nothing executed, a kernel asked for that cannot be loaded, an unknown name in --only,
--checks, --cases, --kernel or --adapter, prop on an unavailable kernel, a mutant that could
not run, a mutant not caught, a known limitation that passes. A skip of a kernel nobody asked
for is a pass. An abort, a segfault and a hang each become that check's failure while the
run goes on and writes its report.
Usage: fail_closed_test.py SOURCE_ROOT   (exit 77 = skipped: no torch or pytest)"""
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import unittest
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else Path(__file__).resolve().parents[2]
try:
    import pytest  # noqa: F401
    import torch  # noqa: F401
except ImportError as e:
    print(f"{e}: skipped")
    sys.exit(77)

HERE = ROOT / "tests" / "gpu_check"
EXAMPLE = f"{ROOT / 'examples' / 'torch_kda_adapter.py'}:TorchKda"
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), str(HERE)]))
ENV.pop("PYTEST_ADDOPTS", None)


sys.path[:0] = [str(ROOT / "python"), str(HERE)]
from k3ref.gpu_check import cli  # noqa: E402


class Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def gpu_check_here(*args):
    """`python3 -m k3ref.gpu_check ARGS` in this process (the checks still run in children)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(args))
    return Result(code, out.getvalue(), err.getvalue())


def gpu_check(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "k3ref.gpu_check", *args], env=ENV, cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def pytest_run(*args, cwd):
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "k3ref.pytest_plugin", "-p", "no:cacheprovider",
                           *args], env=ENV, cwd=cwd, capture_output=True, text=True, timeout=300)


class FailClosed(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.out = Path(self.dir.name)

    def tearDown(self):
        self.dir.cleanup()

    def run_ok(self, *args, code, message):
        r = gpu_check_here(*args, "--out", str(self.out / "r"))
        self.assertEqual(r.returncode, code, r.stdout[-3000:] + r.stderr[-3000:])
        self.assertIn(message, r.stdout + r.stderr)
        return r

    def test_unknown_names_in_selectors_are_usage_errors(self):
        for args, message in (
                (["--only", "no.such_kernel"], "--only: no kernel named 'no.such_kernel'"),
                (["--checks", "golden,no_such_check"], "--checks: no check named 'no_such_check'"),
                (["--cases", "kda_t1,no_such_case"], "--cases: no golden case named 'no_such_case'"),
                (["--adapter", "no_such_module:Kernel"], "cannot import no_such_module"),
                (["--adapter", "test_adapters:NoSuchClass"], "has no attribute 'NoSuchClass'"),
                (["--adapter", "test_adapters:UnknownPolicy"], "unknown tolerance policy 'no-such-policy'")):
            with self.subTest(args=args):
                r = self.run_ok("run", "--no-builtin", "--adapter", "test_adapters:Correct", *args, code=2,
                                message=message)
                self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)  # one line
        r = gpu_check_here("prop", "--kernel", "no.such_kernel")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("no kernel named 'no.such_kernel'", r.stderr)

    def test_a_run_that_executes_no_check_fails(self):
        self.run_ok("run", "--no-builtin", "--adapter", "test_adapters:SupportsNothing", code=1,
                    message="no check was executed")
        # Every built-in unavailable on this CPU host and not asked for: all skipped, and the
        # run fails because nothing was verified, not because of the skips.
        r = self.run_ok("run", "--no-mutants", "--device", "cpu", code=1, message="no check was executed")
        self.assertNotIn("asked for", r.stdout)

    def test_a_kernel_asked_for_that_cannot_be_loaded_fails(self):
        self.run_ok("run", "--no-builtin", "--adapter", "test_adapters:Unloadable", "--cases", "kda_t1", code=1,
                    message="test.unloadable was asked for but is not available: ImportError: No module named "
                            "'not_installed_kernel'")
        failures = ET.parse(self.out / "r" / "report.xml").getroot().findall("testsuite/testcase/failure")
        self.assertEqual(len(failures), 8)  # the golden and the 7 other checks: failures in JUnit too, not skips
        # Kernels that cannot load here and were not asked for (the built-ins on a CPU host): their
        # cells read "n/a", the reason on hover, not "skip".
        self.run_ok("run", "--no-mutants", "--device", "cpu", "--adapter", "test_adapters:Correct", "--cases", "kda_t1",
                    "--checks", "golden", code=0, message='"verdict": "PASS"')
        page = (self.out / "r" / "report.html").read_text()
        self.assertRegex(page, r"<td style='background:#eee' title='not available: [^']+'>n/a</td>")
        self.assertNotIn(">skip: not available", page)
        self.run_ok("run", "--only", "fla.chunk_kda", "--device", "cpu", code=1,
                    message="fla.chunk_kda was asked for but is not available")

    def test_prop_on_an_unavailable_kernel_fails(self):
        r = gpu_check_here("prop", "--kernel", "test.unloadable", "--adapter", "test_adapters:Unloadable", "--examples",
                           "3")
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn("FAIL test.unloadable: not available, nothing was tested", r.stdout)

    def test_mutants_that_cannot_run_or_survive_fail(self):
        r = self.run_ok("run", "--no-builtin", "--adapter", "test_adapters:UnrunnableMutant", "--cases", "kda_t1",
                        code=1, message="mutant mutant.test_unrunnable could not run: not available: RuntimeError: "
                                        "needs a device this host lacks")
        self.assertNotIn("NOT CAUGHT", r.stdout)
        r = self.run_ok("run", "--no-builtin", "--adapter", "test_adapters:CrashOnLoadMutant", "--cases", "kda_t1",
                        code=1, message="mutant mutant.test_crash_on_load could not run: could not load the kernel: "
                                        "the child process killed by SIGABRT while loading the adapter")
        self.assertNotIn("caught by", r.stdout)
        self.run_ok("run", "--no-builtin", "--adapter", "test_adapters:UncaughtMutant", "--cases", "kda_t1,kda_t100",
                    code=1, message="mutant mutant.test_no_mistake NOT CAUGHT by any of the 2 checks that ran")
        # libk3gc's mutants on a host without CUDA: could not run, a failure, never "not caught".
        r = self.run_ok("run", "--only", "mutant.read_ahead", "--device", "cpu", code=1,
                        message="mutant mutant.read_ahead could not run: not available: needs a CUDA device")
        self.assertNotIn("NOT CAUGHT", r.stdout)

    def test_skips_of_kernels_nobody_asked_for_pass_and_known_limitations_are_strict(self):
        # The built-ins (unavailable here, not asked for) skip; the example runs and passes.
        self.run_ok("run", "--no-mutants", "--device", "cpu", "--adapter", EXAMPLE, "--cases", "kda_t1",
                    "--checks", "golden", code=0, message='"verdict": "PASS"')
        limits = self.out / "limits.json"
        entry = {"adapter": "test.leaky", "check": "golden", "case": "kda_t100", "reason": "reads q ahead"}
        limits.write_text(json.dumps({"entries": [entry]}))
        # A known failure is an expected failure ...
        self.run_ok("run", "--no-builtin", "--adapter", "test_adapters:Leaky", "--cases", "kda_t100", "--checks",
                    "golden", "--known-limitations", str(limits), code=0, message='"xfailed": 1')
        # JUnit agrees with the exit code: the known failure is a skipped (xfail) case, not a failure.
        case = ET.parse(self.out / "r" / "report.xml").getroot().find("testsuite/testcase")
        self.assertEqual((case.get("name"), case.find("skipped").get("type")), ("test.leaky-kda_t100-golden", "xfail"))
        self.assertIsNone(case.find("failure"))
        # ... and the day it passes the run fails until the entry is removed.
        limits.write_text(json.dumps({"entries": [dict(entry, adapter="test.correct")]}))
        self.run_ok("run", "--no-builtin", "--adapter", "test_adapters:Correct", "--cases", "kda_t100", "--checks",
                    "golden", "--known-limitations", str(limits), code=1,
                    message="but it passed: the limitation is gone, remove its entry")
        limits.write_text(json.dumps({"entries": [{"adapter": "x", "check": "golden"}]}))
        self.run_ok("run", "--no-builtin", "--adapter", "test_adapters:Correct", "--known-limitations", str(limits),
                    code=2, message="entry 0: missing reason")

    def test_the_package_known_limitations_file_is_valid_and_names_real_cases(self):
        from k3ref import goldens
        from k3ref.gpu_check import collection

        names = {c.name for c in goldens.load_suite(ROOT / "goldens", ops=("kda.recurrent", "attnres.full",
                                                                           "attnres.block", "attnres.phase1"))}
        entries = collection.load_limitations()
        self.assertGreater(len(entries), 0)
        for e in entries:
            self.assertTrue("case" not in e or e["case"] in names, e)
            self.assertNotIn("case_pattern", e)


class KnownLimitationNames(unittest.TestCase):
    """Registry entries match names literally; no entry waives a whole kernel or check; the
    file is read under the bounded rules."""

    def entries(self, *entries):
        with tempfile.TemporaryDirectory() as d:
            p = Path(d) / "limits.json"
            p.write_text(json.dumps({"entries": [dict(reason="r", **e) for e in entries]}))
            from k3ref.gpu_check import collection
            return collection.load_limitations(p)

    def test_bracketed_and_starred_names_are_literal(self):
        from k3ref.gpu_check.collection import limitation_for
        e = self.entries({"adapter": "fla.chunk_kda[safe_gate]", "check": "causality"},
                         {"adapter": "*", "check": "golden", "case": "kda_t1"})
        self.assertIsNotNone(limitation_for(e, "fla.chunk_kda[safe_gate]", "causality", "b1_t70", ["b1_t70"]))
        self.assertIsNone(limitation_for(e, "fla.chunk_kdas", "causality", "b1_t70", ["b1_t70"]))  # '[...]' no class
        self.assertIsNone(limitation_for(e, "mykernel", "golden", "kda_t1", ["kda_t1", "kda_t100"]))  # '*' no wildcard
        self.assertIsNotNone(limitation_for(e, "*", "golden", "kda_t1", ["kda_t1", "kda_t100"]))

    def test_no_entry_waives_a_whole_check(self):
        from k3ref.gpu_check.collection import limitation_for
        with self.assertRaisesRegex(ValueError, "'case' is a literal case name"):
            self.entries({"adapter": "a", "check": "golden", "case": "*"})
        e = self.entries({"adapter": "a", "check": "golden", "case_pattern": "kda_*"})
        with self.assertRaisesRegex(ValueError, "matches all 2 cases"):
            limitation_for(e, "a", "golden", "kda_t1", ["kda_t1", "kda_t100"])
        got = limitation_for(e, "a", "golden", "kda_t1", ["kda_t1", "kda_t100", "attnres_full_l8"])
        self.assertIn("case_pattern 'kda_*', 2 of 3 cases", got)
        e = self.entries({"adapter": "a", "check": "golden"})
        with self.assertRaisesRegex(ValueError, "names no case, but the check has 2 cases"):
            limitation_for(e, "a", "golden", "kda_t1", ["kda_t1", "kda_t100"])

    def test_a_nan_kernel_is_not_waived_by_a_catch_all_file(self):
        with tempfile.TemporaryDirectory() as d:
            limits = Path(d) / "limits.json"
            run = ("run", "--no-builtin", "--adapter", "test_adapters:NanEverywhere", "--checks", "golden",
                   "--cases", "kda_t1,kda_t100", "--known-limitations", str(limits), "--out", str(Path(d) / "out"))
            limits.write_text(json.dumps({"entries": [{"adapter": "*", "check": "golden", "case_pattern": "*",
                                                       "reason": "everything"}]}))
            r = gpu_check(*run)
            self.assertEqual(r.returncode, 1, r.stdout + r.stderr)  # '*' names no adapter: nothing waived
            limits.write_text(json.dumps({"entries": [{"adapter": "test.nan", "check": "golden", "case_pattern": "*",
                                                       "reason": "everything"}]}))
            r = gpu_check(*run)
            self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
            self.assertIn("may not waive a whole check", r.stderr)

    def test_the_file_is_read_under_the_bounded_rules(self):
        from k3ref.gpu_check import collection
        with tempfile.TemporaryDirectory() as d:
            fifo = Path(d) / "fifo.json"
            os.mkfifo(fifo)
            with self.assertRaisesRegex(ValueError, "not a regular file"):
                collection.load_limitations(fifo)
            with self.assertRaisesRegex(ValueError, "not a regular file"):
                collection.load_limitations("/dev/zero")
            deep = Path(d) / "deep.json"
            deep.write_text("[" * 100000 + "]" * 100000)
            with self.assertRaisesRegex(ValueError, "nested more than 64 deep"):
                collection.load_limitations(deep)
            dup = Path(d) / "dup.json"
            dup.write_text('{"entries": [], "entries": []}')
            with self.assertRaisesRegex(ValueError, "duplicate key 'entries'"):
                collection.load_limitations(dup)
            nul = Path(d) / "nul.json"
            nul.write_bytes(b'{"entries": []}\0garbage')
            with self.assertRaisesRegex(ValueError, "NUL"):
                collection.load_limitations(nul)
            big = Path(d) / "big.json"
            big.write_text(" " * (2 << 20))
            with self.assertRaisesRegex(ValueError, "byte limit"):
                collection.load_limitations(big)


class Isolation(unittest.TestCase):
    def test_abort_segfault_and_hang_each_fail_one_check_and_the_run_goes_on(self):
        with tempfile.TemporaryDirectory() as d:
            r = gpu_check("run", "--no-builtin", "--adapter", "test_adapters:Crashing", "--cases",
                          "kda_t1,kda_t64_no_initial_state,kda_scale_half,kda_t100", "--check-timeout", "3",
                          "--out", d)
            self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
            rep = json.loads((Path(d) / "report.json").read_text())
            by_case = {(x["check"], x["case"]): x for x in rep["results"]}
            self.assertIn("killed by SIGABRT", by_case[("golden", "kda_t1")]["reason"])
            # The one-line reason carries what the child printed last (a C++ assertion) and where it died.
            self.assertIn("make_tma_copy_desc: Assertion `aligned' failed.; Fatal Python error: Aborted; innermost "
                          "frame: File", by_case[("golden", "kda_t1")]["reason"])
            self.assertIn("killed by SIGSEGV", by_case[("golden", "kda_t64_no_initial_state")]["reason"])
            self.assertIn("no answer within 3 s", by_case[("golden", "kda_scale_half")]["reason"])
            for key in (("golden", "kda_t1"), ("golden", "kda_t64_no_initial_state")):
                self.assertIn("Current thread", by_case[key]["extra"]["stderr_tail"])  # the last lines of stderr
            # Every other check ran after the crashes and passed; the whole report was written.
            self.assertEqual(by_case[("golden", "kda_t100")]["status"], "pass")
            self.assertEqual(by_case[("causality", "generic_k100")]["status"], "pass")
            self.assertEqual(rep["summary"]["executed"], 5)
            html = (Path(d) / "report.html").read_text()
            self.assertLess(html.index("FAIL"), html.index("kernels x checks"))  # the verdict comes first
            self.assertIn("killed by SIGSEGV", html)
            t = rep["summary"]["kernels"]["test.crashing"]["timing"]
            # One child for the group, plus one after each of the three deaths.
            self.assertEqual(t["children_started"], 4)
            self.assertEqual(t["compile_s"], 0.0)
            self.assertIn("absent", t["compile_timing"])


class Plugin(unittest.TestCase):
    def test_example_adapter_runs_on_every_golden_it_supports(self):
        with tempfile.TemporaryDirectory() as d:
            r = pytest_run("--k3ref-adapter", EXAMPLE, "--junitxml", "j.xml", "-q", cwd=d)
            self.assertEqual(r.returncode, 0, r.stdout[-3000:] + r.stderr[-3000:])
            # 23 log-decay goldens and 7 metamorphic checks pass; the 7 goldens with other gates skip.
            self.assertIn("30 passed, 7 skipped", r.stdout)
            cases = ET.parse(Path(d) / "j.xml").getroot().iter("testcase")
            names = {c.get("name") for c in cases}
            self.assertEqual(len(names), 37)
            self.assertIn("example.torch_kda-kda_varlen_gva-golden", names)
            self.assertIn("example.torch_kda-generic_k100-causality", names)

    def test_conftest_registration_k_selection_x_and_xdist(self):
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "conftest.py").write_text(f"k3ref_adapters = [{EXAMPLE!r}, 'test_adapters:Leaky']\n")
            r = pytest_run("-q", "-k", "kda_t100 and golden", "-n", "2", cwd=d)
            self.assertEqual(r.returncode, 1, r.stdout[-3000:] + r.stderr[-3000:])
            self.assertIn("1 failed, 1 passed", r.stdout)
            self.assertIn("FAILED k3ref::test.leaky-kda_t100-golden", r.stdout)
            r = pytest_run("-q", "-x", "-k", "test.leaky and golden", "-p", "no:randomly", cwd=d)
            self.assertIn("1 failed", r.stdout)
            self.assertIn("stopping after 1 failures", r.stdout)

    def test_plugin_fails_closed(self):
        with tempfile.TemporaryDirectory() as d:
            r = pytest_run("-q", "--k3ref-adapter", "test_adapters:SupportsNothing", cwd=d)
            self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
            self.assertIn("none executed a check", r.stdout)
            r = pytest_run("-q", "--k3ref-adapter", "test_adapters:Unloadable", "-k", "kda_t1-", cwd=d)
            self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
            self.assertIn("asked for but is not available", r.stdout)
            limits = Path(d) / "limits.json"
            limits.write_text(json.dumps({"entries": [
                {"adapter": "test.leaky", "check": "golden", "case": "kda_t100", "reason": "reads q ahead"},
                {"adapter": "test.correct", "check": "golden", "case": "kda_t100", "reason": "fixed upstream"}]}))
            r = pytest_run("-q", "-rxX", "--k3ref-adapter", "test_adapters:Leaky", "--k3ref-adapter",
                           "test_adapters:Correct", "--k3ref-known-limitations", str(limits), "-k", "kda_t100-golden",
                           cwd=d)
            self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
            last = r.stdout.strip().splitlines()[-1]
            self.assertIn("1 failed,", last)  # strict: an entry that passes fails the session
            self.assertIn(" 1 xfailed", last)
            self.assertNotIn("passed", last)
            self.assertIn("[XPASS(strict)] known limitation: fixed upstream", r.stdout)
            r = pytest_run("-q", "--k3ref-adapter", "nope:Nope", cwd=d)
            self.assertEqual(r.returncode, 4, r.stdout + r.stderr)
            self.assertIn("cannot import nope", r.stderr)

    def test_entry_point_registration(self):
        with tempfile.TemporaryDirectory() as d:
            dist = Path(d) / "my_kernels-1.0.dist-info"
            dist.mkdir()
            (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-kernels\nVersion: 1.0\n")
            (dist / "entry_points.txt").write_text("[k3ref.adapters]\nmine = test_adapters:Leaky\n")
            env = dict(ENV, PYTHONPATH=ENV["PYTHONPATH"] + os.pathsep + d)
            r = subprocess.run([sys.executable, "-m", "k3ref.gpu_check", "run", "--list", "--checks", "golden",
                                "--cases", "kda_t1"], env=env, capture_output=True, text=True, timeout=120)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("test.leaky-kda_t1-golden", r.stdout.split())
            self.assertIn("fla.chunk_kda-kda_t1-golden", r.stdout.split())  # the built-ins, by their entry point


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]], verbosity=1)
