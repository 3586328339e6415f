"""Reports name a kernel's source, not only its package version: the commit of the git
checkout it lies in, else a hash of its package's files; FLA's dispatch variables are pinned
before it is imported and recorded (k3ref.gpu_check.protocol; the pinning: k3ref.gpu_check.upstream)."""
import importlib.util
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
from k3ref.gpu_check import protocol, upstream  # noqa: E402


def make_package(root, name, body="x = 1\n"):
    pkg = root / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(body)
    return pkg


def imported(root, name):
    """The package `name` of directory `root`, imported from its files (sys.path unchanged) and
    not left in sys.modules."""
    init = root / name / "__init__.py"
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        return module
    finally:
        sys.modules.pop(name, None)


def test_a_package_outside_git_is_named_by_a_hash_of_its_files(tmp_path):
    a = imported(tmp_path / "a", make_package(tmp_path / "a", "kernel_a").name)
    b = imported(tmp_path / "b", make_package(tmp_path / "b", "kernel_b", "x = 2\n").name)
    ia, ib = protocol.source_identity(a), protocol.source_identity(b)
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
    assert protocol.source_identity(imported(repo, "kernel_git")) == f"git {head}"
    subprocess.run(["git", "-C", str(repo), "pack-refs", "--all"], check=True, env=env)  # refs only in packed-refs
    protocol._SOURCE_IDENTITY.clear()
    assert protocol.source_identity(imported(repo, "kernel_git")) == f"git {head}"


def test_a_package_in_an_ignored_folder_of_a_checkout_is_not_named_by_that_commit(tmp_path):
    # what the H200 run showed: FLA copied into k3ref's ignored .thirdparty/ was reported as
    # k3ref's own commit
    repo = tmp_path / "outer"
    repo.mkdir()
    (repo / ".gitignore").write_text("/third/\n")
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t")
    subprocess.run(["git", "init", "-q", str(repo)], check=True, env=env)
    subprocess.run(["git", "-C", str(repo), "add", "."], check=True, env=env)
    subprocess.run(["git", "-C", str(repo), "commit", "-qm", "one"], check=True, env=env)
    make_package(repo / "third", "kernel_copied")
    protocol._SOURCE_IDENTITY.clear()
    assert protocol.source_identity(imported(repo / "third", "kernel_copied")).startswith("files sha256:")


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
    mod = upstream.load_fla(str(root))
    assert mod.SEEN == "0"
    line = upstream.fla_version()
    assert "FLA_DISABLE_BACKEND_DISPATCH=1, FLA_FLASH_KDA=0, FLA_TILELANG=0" in line
    assert "files sha256:" in line


def fla_tree(root, package_init, kda_init):
    fla = make_package(root, "fla", package_init)
    (fla / "ops" / "kda").mkdir(parents=True)
    (fla / "ops" / "__init__.py").write_text(package_init)
    (fla / "modules").mkdir()
    (fla / "modules" / "__init__.py").write_text(package_init)
    (fla / "modules" / "l2norm.py").write_text("NORM = 'l2'\n")
    (fla / "ops" / "kda" / "__init__.py").write_text(kda_init)
    return root


@pytest.fixture
def clean_fla(monkeypatch):
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv("FLA_FULL_IMPORT", raising=False)
    yield
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        del sys.modules[name]


def test_fla_kda_is_imported_without_the_packages_init(tmp_path, clean_fla):
    # the packages' __init__ files import every op, layer and model: they must not run
    root = fla_tree(tmp_path / "t", "__version__ = '9.9.9'\nraise RuntimeError('package __init__ ran')\n",
                    "from fla.modules.l2norm import NORM\n")
    mod = upstream.load_fla(str(root))
    assert mod.NORM == "l2"
    assert sys.modules["fla"].__version__ == "9.9.9"
    line = upstream.fla_version()
    assert line.startswith("fla 9.9.9 from ") and "imported without the packages' __init__" in line


def test_fla_whose_ops_need_the_package_exports_is_imported_as_usual(tmp_path, clean_fla):
    root = fla_tree(tmp_path / "t", "__version__ = '1.0'\nEXPORTED = 3\n", "from fla import EXPORTED\n")
    assert upstream.load_fla(str(root)).EXPORTED == 3
    assert "without the packages' __init__" not in upstream.fla_version()
