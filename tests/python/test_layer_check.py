"""k3ref.layer_check (python/k3ref/layer_check.py) on the CPU, through a stand-in for FLA's
`KimiDeltaAttention`: a module with FLA's constructor, parameter names, forward signature and
cache calls whose arithmetic is the NumPy oracle of docs/kda-layer.md (tests/oracle/layer.py,
float64). FLA's own layer needs Triton (GPU only; docs/kda-layer.md), so this tests the
adapter (weights loaded from the goldens, the K-first / V-first and conv-window mappings, the
pools gathered into cache rows) and the checks; the oracle's four layer mutants, put in the
stand-in, are each caught by a check."""
from pathlib import Path

import pytest

from conftest import GOLDENS, ROOT, needs_core

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
from oracle.layer import Layer  # noqa: E402  (the one NumPy layer, tests/oracle; tests/ is on the path: conftest.py)

from k3ref import layer_check  # noqa: E402


class StandInKDA(torch.nn.Module):
    """FLA's KimiDeltaAttention interface over the oracle (`mutant=` one of its mutants)."""

    mutant = None

    def __init__(self, hidden_size, expand_v, head_dim, num_heads, num_v_heads, mode, use_short_conv,
                 allow_neg_eigval, lower_bound, conv_size, conv_bias, layer_idx, norm_eps):
        super().__init__()
        D, H, HV, K = hidden_size, num_heads, num_v_heads, head_dim
        V = int(K * expand_v)
        self.p = {"H": H, "HV": HV, "K": K, "V": V, "conv_size": conv_size if use_short_conv else 0,
                  "activation": "silu", "qk_l2norm": True, "gate": "lower_bound" if lower_bound is not None else "softplus",
                  "lower_bound": lower_bound, "beta": "two_sigmoid" if allow_neg_eigval else "sigmoid",
                  "output_norm": True, "norm_eps": norm_eps}
        self.layer_idx = layer_idx
        lin = lambda o, i, bias=False: torch.nn.Linear(i, o, bias=bias)  # noqa: E731
        self.q_proj, self.k_proj, self.v_proj = lin(H * K, D), lin(H * K, D), lin(HV * V, D)
        self.b_proj, self.o_proj = lin(HV, D), lin(D, HV * V)
        self.f_proj = torch.nn.Sequential(lin(V, D), lin(HV * K, V))
        self.g_proj = torch.nn.Sequential(lin(V, D), lin(HV * V, V, True))
        for n, c in (("q", H * K), ("k", H * K), ("v", HV * V)):
            if use_short_conv:
                setattr(self, f"{n}_conv1d", torch.nn.Conv1d(c, c, conv_size, groups=c, bias=conv_bias))
        self.A_log = torch.nn.Parameter(torch.zeros(HV))
        self.dt_bias = torch.nn.Parameter(torch.zeros(HV * K))
        self.o_norm = torch.nn.Module()
        self.o_norm.weight = torch.nn.Parameter(torch.ones(V))

    def _weights(self):
        w = lambda m: m.weight.detach().double().numpy()  # noqa: E731
        t = {"q_proj": w(self.q_proj), "k_proj": w(self.k_proj), "v_proj": w(self.v_proj), "b_proj": w(self.b_proj),
             "o_proj": w(self.o_proj), "f_a": w(self.f_proj[0]), "f_b": w(self.f_proj[1]), "g_a": w(self.g_proj[0]),
             "g_b": w(self.g_proj[1]), "g_bias": self.g_proj[1].bias.detach().double().numpy(),
             "A_log": self.A_log.detach().double().numpy(), "dt_bias": self.dt_bias.detach().double().numpy(),
             "norm_weight": self.o_norm.weight.detach().double().numpy()}
        for n in ("q", "k", "v"):
            conv = getattr(self, f"{n}_conv1d", None)
            if conv is not None:
                t[f"{n}_conv"] = conv.weight.detach().double().numpy()[:, 0, :]
                if conv.bias is not None:
                    t[f"{n}_conv_bias"] = conv.bias.detach().double().numpy()
        return t

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, use_cache=False, cu_seqlens=None):
        layer = Layer(self._weights(), self.p, self.mutant)
        x = hidden_states.double().numpy()
        B, T, D = x.shape
        if cu_seqlens is not None and not (self.mutant == "mask_overrides_cu_seqlens" and attention_mask is not None):
            cu = cu_seqlens.tolist()
            docs = [(0, list(range(cu[n], cu[n + 1]))) for n in range(len(cu) - 1)]
        else:
            docs = [(b, [s for s in range(T) if attention_mask is None or attention_mask[b, s] != 0]) for b in range(B)]
        last = past_key_values[self.layer_idx] if past_key_values is not None and len(past_key_values) else None
        y = np.zeros((B, T, D))
        finals, convs = [], []
        for n, (b, rows) in enumerate(docs):
            S0 = (last["recurrent_state"][n].double().transpose(-1, -2).numpy() if last else
                  np.zeros((layer.HV, layer.K, layer.V)))
            if last and layer.W:
                w0 = torch.cat([c[n, :, 1:] for c in last["conv_state"]]).double().numpy()
            else:
                w0 = np.zeros((layer.C, layer.M))
            yn, S, _, conv, _ = layer.document(x[b, rows], S0, w0)
            y[b, rows] = yn
            finals.append(torch.from_numpy(S).transpose(-1, -2))
            convs.append(torch.from_numpy(np.concatenate([np.zeros((layer.C, 1)), conv], 1)))
        if past_key_values is not None and use_cache:
            conv = torch.stack(convs)
            split = [layer.H * layer.K, layer.H * layer.K, layer.HV * layer.V]
            past_key_values.update(layer_idx=self.layer_idx, recurrent_state=torch.stack(finals).float(),
                                   conv_state=tuple(torch.split(conv, split, 1)) if layer.W else None)
        return torch.from_numpy(y).to(hidden_states.dtype), None, past_key_values


