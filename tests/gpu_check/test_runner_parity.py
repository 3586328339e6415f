"""The runner on pytest gives the verdicts and figures the runner before it gave.

data/cpu_parity.json was recorded from the harness's own runner (commit 57806f9, before the
move onto pytest-xdist) on the CPU: the example adapter, the torch test kernels and their
mutants, and the context-parallel kernel and its mutants at P = 2 and 4 over gloo. This runs
today's runner on the same adapters and goldens and asserts the same verdict for every test
and the same status, ratio and figures (to 12 significant digits) for every check.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("xdist")

import parity  # noqa: E402  (tests/gpu_check, on the path of this directory's pytest.ini or conftest)
from k3ref.gpu_check.references import _module  # noqa: E402

# The runs judge against k3ref's compiled references (the CP cases, the carried-state error):
# an instrumented build does not build k3ref._core.
pytestmark = pytest.mark.skipif(_module() is None, reason="k3ref._core not built (K3REF_CORE_PATH)")

ROOT = Path(__file__).resolve().parents[2]


def test_verdicts_and_figures_equal_the_runner_before(tmp_path):
    out = tmp_path / "r"
    before = json.loads((Path(__file__).with_name("data") / "cpu_parity.json").read_text())
    # The same inputs: the goldens the record ran (goldens added since are outside it).
    recorded = sorted({key.split("|")[2] for key in before["results"]} & {p.stem for p in (ROOT / "goldens").glob("*.safetensors")})
    # The checks the record had (checks added since, such as the backward check, are outside it).
    checks = sorted({key.split("|")[1] for key in before["results"]})
    cmd = [sys.executable, "-m", "k3ref.gpu_check", "run", "--no-builtin", "--goldens", str(ROOT / "goldens"),
           "--device", "cpu", "--no-warmup", "--check-jobs", "2", "--cases", ",".join(recorded),
           "--checks", ",".join(checks), "--out", str(out)]
    for spec in parity.ADAPTER_SPECS:
        cmd += ["--adapter", spec]
    for setting in parity.CP_SETTINGS:
        cmd += ["--set", setting]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    now = parity.snapshot(out)
    assert now["verdicts"] == before["verdicts"]
    assert now["results"] == before["results"]
    assert len(now["results"]) == 175 and sum(v == "pass" for v in now["verdicts"].values()) == 81
