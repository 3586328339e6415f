"""Host-side test of the version probe (k3ref/gpu_check/probe.py) with CPU stand-ins of FLA's
chunk_kda: an "old FLA" that knows neither the gate nor beta's sigmoid in kernel nor the
V-first state nor GVA, and swallows the keywords it does not know through **kwargs; and a
current one without GVA. The probe must turn what they lack into "not applicable (not
supported by this version: ...)", never into a numeric failure, and the metamorphic checks
must all still run on the one without GVA. Skipped without torch or k3ref._core.
"""
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from k3ref import goldens  # noqa: E402
from k3ref.gpu_check import checks, probe, problems, references, torch_model  # noqa: E402
from k3ref.gpu_check.adapters import FlaAdapter  # noqa: E402

if references._module() is None:
    pytest.skip("k3ref._core is not importable", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
SUITE = goldens.load_suite(ROOT / "goldens", ops=("kda.recurrent",))


def _model(q, k, v, g, beta, initial_state, cu_seqlens, params):
    inputs = dict(q=q, k=k, v=v, g=g, beta=beta)
    for name, t in (("initial_state", initial_state), ("cu_seqlens", cu_seqlens), *params.pop("extra", {}).items()):
        if t is not None:
            inputs[name] = t
    o, f = torch_model.kda_forward(inputs, params)
    return o.to(torch.bfloat16), f.float()


def old_fla(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    """An FLA of before the gate in kernel and GVA: other keywords fall into kwargs, unread."""
    if not q.shape == k.shape == g.shape:
        raise AssertionError("q, k, g must have the same shape")
    return _model(q, k, v, g, beta, initial_state, cu_seqlens, dict(scale=scale, qk_l2norm=use_qk_l2norm_in_kernel))


def fla_current(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                allow_neg_eigval=False, lower_bound=None, state_v_first=False, cu_seqlens=None, **kwargs):
    """Every option, A_log and dt_bias read from kwargs (as FLA's chunk_kda does), and GVA."""
    A_log, dt_bias = kwargs.get("A_log"), kwargs.get("dt_bias")
    HV, K = v.shape[2], q.shape[3]
    gate = "log_decay" if not use_gate_in_kernel else ("lower_bound" if lower_bound is not None else "softplus")
    beta_mode = "as_given" if not use_beta_sigmoid_in_kernel else ("two_sigmoid" if allow_neg_eigval else "sigmoid")
    h0 = initial_state.transpose(-1, -2) if (initial_state is not None and state_v_first) else initial_state
    extra = {"A_log": A_log, "dt_bias": dt_bias.reshape(HV, K) if dt_bias is not None else None}
    o, f = _model(q, k, v, g, beta, h0, cu_seqlens, dict(scale=scale, qk_l2norm=use_qk_l2norm_in_kernel, gate=gate,
                                                          lower_bound=lower_bound, beta=beta_mode, extra=extra))
    return o, (f.transpose(-1, -2).contiguous() if state_v_first else f)


def fla_without_gva(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                    allow_neg_eigval=False, lower_bound=None, state_v_first=False, cu_seqlens=None, **kwargs):
    """fla_current without GVA."""
    if not q.shape == k.shape == g.shape:
        raise AssertionError("q, k, g must have the same shape")
    return fla_current(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                       use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first,
                       cu_seqlens, **kwargs)


class StandInFla(FlaAdapter):
    requires_cuda = False

    def __init__(self, fn):
        super().__init__("chunk_kda")
        self.name = f"standin.{fn.__name__}"
        self.stand_in = fn
        self.contract_name = None  # the stand-ins are the exact recurrence rounded to bf16: the floor rule
        self.policy = "recurrent"
        self.requires_cuda = False

    def load(self):
        self.fn = self.stand_in


def _golden_results(adapter):
    assert adapter.available(), adapter.unavailable_reason
    return {case.name: checks.golden_check(adapter, case, "cpu") for case in SUITE}


def test_keywords_read_from_kwargs_are_accepted_and_others_refused():
    def kernel(q, scale=None, **kw):
        a = kw.get("A_log")
        b = kw["dt_bias"] if "dt_bias" in kw else None
        return q, a, b, kw.pop("lower", None), "seen" in kw

    named, read, var_kw = probe.accepted_keywords(kernel)
    assert named == {"q", "scale"} and read == {"A_log", "dt_bias", "lower", "seen"} and var_kw
    probe.refuse_unknown(kernel, dict(scale=0.5, A_log=1, lower=2, unknown=None, other=False))  # neutral: fine
    with pytest.raises(probe.NotSupported, match=r"^not supported by this version: option unknown \(it would fall"):
        probe.refuse_unknown(kernel, dict(A_log=1, unknown=True))

    def closed(q, scale=None):
        return q

    with pytest.raises(probe.NotSupported, match="option x \\(no such parameter\\)"):
        probe.refuse_unknown(closed, dict(x=1.0))

    def opaque(*args, **kwargs):  # a wrapper without functools.wraps: nothing to tell
        return kernel(*args, **kwargs)

    assert probe.unsupported_keyword(opaque, dict(unknown=True)) is None

    def forwarding(q, scale=None, **kwargs):  # passes them on: the callee decides
        return closed(q, **kwargs)

    assert probe.unsupported_keyword(forwarding, dict(unknown=True)) is None


def test_an_old_version_gets_not_applicable_never_a_numeric_failure():
    res = _golden_results(StandInFla(old_fla))
    statuses = {r.status for r in res.values()}
    assert statuses <= {"pass", "skip"}, {n: r.reason for n, r in res.items() if r.status not in ("pass", "skip")}
    options = [n for n, r in res.items() if "not supported by this version: option" in r.reason]
    gva = [n for n, r in res.items() if "not supported by this version: GVA" in r.reason]
    passed = [n for n, r in res.items() if r.status == "pass"]
    assert options and gva and passed, (len(options), len(gva), len(passed))
    for n in options + gva:
        assert res[n].reason.startswith("n/a (not supported by this version: "), res[n].reason
    # Without the probe the swallowed options are judged as numbers: they fail.
    adapter = StandInFla(old_fla)
    adapter.available()
    adapter.version_unsupported = lambda params, shapes: None
    saved = probe.refuse_unknown
    probe.refuse_unknown = lambda fn, kw: None
    try:
        case = next(c for c in SUITE if c.name in options and c.inputs["v"].shape[2] == c.inputs["q"].shape[2])
        assert checks.golden_check(adapter, case, "cpu").status == "fail"
    finally:
        probe.refuse_unknown = saved


def test_a_version_without_gva_keeps_every_metamorphic_check():
    adapter = StandInFla(fla_without_gva)
    assert adapter.available()
    config = problems.pick_config(adapter)  # the GVA trial runs here, on the first configuration
    assert adapter.gva is False and config["H"] == config["HV"], config["name"]
    results = [check(adapter, "cpu") for check in checks.METAMORPHIC]
    assert [r.status for r in results] == ["pass"] * len(checks.METAMORPHIC), [(r.check, r.reason) for r in results]
    res = _golden_results(adapter)
    gva = [r for r in res.values() if "GVA" in r.reason]
    assert gva and all(r.status == "skip" for r in gva)
    assert all(r.status in ("pass", "skip") for r in res.values()), [(r.case, r.reason) for r in res.values()
                                                                     if r.status not in ("pass", "skip")]


def test_a_kernel_that_fails_at_both_head_counts_is_an_error_not_a_refusal():
    def broken(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
               allow_neg_eigval=False, lower_bound=None, state_v_first=False, cu_seqlens=None, **kwargs):
        kwargs.get("A_log"), kwargs.get("dt_bias")
        raise RuntimeError("boom")

    adapter = StandInFla(broken)
    adapter.available()
    case = next(c for c in SUITE if c.inputs["v"].shape[2] > c.inputs["q"].shape[2])
    r = checks.golden_check(adapter, case, "cpu")
    assert r.status == "error" and "boom" in r.reason and adapter.gva is None