def adapter(mutant=None):
    cls = type("StandIn", (StandInKDA,), {"mutant": mutant})
    return layer_check.FLALayer(cls, "cpu", torch.float64)


@needs_core
def test_the_stand_in_passes_every_golden_fla_expresses():
    rows = layer_check.check_goldens(adapter(), str(GOLDENS))
    judged = [r for r in rows if r["status"] != "not applicable"]
    assert {r["case"] for r in judged} >= {"kda_layer_fla_b2", "kda_layer_gva_varlen_states", "kda_layer_padding_mask",
                                           "kda_layer_all_ones_mask_with_cu_seqlens", "kda_layer_decode_gva_pad_lane",
                                           "kda_layer_verify_in_place", "kda_layer_torchtitan_b2"}, rows
    assert all(r["status"] == "pass" for r in judged), [r for r in judged if r["status"] != "pass"]
    # The same definition in float64, the states through FLA's fp32 cache: the fp32 rounding,
    # 2^-24 / 2^-9 = 2^-15 of a bf16 floor, is the error (measured 1.99e-5; bound 2^-14).
    assert max(v for r in judged for v in r["ratios"].values()) < 2**-14
    skipped = {r["case"]: r["reason"] for r in rows if r["status"] == "not applicable"}
    assert "f_rank" in skipped["kda_layer_no_conv_full_rank"]


@needs_core
def test_the_self_checks_pass_on_the_stand_in():
    rows = layer_check.fla_self_checks(adapter(), lengths=(9, 1, 12))
    by = {r["check"]: r for r in rows}
    assert {c: by[c]["status"] for c in ("isolation", "mask_cu", "decode", "verify", "rows")} == dict.fromkeys(
        ("isolation", "mask_cu", "decode", "verify", "rows"), "pass"), rows
    assert by["mask_cu"]["all_ones_mask_with_cu"]["bitwise"] and by["rows"]["changed_row_differs"]
    assert by["pools"]["status"] == "not applicable"


@needs_core
@pytest.mark.parametrize("mutant,catcher", [("mask_overrides_cu_seqlens", "mask_cu"), ("conv_state_dropped", "decode"),
                                            ("gate_not_repeated", None), ("gate_before_norm", None)])
def test_each_layer_mutant_is_caught(mutant, catcher):
    golden = {r["case"]: r["status"] for r in layer_check.check_goldens(adapter(mutant), str(GOLDENS))}
    assert "fail" in golden.values(), golden
    if catcher:  # the defects a layer shows against itself, with no golden
        by = {r["check"]: r for r in layer_check.fla_self_checks(adapter(mutant), lengths=(9, 1, 12))}
        assert by[catcher]["status"] == "fail", by[catcher]


