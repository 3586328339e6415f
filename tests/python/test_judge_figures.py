"""policy.judge_figures: the one judge's rule applied to figures measured elsewhere (libk3gc's
comparator on the device, the scale tier's tensors) gives the verdict judge() gives after
comparing the same tensors on the host: pass, figure, bound, ratio and reason alike, under
floor, rel-rms, contract and max-abs-ulps rules. Hypothesis draws the tensors; a failure prints
the example that replays it."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from k3ref import policy

RULES = ("floor:2", "rel-rms:1e-3", "recurrent", "fla-chunk-contract")
SHAPE = (1, 4, 2, 8)  # kda.recurrent's o: [batch, token, head, channel]


def _tensor(seed, scale):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g, dtype=torch.float64) * scale


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e20]),
       noise=st.sampled_from([0.0, 1e-4, 3e-3, 1e-2, 1.0]), rule=st.sampled_from(RULES),
       bf16=st.booleans(), contract_noise=st.sampled_from([0.0, 2e-3, 5e-2]))
def test_figures_judged_alone_give_the_verdict_of_the_tensors(seed, scale, noise, rule, bf16, contract_noise):
    golden = _tensor(seed, scale)
    candidate = golden * (1 + noise * _tensor(seed + 1, 1.0))
    if bf16:
        candidate = candidate.to(torch.bfloat16)
    contract = golden * (1 + contract_noise * _tensor(seed + 2, 1.0))
    contracts = {"o": contract} if rule.endswith("-contract") else None
    whole = policy.judge({"o": golden}, {"o": candidate}, "kda.recurrent", rule, tensors=["o"], contracts=contracts)["o"]
    figures = policy.measure(candidate, golden, "bf16")
    c = policy.measure(contract, golden, "bf16")["rel_rms"] if contracts else 0.0
    alone = policy.judge_figures(figures, "kda.recurrent", "o", rule, contract_error=c)
    assert (alone.passed, alone.status, alone.metric, alone.floor_dtype, alone.rule) == \
           (whole.passed, whole.status, whole.metric, whole.floor_dtype, whole.rule)
    for name in ("figure", "bound", "ratio", "rel_rms", "floor", "contract_error"):
        a, w = getattr(alone, name), getattr(whole, name)
        assert a == w or (math.isnan(a) and math.isnan(w)), (name, a, w)
    assert alone.reason == whole.reason


def test_max_abs_ulps_takes_the_golden_s_scale_from_the_caller():
    golden = torch.tensor([1.0, 3.0, -600.0, 0.5], dtype=torch.float64)
    candidate = golden + torch.tensor([0.0, 0.0, 600.0 * 2.0 ** -20, 0.0], dtype=torch.float64)
    whole = policy.judge({"qb_beta": golden}, {"qb_beta": candidate}, "qb.online", "qb-exact", tensors=["qb_beta"])
    figures = policy.measure(candidate, golden, "fp32")
    alone = policy.judge_figures(figures, "qb.online", "qb_beta", "qb-exact", ulp_scale=600.0)
    assert (alone.passed, alone.figure, alone.bound, alone.reason) == \
           (whole["qb_beta"].passed, whole["qb_beta"].figure, whole["qb_beta"].bound, whole["qb_beta"].reason)


def test_a_comparator_s_figures_without_max_abs_never_pass_as_equal():
    # A floor rule passes a zero max abs error whatever the rel RMS (exact equality); figures
    # that do not carry max_abs (a window's, the device comparator's sums) must not read so.
    r = policy.judge_figures({"rel_rms": 0.5, "floor_rel_rms": 1e-3}, "kda.recurrent", "o", "floor:2")
    assert not r.passed and r.bound == pytest.approx(2e-3) and r.ratio == pytest.approx(500.0)
    ok = policy.judge_figures({"rel_rms": 1.5e-3, "floor_rel_rms": 1e-3}, "kda.recurrent", "o", "floor:2")
    assert ok.passed and ok.figure == 1.5e-3


def test_a_nonfinite_mismatch_fails_and_an_unknown_rule_is_a_key_error():
    r = policy.judge_figures({"rel_rms": 0.0, "floor_rel_rms": 1e-3, "first_nonfinite_mismatch": 7}, "kda.recurrent",
                             "o", "floor:2")
    assert not r.passed and "first at flat index 7" in r.reason
    with pytest.raises(KeyError):
        policy.judge_figures({"rel_rms": 0.0}, "kda.recurrent", "o", "no-such-policy")
    with pytest.raises(KeyError):
        policy.judge_figures({"rel_rms": 0.0}, "kda.recurrent", "no_such_tensor", "floor:2")
