"""One parser of policy names: 'floor:<m>' / 'rel-rms:<r>' are read by the policy table of
k3ref::check (through k3ref._core) for the package as for `k3ref compare`, so both accept and
refuse the same spellings (Python's float() alone would read 'floor:1_5' as 15)."""
import pytest

pytest.importorskip("torch")

from k3ref import policy  # noqa: E402


@pytest.mark.parametrize("name", ["floor:1_5", "floor:0", "floor:-1", "floor:nan", "floor:inf", "rel-rms:", "floor: 2",
                                  "floor:0x10", "rel-rms:1e-12junk"])
def test_bad_numbers_are_refused(name):
    with pytest.raises(KeyError, match="is not a positive number"):
        policy.load_table().rules(name, "kda.recurrent")


@pytest.mark.parametrize("name,metric,value", [("floor:2", "floor", 2.0), ("floor:1.5", "floor", 1.5),
                                               ("rel-rms:1e-12", "rel-rms", 1e-12), ("exact", "exact", 0.0)])
def test_good_numbers_are_read(name, metric, value):
    rule = policy.load_table().rules(name, "kda.recurrent")["o"]
    assert rule.metric == metric and rule.source == name
    assert {"floor": rule.multiple, "rel-rms": rule.bound, "exact": 0.0}[metric] == value
