"""The package installs as docs/python.md says, and the installed copy works.

1. `pip install --no-build-isolation .` into a fresh `python3 -m venv --system-site-packages`
   venv (the documented command), then, from another directory and without PYTHONPATH:
   `import k3ref` resolves into the venv, a reference reproduces a golden bit for bit, the
   harness imports, the pytest11 entry point and the k3ref-gpu-check script are installed,
   the golden suite ships with it (found with no variable or option), and `pytest
   --k3ref-adapter` (the installed plugin) runs the example adapter on it on the CPU.
2. `meson install --destdir` of this build (K3REF_BUILD_ROOT): k3ref lands in a directory of
   /usr/bin/python3's own sys.path (under DESTDIR), and imports from there.
The pip build time is printed (the package build compiles only the extension and the seven
library objects it links)."""
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = os.environ.get("K3REF_BUILD_ROOT")
PY = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable

CHECK = r"""
import sys, torch
import k3ref
from k3ref import goldens
assert k3ref.__file__.startswith(sys.argv[1]), (k3ref.__file__, sys.argv[1])
installed = sys.argv[2] == "installed"  # the suite that ships with the package, found without a variable
case = goldens.load_case("kda_gate_lower_bound", None if installed else sys.argv[2])
if installed:
    assert str(goldens.directory()).startswith(sys.argv[1]), goldens.directory()
out = k3ref.kda(case.inputs, precision="mp256", **case.options)
assert all(torch.equal(out[n], case.expected[n]) for n in case.expected)
from k3ref import policy
assert str(policy.table_path()).startswith(sys.argv[1]), policy.table_path()
from k3ref import kernel_domains
assert str(kernel_domains.path()).startswith(sys.argv[1]), kernel_domains.path()
import k3ref.gpu_check, k3ref.gpu_check.adapters, k3ref.testing  # the built-in adapters read their domains at import
print("ok", k3ref.__file__)
"""


def clean_env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "K3REF_CORE_PATH", "PYTHONHOME", "K3REF_GOLDENS")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def test_pip_install_into_a_venv(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([PY, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    start = time.monotonic()
    r = subprocess.run([str(venv / "bin" / "pip"), "install", "--no-build-isolation", "--no-index", str(ROOT)],
                       cwd=tmp_path, env=clean_env(), capture_output=True, text=True)
    seconds = time.monotonic() - start
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    print(f"\npip install --no-build-isolation . took {seconds:.0f} s")
    site = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['platlib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    r = subprocess.run([str(venv / "bin" / "python"), "-c", CHECK, site, "installed"],
                       cwd=tmp_path, env=clean_env(), capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr
    entry = next(Path(site).glob("k3ref-*.dist-info")) / "entry_points.txt"
    text = entry.read_text()
    assert "[pytest11]\nk3ref.pytest_plugin = k3ref.pytest_plugin" in text
    assert "k3ref-gpu-check = k3ref.gpu_check.cli:main" in text
    assert (venv / "bin" / "k3ref-gpu-check").is_file()
    r = subprocess.run([str(venv / "bin" / "python"), "-c", "import importlib.metadata as m, k3ref; "
                        "assert m.version('k3ref') == k3ref.__version__, (m.version('k3ref'), k3ref.__version__)"],
                       cwd=tmp_path, env=clean_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    # The installed plugin: the example adapter against the installed goldens (no --k3ref-goldens, no
    # K3REF_GOLDENS), on the CPU; `-p k3ref.pytest_plugin` as a source tree needs it changes nothing.
    r = subprocess.run([str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                        "k3ref.pytest_plugin", "--k3ref-adapter", f"{ROOT}/examples/torch_kda_adapter.py:TorchKda",
                        "--k3ref-device", "cpu"],
                       cwd=tmp_path, env=clean_env(), capture_output=True, text=True)
    summary = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr
    assert r.returncode == 0 and " passed" in summary and "failed" not in summary, r.stdout[-3000:] + r.stderr[-2000:]
    print(f"pytest --k3ref-adapter (installed plugin): {summary}")
    # Only the package: no library, command or headers in the venv.
    assert not list(venv.rglob("libk3ref*")) and not (venv / "bin" / "k3ref").exists()
    assert not (venv / "include" / "k3ref").exists()


@pytest.mark.skipif(not BUILD, reason="K3REF_BUILD_ROOT (a meson build directory) not set")
def test_meson_install_puts_the_package_on_the_interpreters_path(tmp_path):
    dest = tmp_path / "dest"
    r = subprocess.run(["meson", "install", "-C", BUILD, "--destdir", str(dest), "--no-rebuild", "--quiet"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    inits = list(dest.rglob("k3ref/__init__.py"))
    assert len(inits) == 1, inits
    site = inits[0].parent.parent
    installed_as = "/" + str(site.relative_to(dest))
    path = subprocess.run([PY, "-c", "import sys; print('\\n'.join(sys.path))"], env=clean_env(),
                          capture_output=True, text=True, check=True).stdout.split()
    assert installed_as in path, f"meson install put k3ref in {installed_as}, not on {PY}'s sys.path {path}"
    assert list(site.glob("k3ref/_core*.so")) and (site / "k3ref" / "policies.json").is_file()
    assert (site / "k3ref" / "kernel_domains.json").is_file()  # k3ref.kernel_domains reads it beside itself
    env = clean_env()
    env["PYTHONPATH"] = str(site)
    r = subprocess.run([PY, "-c", CHECK, str(site), str(ROOT / "goldens")], cwd=tmp_path, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr
