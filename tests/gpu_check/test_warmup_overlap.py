"""The warm-up runs beside the checks: the planning child writes the plan and then compiles,
the workers start at once; a kernel with nothing to compile is checked while the warm-up is
still compiling another's shapes, and a kernel's tests wait until its own units are compiled.
Two CPU stand-ins (one declared as compiled by Triton, whose warm-up unit takes a few seconds)
log the wall-clock time of each call; the run goes through `python -m k3ref.gpu_check run`.
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("xdist")
pytest.importorskip("pytest_timeout")

ROOT = Path(__file__).resolve().parents[2]
WARMUP_SECONDS = 6.0

KERNELS = textwrap.dedent(f"""\
    import json, os, sys, time
    from k3ref.gpu_check.adapters import TorchKernelAdapter

    def log(event):
        with open(os.environ["OVERLAP_LOG"], "a") as f:
            f.write(json.dumps({{"event": event, "t": time.time()}}) + "\\n")

    class Compiled(TorchKernelAdapter):
        compiler = "triton"
        def __init__(self):
            super().__init__()
            self.name = "overlap.compiled"
        def run(self, inputs, params, out=None):
            # the warm-up's worker process runs k3ref.gpu_check.warmup_worker --serve
            if "k3ref.gpu_check.warmup_worker" in " ".join(sys.argv) or sys.modules["__main__"].__spec__ and \\
                    sys.modules["__main__"].__spec__.name == "k3ref.gpu_check.warmup_worker":
                log("warmup start")
                time.sleep({WARMUP_SECONDS})
                log("warmup end")
            else:
                log("compiled check")
            return super().run(inputs, params)

    class Ahead(TorchKernelAdapter):
        def __init__(self):
            super().__init__()
            self.name = "overlap.ahead"
        def run(self, inputs, params, out=None):
            log("ahead check")
            return super().run(inputs, params)

    adapters = [Compiled(), Ahead()]
    """)


def test_checks_of_other_kernels_run_while_the_warm_up_compiles(tmp_path):
    module = tmp_path / "overlap_kernels.py"
    module.write_text(KERNELS)
    log = tmp_path / "log.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"), OVERLAP_LOG=str(log))
    cmd = [sys.executable, "-m", "k3ref.gpu_check", "run", "--no-builtin", "--adapter", f"{module}:adapters",
           "--goldens", str(ROOT / "goldens"), "--device", "cpu", "--checks", "golden", "--cases", "kda_t1,kda_b2_t37",
           "--check-jobs", "2", "--jobs", "1", "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "r")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    events = [json.loads(line) for line in log.read_text().splitlines()]
    times = {}
    for e in events:
        times.setdefault(e["event"], []).append(e["t"])
    # one unit per shape group: the two cases' shapes (H, K, V differ), one after the other (--jobs 1)
    assert len(times["warmup start"]) == 2 and len(times["warmup end"]) == 2, events
    warm_end = max(times["warmup end"])
    # the kernel built ahead of time was checked before the warm-up ended...
    assert len(times["ahead check"]) == 2 and min(times["ahead check"]) < warm_end, (events, proc.stdout[-2000:])
    # ...and the compiled kernel only after its units were compiled
    assert len(times["compiled check"]) == 2 and min(times["compiled check"]) > warm_end, events
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    warm = report["summary"]["warmup"]
    assert warm["errors"] == 0 and [g["status"] for g in warm["groups"]] == ["ok", "ok"], warm
    assert report["summary"]["verdict"] == "PASS"
