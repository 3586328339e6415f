"""The package installs as docs/python.md says, the installed copy works, and a newcomer's
first hour runs as the docs write it.

1. A fresh copy of the checkout (no build outputs, no ignored folders), whose build/k3ref is
   this build's command (the README's first step), and in it the README's venv command as
   written (`/usr/bin/python3 -m venv --system-site-packages venv && venv/bin/pip install
   --no-build-isolation .`, the pip build time printed). From another directory and without
   PYTHONPATH: `import k3ref` resolves into the venv, a reference reproduces a golden bit for
   bit, the harness imports, the pytest11 entry point and the k3ref-gpu-check script are
   installed, the golden suite ships with it (found with no variable or option).
2. The newcomer's commands, taken from the docs' marked blocks (`<!-- newcomer:NAME begin -->`
   ... `end -->` in README.md and docs/*.md), so that docs and test cannot drift, run in that
   checkout with the venv first on PATH: own inputs (`k3ref inputs`) -> `k3ref kda` -> `k3ref
   compare` passes the example kernel's outputs (examples/torch_kda_adapter.py) and fails a
   perturbed copy, by exit code and verdict line; the same in Python through `k3ref.save` and
   `assert_kda_close`; the example adapter under pytest from the checkout's root.
3. `meson install --destdir` of this build (K3REF_BUILD_ROOT): k3ref lands in a directory of
   /usr/bin/python3's own sys.path (under DESTDIR), and imports from there."""
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = os.environ.get("K3REF_BUILD_ROOT")
EXE = os.environ.get("K3REF_EXE")  # this build's k3ref command
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
from k3ref import kernel_domains_file
assert str(kernel_domains_file.path()).startswith(sys.argv[1]), kernel_domains_file.path()
import k3ref.gpu_check, k3ref.gpu_check.adapters, k3ref.testing  # the built-in adapters read their domains at import
print("ok", k3ref.__file__)
"""


def clean_env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "K3REF_CORE_PATH", "PYTHONHOME", "K3REF_GOLDENS")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


MARK = re.compile(r"<!-- newcomer:(\S+) (begin|end) -->")


def doc_blocks():
    """{name: commands} of every block between `<!-- newcomer:NAME begin -->` and
    `<!-- newcomer:NAME end -->` in README.md and docs/*.md, without the code fences and the
    indentation of the code block."""
    blocks = {}
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        name, lines = None, []
        for line in path.read_text().splitlines():
            m = MARK.fullmatch(line.strip())
            if m and m.group(2) == "begin":
                assert name is None and m.group(1) not in blocks, f"{path}: newcomer:{m.group(1)} begins again"
                name, lines = m.group(1), []
            elif m:
                assert name == m.group(1), f"{path}: newcomer:{m.group(1)} ends, but {name} is open"
                blocks[name] = textwrap.dedent("\n".join(x for x in lines if not x.startswith("```"))).strip() + "\n"
                name = None
            elif name is not None:
                lines.append(line)
        assert name is None, f"{path}: newcomer:{name} never ends"
    return blocks


BLOCKS = doc_blocks()
IGNORED_AT_ROOT = re.compile(r"build.*|\.thirdparty|\.mesonpy-.*|\.git|venv|gpu_check_report|\.cache_k3ref")
IGNORED = {"__pycache__", ".hypothesis", ".pytest_cache"}


def sh(commands, cwd, env):
    """The commands as written, in bash, stopping at the first that fails."""
    return subprocess.run(["bash", "-e", "-c", commands], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=900)


def newcomer_env(checkout):
    """The venv first on PATH (as an activated venv) and build/ for the installed command's
    name (`k3ref`); pip without an index (CI has no network, and --no-build-isolation needs none)."""
    env = clean_env()
    env.update(PATH=os.pathsep.join([str(checkout / "venv" / "bin"), str(checkout / "build"), env["PATH"]]),
               PIP_NO_INDEX="1", PYTEST_ADDOPTS="-p no:cacheprovider", PYTHONDONTWRITEBYTECODE="1")
    return env


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    """A newcomer's checkout: the tree without what git ignores, build/k3ref (the README's first
    command; this build's), and the venv made by the README's command as written."""
    if not EXE:
        pytest.skip("K3REF_EXE (the k3ref command of a build) not set")
    d = tmp_path_factory.mktemp("newcomer") / "k3ref"

    def ignore(folder, names):
        at_root = Path(folder) == ROOT
        return [n for n in names if n in IGNORED or n.endswith(".pyc") or (at_root and IGNORED_AT_ROOT.fullmatch(n))]

    shutil.copytree(ROOT, d, ignore=ignore, symlinks=True)
    (d / "build").mkdir()
    (d / "build" / "k3ref").symlink_to(EXE)
    assert BLOCKS["venv"] == "/usr/bin/python3 -m venv --system-site-packages venv && venv/bin/pip install " \
                             "--no-build-isolation .\n", BLOCKS["venv"]  # Debian's interpreter (docs/python.md)
    start = time.monotonic()
    r = sh(BLOCKS["venv"], d, newcomer_env(d))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    print(f"\nthe README's venv command (pip install --no-build-isolation .) took {time.monotonic() - start:.0f} s")
    return d


def test_pip_install_into_a_venv(checkout, tmp_path):
    venv = checkout / "venv"
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
    # Only the package: no library, command or headers in the venv.
    assert not list(venv.rglob("libk3ref*")) and not (venv / "bin" / "k3ref").exists()
    assert not (venv / "include" / "k3ref").exists()


# The newcomer's kernel: the example adapter's PyTorch recurrence on mine.safetensors, its
# outputs saved with k3ref.save as kernel.safetensors, and a copy with o scaled by 1.02 (rel
# RMS 2e-2, 8x the recurrent policy's bound of 1.5 x the bf16 floor, about 2.5e-3) as off.safetensors.
KERNEL = r"""
import sys, torch, k3ref
from k3ref import _safetensors
sys.path.insert(0, "examples")
from torch_kda_adapter import TorchKda
arrays, _ = _safetensors.load("mine.safetensors")
o, final_state = TorchKda().run({n: torch.from_numpy(a) for n, a in arrays.items()}, {})
k3ref.save("kernel.safetensors", {"o": o, "final_state": final_state})
k3ref.save("off.safetensors", {"o": (o.double() * 1.02).bfloat16(), "final_state": final_state})
"""


def test_own_inputs_to_a_verdict_with_the_command(checkout):
    env = newcomer_env(checkout)
    r = sh(BLOCKS["cli-reference"], checkout, env)
    assert r.returncode == 0, r.stdout + r.stderr
    k = subprocess.run(["python3", "-c", KERNEL], cwd=checkout, env=env, capture_output=True, text=True)
    assert k.returncode == 0, k.stderr[-3000:]
    for code, verdict in ((0, "PASS"), (1, "FAIL")):
        if verdict == "FAIL":
            (checkout / "off.safetensors").replace(checkout / "kernel.safetensors")
        r = sh(BLOCKS["cli-compare"], checkout, env)
        lines = r.stdout.strip().splitlines()
        assert r.returncode == code and lines[-1].startswith(f"{verdict} under policy 'recurrent' (kda.recurrent): "), \
            r.stdout + r.stderr
        tensors = {x.split()[0]: x for x in lines if x.split()[0] in ("o", "final_state")}
        assert f"  {verdict}: " in tensors["o"] and "  PASS: " in tensors["final_state"], tensors  # only o is off
    # docs/cli.md gives the same steps by the installed command's name
    steps = BLOCKS["cli-reference"] + BLOCKS["cli-compare"]
    assert BLOCKS["cli-steps"] == steps.replace("build/k3ref ", "k3ref "), BLOCKS["cli-steps"]
    # and what `k3ref inputs` prints, as it prints it
    command, *printed = BLOCKS["cli-inputs-output"].splitlines()
    assert command.startswith("$ k3ref inputs ")
    r = sh(command[2:], checkout, env)
    assert r.returncode == 0 and r.stdout.splitlines() == printed, r.stdout + r.stderr


# The Python blocks of docs/python.md as written, with the example kernel as my_kda: the
# verdict for it, then for a copy whose o is 2 % off.
PYTHON_FLOW = r"""
import json, subprocess, sys
sys.path.insert(0, "examples")
from torch_kda_adapter import TorchKda
blocks = json.loads(sys.argv[1])
my_kda = lambda q, k, v, g, beta: TorchKda().run(dict(q=q, k=k, v=v, g=g, beta=beta), {})
scope = {"my_kda": my_kda}
exec(blocks["python-save"], scope)
print(subprocess.run(["bash", "-e", "-c", blocks["python-reference"]], check=True, capture_output=True,
                     text=True).stdout.strip())
exec(blocks["python-check"], scope)
print("passed")
scope["my_kda"] = lambda *a: (lambda o, ht: ((o.double() * 1.02).bfloat16(), ht))(*my_kda(*a))
try:
    exec(blocks["python-check"], scope)
    print("passed")
except AssertionError as e:
    print("failed:", e)
"""


def test_own_inputs_to_a_verdict_in_python(checkout):
    blocks = {n: BLOCKS[n] for n in ("python-save", "python-reference", "python-check")}
    r = subprocess.run(["python3", "-c", PYTHON_FLOW, json.dumps(blocks)], cwd=checkout, env=newcomer_env(checkout),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    wrote, first, second, *rest = r.stdout.strip().splitlines()
    assert wrote.startswith("wrote ref.safetensors (double reference, ") and first == "passed", r.stdout
    assert second == ("failed: Tensors are not close to the golden under policy 'recurrent' (kda.recurrent): "
                      "1 of 2 tensor(s) fail"), r.stdout
    assert len(rest) == 1 and rest[0].startswith("o: rel RMS "), rest


def test_the_example_adapter_under_pytest_from_the_checkout_root(checkout):
    r = sh(BLOCKS["pytest-example"], checkout, newcomer_env(checkout))
    documented = re.search(r"gives `(\d+ passed, \d+ skipped)`", (ROOT / "docs" / "verify-your-kernel.md").read_text())
    summary = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr
    assert r.returncode == 0 and documented.group(1) in summary and "failed" not in summary, \
        r.stdout[-3000:] + r.stderr[-2000:]
    print(f"the docs' pytest example from the checkout root: {summary}")


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
    assert (site / "k3ref" / "kernel_domains.json").is_file()  # k3ref.kernel_domains_file reads it beside itself
    env = clean_env()
    env["PYTHONPATH"] = str(site)
    r = subprocess.run([PY, "-c", CHECK, str(site), str(ROOT / "goldens")], cwd=tmp_path, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr
