"""The options vocabulary through the Python module: the package's name tuples and defaults
are the compiled table's, every name of every option reaches its reference, and an unknown
name is one line naming the option and every allowed name, in the Python layer and in the
compiled one alike."""
import inspect

import pytest
import torch

import k3ref
from conftest import needs_core, vocabulary_names

pytestmark = needs_core

OPTIONS = ("gate", "gate_base", "beta", "state_layout", "precision", "chunk_form", "method", "merge", "contract")
REFERENCES = ("kda", "kda_chunkwise", "kda_contract", "kda_backward", "kcp_forward", "kcp_backward", "attnres")


def problem(seed=0, T=6, K=8, V=8, HV=2):
    g = torch.Generator().manual_seed(seed)
    u = lambda *s, lo=-1.0, hi=1.0: (torch.rand(*s, generator=g, dtype=torch.float64) * (hi - lo) + lo)
    # K = V, so an initial state reads in either layout; it is not symmetric, so the layouts differ.
    return dict(q=u(1, T, 1, K), k=u(1, T, 1, K, lo=-0.3, hi=0.3), v=u(1, T, HV, V), g=u(1, T, HV, K, lo=-1.0, hi=0.0),
                beta=u(1, T, HV, lo=0.0, hi=1.0), initial_state=u(1, HV, K, V))


def run(option, name):
    """The reference that takes `option`, called with option=name."""
    x = problem()
    if option == "gate":
        kw = dict(lower_bound=-5.0) if name == "lower_bound" else {}
        if name in ("softplus", "lower_bound"):
            x.update(A_log=torch.full((2,), 0.5, dtype=torch.float64), dt_bias=torch.zeros(2, 8, dtype=torch.float64))
        return k3ref.kda(x, gate=name, **kw)
    if option in ("gate_base", "beta", "state_layout", "precision"):
        return k3ref.kda(x, **{option: name})
    if option == "chunk_form":
        return k3ref.kda_chunkwise(x, chunk_form=name, chunk_size=4, sub_chunk=2, stages=True)
    if option == "method":
        return k3ref.kda_backward(x, dict(d_o=torch.ones(1, 6, 2, 8, dtype=torch.float64)), method=name, chunk_size=2)
    if option == "merge":
        x["cu_seqlens"] = [0, 2, 6]
        x.pop("initial_state")
        return k3ref.kcp_forward(x, splits=[0, 3, 4, 6], merge=name)
    if option == "contract":
        x.pop("initial_state")
        return k3ref.kda_contract(x, name)
    raise AssertionError(option)


def test_the_registry_and_the_package_s_tuples_are_one_table():
    vocabulary = k3ref.option_vocabulary()
    assert tuple(vocabulary) == OPTIONS
    assert k3ref.PRECISIONS == ("double", "mp256")
    for attr, option in k3ref._NAME_TUPLES.items():
        assert getattr(k3ref, attr) == vocabulary[option]["values"], attr
    for option, allowed in k3ref.KDA_OPTIONS.items():
        if isinstance(allowed, tuple):
            assert allowed == vocabulary[option]["values"], option
    assert k3ref.tier_descriptions() == {"double": "IEEE binary64", "mp256": "256-bit binary float",
                                         "rational": "exact rational"}


@pytest.mark.parametrize("fn_name", REFERENCES)
def test_signature_defaults_are_the_vocabulary_s(fn_name):
    vocabulary = k3ref.option_vocabulary()
    for name, p in inspect.signature(getattr(k3ref, fn_name)).parameters.items():
        if name in vocabulary and p.default is not inspect.Parameter.empty:
            assert p.default == vocabulary[name]["default"], (fn_name, name, p.default)


@pytest.mark.parametrize("option, name", [(o, n) for o in OPTIONS for n in vocabulary_names(o)])
def test_every_name_reaches_its_reference(option, name):
    out = run(option, name)
    assert "o" in out or "dq" in out, sorted(out)
    for t in out.values():
        if t.is_floating_point():
            assert torch.isfinite(t).all(), (option, name)


@pytest.mark.parametrize("option", ["gate", "beta", "state_layout", "method"])
def test_distinct_names_give_distinct_computations(option):
    # The names of these options change the result (method: the chunkwise backward adds its
    # stage tensors): two names mapped to one value would give equal outputs.
    outs = {n: run(option, n) for n in vocabulary_names(option)}
    names = list(outs)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            same = outs[a].keys() == outs[b].keys() and all(torch.equal(outs[a][t], outs[b][t]) for t in outs[a])
            assert not same, (option, a, b)


@pytest.mark.parametrize("option", OPTIONS)
def test_unknown_name_is_one_line_listing_the_allowed_names(option):
    allowed = ", ".join(vocabulary_names(option))
    expected = f"option '{option}' must be one of {allowed}, not 'Nope'"
    with pytest.raises(ValueError) as info:
        run(option, "Nope")
    assert str(info.value).endswith(expected) and "\n" not in str(info.value), str(info.value)


@pytest.mark.parametrize("option", ["gate", "gate_base", "beta", "state_layout"])
def test_the_compiled_layer_parses_by_the_same_table(option):
    # Past the Python checks, k3ref._core parses the option dict itself: same message.
    core = k3ref._compiled()
    x = {n: t.numpy() for n, t in problem().items()}
    allowed = ", ".join(vocabulary_names(option))
    with pytest.raises(ValueError) as info:
        core.kda_recurrent(x, {option: "Nope"}, "double")
    assert str(info.value) == f"option '{option}' must be one of {allowed}, not 'Nope'"
    with pytest.raises(ValueError) as info:
        core.kda_recurrent(x, {}, "quad")
    assert str(info.value) == "option 'precision' must be one of double, mp256, not 'quad'"
