"""Reports name a kernel's source, not only its package version: the commit of the git
checkout it lies in, else a hash of its package's files; FLA's dispatch variables are pinned
before it is imported and recorded (k3ref.gpu_check.adapters)."""
import importlib
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
from k3ref.gpu_check import adapters  # noqa: E402


def make_package(root, name, body="x = 1\n"):
    pkg = root / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(body)
    return pkg


def imported(root, name):
    sys.path.insert(0, str(root))
    try:
        sys.modules.pop(name, None)
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(root))
        sys.modules.pop(name, None)


def test_a_package_outside_git_is_named_by_a_hash_of_its_files(tmp_path):
    a = imported(tmp_path / "a", make_package(tmp_path / "a", "kernel_a").name)
    b = imported(tmp_path / "b", make_package(tmp_path / "b", "kernel_b", "x = 2\n").name)
    ia, ib = adapters.source_identity(a), adapters.source_identity(b)
    assert ia.startswith("files sha256:") and ib.startswith("files sha256:") and ia != ib


def test_a_package_in_a_git_checkout_is_named_by_its_commit(tmp_path):
    repo = tmp_path / "repo"
    make_package(repo, "kernel_git")
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t")
    subprocess.run(["git", "init", "-q", str(repo)], check=True, env=env)
    subprocess.run(["git", "-C", str(repo), "add", "."], check=True, env=env)
    subprocess.run(["git", "-C", str(repo), "commit", "-qm", "one"], check=True, env=env)
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    assert adapters.source_identity(imported(repo, "kernel_git")) == f"git {head}"
    subprocess.run(["git", "-C", str(repo), "pack-refs", "--all"], check=True, env=env)  # refs only in packed-refs
    adapters._SOURCE_IDENTITY.clear()
    assert adapters.source_identity(imported(repo, "kernel_git")) == f"git {head}"


def test_fla_dispatch_is_pinned_and_recorded(tmp_path, monkeypatch):
    monkeypatch.setenv("FLA_FLASH_KDA", "1")  # a backend another kernel would run
    root = tmp_path / "fla_tree"
    fla = make_package(root, "fla")
    (fla / "ops").mkdir()
    (fla / "ops" / "__init__.py").write_text("")
    (fla / "ops" / "kda").mkdir()
    (fla / "ops" / "kda" / "__init__.py").write_text("import os\nSEEN = os.environ['FLA_FLASH_KDA']\n")
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "path", list(sys.path))
    mod = adapters.load_fla(str(root))
    assert mod.SEEN == "0"
    line = adapters.fla_version()
    assert "FLA_DISABLE_BACKEND_DISPATCH=1, FLA_FLASH_KDA=0, FLA_TILELANG=0" in line
    assert "files sha256:" in line