def test_the_figures_of_a_pair():
    a = torch.tensor([1.0, 2.0, 3.0])
    same = layer_check.pair_verdict({"x": (a, a.clone())}, exact=True)
    assert same["passed"] and same["bitwise"] and same["worst_floors"] == 0
    off = layer_check.pair_verdict({"x": (a + 1, a)})
    assert not off["passed"] and off["worst_floors"] > 100


def test_the_torchtitan_adapter_names_what_its_model_defines():
    """torchtitan's model does not import here (torch 1.13): its source is read instead, so a
    renamed parameter or config field is caught before a GPU run."""
    import ast
    import os
    src = Path(os.environ.get("K3REF_TORCHTITAN_PATH", ROOT / ".thirdparty" / "torchtitan")) / "torchtitan" / "models" / "kimi_k3" / "model.py"
    if not src.exists():
        pytest.skip(f"no torchtitan checkout ({src})")
    tree = ast.parse(src.read_text())
    classes = {c.name: c for c in tree.body if isinstance(c, ast.ClassDef)}
    fields = {n.target.id for n in classes["KimiK3Config"].body if isinstance(n, ast.AnnAssign)}
    init = next(f for f in classes["KimiDeltaAttention"].body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    attrs = {n.attr for n in ast.walk(init) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)}
    from k3ref import goldens
    case = goldens.load_case("kda_layer_torchtitan_b2", str(GOLDENS))
    assert layer_check.TorchtitanLayer.expresses(case.params) is None
    assert set(layer_check.TorchtitanLayer.config_fields(case.params)) <= fields
    for p in (case.params, {**case.params, "g_rank": 0}):
        modules = {n.split(".")[0] for n in layer_check.TorchtitanLayer.weights(case.tensors, p)}
        assert modules | {"A_log", "dt_bias"} <= attrs, modules - attrs


@needs_core
def test_the_command_writes_rows_and_a_measurement_that_renders(tmp_path, monkeypatch, capsys):
    import importlib.util
    import json
    monkeypatch.setattr(layer_check, "import_fla", lambda path: (StandInKDA, None))

    class F64(layer_check.FLALayer):  # the stand-in computes in float64: give it float64 inputs
        def __init__(self, source, device, dtype):
            super().__init__(source, device, torch.float64)

    monkeypatch.setattr(layer_check, "FLALayer", F64)
    out = tmp_path / "measurements"
    out.mkdir()
    rc = layer_check.main(["--layer", "fla", "--device", "cpu", "--json", str(tmp_path / "rows.json"),
                           "--measurement", str(out / "cpu_layers.json")])
    assert rc == 0
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert {r["check"] for r in rows} == {"golden", "isolation", "mask_cu", "decode", "verify", "rows", "pools"}
    spec = importlib.util.spec_from_file_location("render_measurements", ROOT / "tools" / "render_measurements.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    table = render.render_table(render.load_measurements(tmp_path)["cpu_layers"], "layers")
    assert "`kda_layer_fla_b2`" in table and "not applicable" in table
    assert "fla" in capsys.readouterr().out.splitlines()[-1]


def test_the_gloo_shim_hands_fla_s_stacked_gather_over_as_a_concatenation():
    """FLA's CP exchange gathers (3, 128) tails into a (world, 3, 128) output; gloo takes only
    the (world * 3, 128) concatenation. The shim passes a view of the same memory, and leaves
    an output already concatenated alone."""
    calls = []

    class FakeDist:
        @staticmethod
        def all_gather_into_tensor(out, inp, group=None, async_op=False):
            calls.append(tuple(out.shape))
            out.copy_(torch.cat([inp, inp + 1]))
            return "work" if async_op else None

    layer_check._gloo_accepts_stacked_all_gather(FakeDist)
    tails = torch.arange(6.0).reshape(3, 2)
    stacked = torch.empty(2, 3, 2)
    assert FakeDist.all_gather_into_tensor(stacked, tails, async_op=True) == "work"
    assert calls == [(6, 2)]
    assert torch.equal(stacked[0], tails) and torch.equal(stacked[1], tails + 1)
    flat = torch.empty(6, 2)
    FakeDist.all_gather_into_tensor(flat, tails)
    assert calls[-1] == (6, 2) and torch.equal(flat[3:], tails + 1)
