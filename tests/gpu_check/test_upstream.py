"""upstream.import_bare: a library's op imported without its packages' __init__ files (FLA's
and Liger's import every op there: 12-23 s a worker on the H200), and taken back out whole
when that fails, so that the usual import can follow."""
import sys

import pytest

pytest.importorskip("torch")

from k3ref.gpu_check.upstream import import_bare  # noqa: E402


def _tree(root, ops_body):
    pkg = root / "bareling"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "__init__.py").write_text("__version__ = '9.9'\nraise RuntimeError('the package __init__ ran')\n")
    (pkg / "ops" / "__init__.py").write_text("raise RuntimeError('the ops __init__ ran')\n")
    (pkg / "util.py").write_text("VALUE = 3\n")
    (pkg / "ops" / "helper.py").write_text("from bareling.util import VALUE\n")
    (pkg / "ops" / "thing.py").write_text(ops_body)


@pytest.fixture
def on_path(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [n for n in sys.modules if n == "bareling" or n.startswith("bareling.")]:
        del sys.modules[name]


def test_the_op_is_imported_without_the_packages_init(on_path):
    _tree(on_path, "from bareling.ops.helper import VALUE\nANSWER = VALUE * 14\n")
    mod = import_bare("bareling.ops.thing", ("bareling", "bareling.ops"))
    assert mod.ANSWER == 42
    assert sys.modules["bareling"].__version__ == "9.9"
    assert sys.modules["bareling"].__k3ref_bare__ and sys.modules["bareling.ops"].__k3ref_bare__


def test_a_failure_takes_every_module_of_the_library_back_out(on_path):
    _tree(on_path, "from bareling.ops.helper import VALUE\nraise ValueError('the op needs its package')\n")
    with pytest.raises(ValueError, match="the op needs its package"):
        import_bare("bareling.ops.thing", ("bareling", "bareling.ops"))
    assert not [n for n in sys.modules if n == "bareling" or n.startswith("bareling.")]
    with pytest.raises(RuntimeError, match="the package __init__ ran"):  # the usual import runs them
        __import__("bareling.ops.thing")


def test_a_library_that_is_not_there(on_path):
    with pytest.raises(ImportError, match="no bareling package on the path"):
        import_bare("bareling.ops.thing", ("bareling", "bareling.ops"))
