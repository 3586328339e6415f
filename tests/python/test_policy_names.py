"""One parser of policy names: the harness's metrics (k3ref.gpu_check.metrics.parse_policy)
reads 'floor:<m>' / 'rel-rms:<r>' through k3ref.policy's parser, so both accept and refuse the
same spellings (Python's float() alone would read 'floor:1_5' as 15)."""
import pytest

pytest.importorskip("torch")

from k3ref import policy  # noqa: E402
from k3ref.gpu_check import metrics  # noqa: E402


@pytest.mark.parametrize("name", ["floor:1_5", "floor:0", "floor:-1", "floor:nan", "floor:inf", "rel-rms:", "floor: 2",
                                  "floor:0x10", "rel-rms:1e-12junk"])
def test_both_readers_refuse(name):
    with pytest.raises(KeyError):
        policy.parse_parametric(name)
    with pytest.raises(ValueError, match="is not a positive number"):
        metrics.parse_policy(name)


@pytest.mark.parametrize("name,kind,value", [("floor:2", "floor", 2.0), ("floor:1.5", "floor", 1.5),
                                             ("rel-rms:1e-12", "rel-rms", 1e-12), ("exact", "exact", 0.0)])
def test_both_readers_accept(name, kind, value):
    assert policy.parse_parametric(name) == (kind, value)
    p = metrics.parse_policy(name)
    assert (p.kind, p.bound) == (kind, value)
