"""The Python judge (k3ref.policy) on magnitudes whose plain squares overflow or vanish, on
non-finite goldens and on signed zeros: the same verdicts as the C++ judge
(tests/check/policy_table_test.cpp, Judgement.NonFiniteGoldensAndEmptyFiguresNeverPass and
TinyAndHugeGoldensAreJudgedLikeOrdinaryOnes), and the same figures bit for bit."""
import math

import pytest
import torch

from k3ref import policy

A = 1 + 2.0 ** -9
STATE = torch.tensor([A, 1.0], dtype=torch.float64).reshape(1, 1, 1, 2)


def judge(o_golden, o_candidate, rule):
    expected = {"o": torch.tensor(o_golden, dtype=torch.float64).reshape(1, 1, 1, 2), "final_state": STATE}
    candidate = {"o": torch.tensor(o_candidate, dtype=torch.float64).reshape(1, 1, 1, 2), "final_state": STATE}
    return policy.judge(expected, candidate, "kda.recurrent", rule, known=("q", "k", "v", "g", "beta"))


@pytest.mark.parametrize("magnitude", [1e-170, 1e-300, 1e160, 1e300])
@pytest.mark.parametrize("factor", [-1.0, 2.0])
@pytest.mark.parametrize("rule", ["floor:2", "rel-rms:1e-3"])
def test_a_negated_or_doubled_candidate_fails_at_any_magnitude(magnitude, factor, rule):
    v = judge([magnitude, magnitude / 3], [factor * magnitude, factor * magnitude / 3], rule)
    assert v.exit_code == 1, v.reason
    if rule.startswith("rel-rms"):
        assert v["o"].rel_rms == pytest.approx(abs(factor - 1), rel=1e-15)


@pytest.mark.parametrize("magnitude", [1e-170, 1e160])
def test_a_correct_candidate_at_any_magnitude_has_zero_error(magnitude):
    v = judge([magnitude, -magnitude / 3], [magnitude, -magnitude / 3], "rel-rms:1e-3")
    assert v.exit_code == 0 and v["o"].rel_rms == 0.0


def test_an_all_zero_golden_fails_a_tiny_candidate():
    for rule in ("floor:2", "rel-rms:1e-3", "exact"):
        v = judge([0.0, 0.0], [1e-300, 0.0], rule)
        assert v.exit_code == 1, (rule, v.reason)
    assert judge([0.0, 0.0], [1e-300, 0.0], "rel-rms:1e-3")["o"].rel_rms == math.inf


@pytest.mark.parametrize("rule", ["recurrent", "floor:2", "rel-rms:1e-3", "exact"])
def test_a_non_finite_golden_is_unusable(rule):
    nan = float("nan")
    v = judge([nan, nan], [nan, nan], rule)
    assert v.exit_code == 2
    assert "the golden holds a non-finite value (first at flat index 0)" in v.reason


def test_exact_tells_signed_zeros_apart():
    v = judge([0.0, 1.0], [-0.0, 1.0], "exact")
    assert v.exit_code == 1
    assert "0.0 against -0.0 at flat index 0" in v["o"].reason
    assert judge([0.0, 1.0], [0.0, 1.0], "exact").exit_code == 0


def test_ordinary_figures_are_the_unscaled_ones():
    # Scaling by a power of two is exact here: the figure is the plain formula's, bit for bit.
    g, c = [75000.0, -50000.0], [75000.01, -49990.0]  # scaled by 2^-17 inside
    plain = math.sqrt(((c[0] - g[0]) ** 2 + (c[1] - g[1]) ** 2) / (g[0] ** 2 + g[1] ** 2))
    assert judge(g, c, "rel-rms:1")["o"].rel_rms == plain
