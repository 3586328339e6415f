"""k3ref.testing.assert_kda_close: passes what the policy passes, and on failure names the
tensor, the worst element by its axes, the figure, the bound and the reason."""
import re

import pytest
import torch

from conftest import GOLDENS
from k3ref import goldens
from k3ref.testing import assert_kda_close, format_index


@pytest.fixture(scope="module")
def case():
    return goldens.load_case("kda_varlen", GOLDENS)


def rounded(case):
    # What a correct bf16 kernel returns: the golden rounded to bf16 (error = the floor).
    return {n: t.to(torch.bfloat16) for n, t in case.expected.items()}


def test_a_correct_kernel_passes(case):
    verdict = assert_kda_close(rounded(case), case, policy="recurrent")
    assert verdict.passed and [r.tensor for r in verdict.results] == ["o", "final_state"]


def test_a_wrong_element_is_named_by_its_axes(case):
    cand = rounded(case)
    cand["o"][0, 40, 1, 5] += 0.5
    with pytest.raises(AssertionError) as info:
        assert_kda_close(cand, case, policy="recurrent")
    text = str(info.value)
    lines = text.splitlines()
    assert lines[0] == ("Tensors are not close to the golden under policy 'recurrent' (kda.recurrent): "
                        "1 of 2 tensor(s) fail")
    assert len(lines) == 2 and lines[1].startswith("o: ")
    # kda_varlen packs its sequences along the token axis (cu_seqlens 0, 1, 1, 18, 50, 50, 83):
    # token 40 is position 40 - 18 = 22 of sequence 3.
    assert list(case.tensors["cu_seqlens"]) == [0, 1, 1, 18, 50, 50, 83]
    assert "worst element at (batch 0, sequence 3, position 22, head 1, channel 5)" in lines[1]
    figure, bound = (float(x) for x in re.search(r"figure (\S+), bound (\S+)\]", lines[1]).groups())
    assert figure > bound > 0
    want = float(case.expected["o"][0, 40, 1, 5])
    got = float(cand["o"][0, 40, 1, 5])
    assert f"candidate {got!r}, golden {want!r}" in lines[1]


def test_missing_required_output_fails(case):
    with pytest.raises(AssertionError, match=r"(?m)^final_state: missing from the candidate"):
        assert_kda_close({"o": rounded(case)["o"]}, case, policy="recurrent")


def test_unknown_tensor_fails(case):
    with pytest.raises(AssertionError, match="candidate tensor 'x' is neither an output nor an input"):
        assert_kda_close(dict(rounded(case), x=torch.zeros(1)), case, policy="recurrent")


def test_nan_is_reported(case):
    cand = rounded(case)
    cand["final_state"][1, 0, 2, 3] = float("nan")
    with pytest.raises(AssertionError) as info:
        assert_kda_close(cand, case, policy="recurrent")
    text = str(info.value)
    assert "final_state: " in text and "1 NaN and 0 Inf in the candidate" in text
    assert "the first mismatch at (sequence 1, head 0, k 2, v 3)" in text
    assert "worst element" not in text  # no figure over the finite pairs passed off as the worst


def test_defaults_to_the_recommended_policy_and_takes_fla_tuples(case):
    cand = rounded(case)
    assert assert_kda_close((cand["o"], cand["final_state"]), case).policy == case.recommended_policies["o"]
    assert assert_kda_close(cand, case, policy="recommended").passed
    with pytest.raises(AssertionError, match="final_state"):
        assert_kda_close((cand["o"], -cand["final_state"]), case)
    with pytest.raises(TypeError, match="FLA's order"):
        assert_kda_close((cand["o"], cand["final_state"], cand["o"]), case)


def test_shape_mismatch_fails(case):
    cand = rounded(case)
    cand["o"] = cand["o"][:, :10]
    with pytest.raises(AssertionError, match="o: shape .* differs from the golden's"):
        assert_kda_close(cand, case, policy="recurrent")


def test_unknown_policy_is_a_usage_error(case):
    with pytest.raises(ValueError, match="unknown tolerance policy 'tight'"):
        assert_kda_close(rounded(case), case, policy="tight")


def test_plain_tensors_need_the_operator(case):
    o = case.expected["o"]
    with pytest.raises(ValueError, match="pass op="):
        assert_kda_close(o.to(torch.bfloat16), o)
    assert assert_kda_close(o.to(torch.bfloat16), {"o": o}, op="kda.recurrent", tensors=["o"]).passed
    with pytest.raises(AssertionError, match="o: "):
        assert_kda_close(o.to(torch.float16) * 1.01, {"o": o}, op="kda.recurrent", tensors=["o"], policy="floor:2")


def test_axis_names_follow_the_tensor():
    assert format_index("final_state", [1, 0, 2, 3]) == "(sequence 1, head 0, k 2, v 3)"
    assert format_index("final_state", [1, 0, 2, 3], "v_first") == "(sequence 1, head 0, v 2, k 3)"
    assert format_index("dbeta", [0, 5, 1]) == "(batch 0, token 5, head 1)"
    assert format_index("h", [3, 1, 7]) == "(layer 3, token 1, channel 7)"
    assert format_index("weird", [1, 2]) == "(dim0 1, dim1 2)"
