"""Host-side test of the scale tier (k3ref/gpu_check/scale.py) on a CPU PyTorch, at limits
scaled down (2^12 elements for 2^31, 64 grid pairs for 65,535, 64-token windows for 4,096):
the tier's own code (cases, slices, poisoning, windows, verdicts) as it runs on the H200, run
as the tier runs: through the pytest plugin (`--k3ref-tier scale`, a planning child and
pytest-xdist workers), its record the scale.json the session's end writes.

The four scale mutants of libk3gc have CPU forms here (the PyTorch recurrence with the same
mistake, at a given limit). At the scaled limits the tier catches each of them, each in the
case built for it, while the correct kernel passes every case; at the real limits the
default tier (golden and metamorphic checks) runs them and they all pass: it cannot reach
the sizes where they break. On the GPU, gpu_check/device_scale.sh shows both for the CUDA
mutants. Skipped without torch or k3ref._core.
"""
import json
import math
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from k3ref import goldens  # noqa: E402
from k3ref.gpu_check import checks, references, scale  # noqa: E402
from k3ref.gpu_check.adapters import HostReferenceAdapter  # noqa: E402
from scale_standins import TILE, StandIn  # noqa: E402

if references._module() is None:
    pytest.skip("k3ref._core is not importable", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
SMALL = scale.Limits(index=2**12, grid=64, long_T=256, window=64, H=1, HV=2, K=8, V=8, packed_T=256, doc_max=8,
                     index_doc=40, chunk=16, sample_heads=2, contract_tokens=128, threads=2, grad_T=200)
SUITE = goldens.load_suite(ROOT / "goldens", ops=("kda.recurrent",))


SMALL_TEXT = ",".join(f"{k}={v}" for k, v in asdict(SMALL).items())  # $K3REF_SCALE_LIMITS of SMALL


def _tier(tmp, *args, child_env, run_pytest, timeout=300):
    """`pytest --k3ref-tier scale ARGS` on the CPU at SMALL, the stand-ins given (a child, in
    `tmp`): (the CompletedProcess, scale.json or None, {test id: JUnit outcome})."""
    out = tmp / "out"
    r = run_pytest("--k3ref-tier", "scale", "--k3ref-adapter", "scale_standins:tier_standins", "--k3ref-device", "cpu",
                   "--k3ref-goldens", ROOT / "goldens", "--k3ref-report", out, "--junitxml", tmp / "j.xml", "-q",
                   *args, cwd=tmp, env=child_env(K3REF_SCALE_LIMITS=SMALL_TEXT), timeout=timeout)
    data = json.loads((out / "scale.json").read_text()) if (out / "scale.json").is_file() else None
    outcomes = {}
    if (tmp / "j.xml").is_file():
        for case in ET.parse(tmp / "j.xml").getroot().iter("testcase"):
            kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
            outcomes[case.get("name")] = kinds[0] if kinds else "passed"
    return r, data, outcomes


STANDINS = ["standin"] + [f"standin.{m}" for m in scale.lib.SCALE_MUTANTS]


@pytest.fixture(scope="module")
def tier_run(tmp_path_factory, child_env, run_pytest):
    """The scale tier through the pytest plugin (planning child, one pytest-xdist worker) on the
    correct stand-in and the four mutants' at SMALL, the reference its CPU one (k3ref.double)."""
    t0 = time.time()
    r, data, outcomes = _tier(tmp_path_factory.mktemp("scale_tier"), "--k3ref-only", ",".join(STANDINS),
                              child_env=child_env, run_pytest=run_pytest)
    print(f"the small tier through pytest: {time.time() - t0:.1f} s")
    return r, data, outcomes


@pytest.fixture(scope="module")
def small_run(tier_run):
    r, data, _ = tier_run
    assert data is not None, r.stdout[-3000:] + r.stderr[-3000:]
    return data


def _rows(result, kernel):
    return {r["case"]: r for r in result["results"] if r["kernel"] == kernel}


def test_the_correct_kernel_passes_every_case_and_the_reference_every_golden(small_run):
    rows = _rows(small_run, "standin")
    assert set(rows) == set(scale.CASE_FUNCTIONS)
    for case, r in rows.items():
        assert r["verdict"] == "pass", (case, r["reason"])
        if case == "gradients":  # fp64 autograd, each gradient rounded once to its leaf's dtype: its floor
            assert r["policy"] == "chunk" and r["ratio"] < 1, r
            assert set(r["tensors"]) == {"dq", "dk", "dv", "dg", "dbeta", "d_initial_state", "dA_log", "ddt_bias"}
            for name, m in r["tensors"].items():
                assert m["figure"] <= m["floor"] * (1 + 1e-3), (name, m)
            continue
        assert r["ratio"] == pytest.approx(1.0, rel=1e-6), (case, r["ratio"])  # the recurrence rounded once: the floor
    ref = _rows(small_run, "k3ref.double")["reference_vs_goldens"]
    in_domain = [c for c in SUITE if HostReferenceAdapter().case_unsupported(c) is None]
    # double against 256 bits: 4.5e-16 measured at worst
    assert ref["verdict"] == "pass" and ref["goldens"] == len(in_domain) and ref["figure"] <= 1e-15, ref["reason"]


EXPECTED_CATCH = {"int32_offset_wrap": "index_limit", "grid_drops_sequences": "many_sequences",
                  "last_chunk_read_past_end": "ragged_tail", "bf16_state_long_t": "long_sequence"}


@pytest.mark.parametrize("mutant", scale.lib.SCALE_MUTANTS)
def test_each_scale_mutant_is_caught_by_its_case(small_run, mutant):
    rows = _rows(small_run, f"standin.{mutant}")
    caught = sorted(c for c, r in rows.items() if r["verdict"] in ("fail", "error"))
    assert EXPECTED_CATCH[mutant] in caught, (mutant, {c: r["reason"][:200] for c, r in rows.items()})
    assert small_run["summary"]["mutants"][f"standin.{mutant}"] == "caught"


def test_the_tier_is_one_pytest_test_per_kernel_and_case_and_its_hook_writes_scale_json(tier_run):
    r, data, outcomes = tier_run
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
    cases = list(scale.CASE_FUNCTIONS)
    ids = (["k3ref.double-reference_vs_goldens-scale"] + [f"{k}-{c}-scale" for k in STANDINS for c in cases]
           + [f"standin.{m}-scale-caught" for m in scale.lib.SCALE_MUTANTS])
    # every test passed: the correct kernel's cases, the reference's, each mutant's cases (a
    # case that catches a mutant does not fail the run) and each mutant's `caught`
    # but the mutants' gradients case: they have no backward (n/a, a skip)
    assert outcomes == {i: "skipped" if i.endswith("-gradients-scale") and i.startswith("standin.") else "passed"
                        for i in ids}, outcomes
    assert data["tier"] == "scale" and data["limits"] == asdict(SMALL) and data["device"] == "cpu"
    assert [(d["kernel"], d["case"]) for d in data["results"]] == (
        [("k3ref.double", "reference_vs_goldens")] + [(k, c) for k in STANDINS for c in cases])
    assert data["summary"]["verdict"] == "PASS" and data["summary"]["failures"] == []
    assert data["wall_s"] > 0
    for d in data["results"]:
        if d["case"] != "reference_vs_goldens" and d["verdict"] != "skip":
            assert d["tensors"] and "figure" in d and "bound" in d and d["seconds"] > 0, d  # per tensor, the worst
    assert scale.table(data["results"]).splitlines()[1].startswith("k3ref.double")
    assert "k3ref scale tier" in r.stdout and scale.table(data["results"]).splitlines()[0] in r.stdout
    for m in scale.lib.SCALE_MUTANTS:
        line = next((l for l in r.stdout.splitlines() if l.startswith(f"mutant standin.{m}: caught by ")), "")
        assert EXPECTED_CATCH[m] in line.partition(" by ")[2].split(", "), r.stdout[-3000:]
    assert "scale tier: PASS" in r.stdout


def test_an_uncaught_mutant_fails_its_caught_test_and_a_crash_is_a_catch(tmp_path, child_env, run_pytest):
    # ragged_tail alone: the bf16-state mutant (wrong past 64 tokens) is not caught; the
    # `exits` mutant ends its worker in the case, which pytest-xdist replaces: a catch.
    r, data, outcomes = _tier(tmp_path, "--k3ref-adapter", "scale_standins:exiting_mutant", "--k3ref-only",
                              "standin.bf16_state_long_t,standin.exits", "--k3ref-cases", "ragged_tail",
                              child_env=child_env, run_pytest=run_pytest)
    assert r.returncode == 1, r.stdout[-4000:] + r.stderr[-3000:]
    assert outcomes == {"standin.bf16_state_long_t-ragged_tail-scale": "passed",
                        "standin.bf16_state_long_t-scale-caught": "failure",
                        "standin.exits-ragged_tail-scale": "passed", "standin.exits-scale-caught": "passed"}, outcomes
    s = data["summary"]
    assert s["mutants"] == {"standin.bf16_state_long_t": "missed", "standin.exits": "caught"}, s
    assert s["mutant_catches"]["standin.exits"] == ["ragged_tail"] and s["verdict"] == "FAIL"
    rows = {d["kernel"]: d for d in data["results"]}
    assert rows["standin.bf16_state_long_t"]["verdict"] == "pass"
    assert rows["standin.exits"]["verdict"] == "error" and "worker process" in rows["standin.exits"]["reason"]
    assert "NOT CAUGHT by any of the 1 scale cases that ran" in r.stdout, r.stdout[-3000:]
    assert "mutant standin.bf16_state_long_t: missed" in r.stdout and "scale tier: FAIL" in r.stdout


def test_run_tier_scale_is_a_front_end_of_the_plugin_and_minus_k_selects(tmp_path, child_env, gpu_check):
    out = tmp_path / "o"
    r = gpu_check("run", "--tier", "scale", "--adapter", "scale_standins:tier_standins", "--only",
                  "standin,standin.bf16_state_long_t", "--device", "cpu", "--out", out, "--", "-k", "long_sequence",
                  cwd=tmp_path, env=child_env(K3REF_SCALE_LIMITS=SMALL_TEXT))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads((out / "scale.json").read_text())
    assert [(d["kernel"], d["case"], d["verdict"]) for d in data["results"]] == [
        ("standin", "long_sequence", "pass"), ("standin.bf16_state_long_t", "long_sequence", "fail")]
    assert data["summary"]["mutants"] == {"standin.bf16_state_long_t": "caught"}
    names = sorted(c.get("name") for c in ET.parse(out / "report.xml").getroot().iter("testcase"))
    assert names == ["standin-long_sequence-scale", "standin.bf16_state_long_t-long_sequence-scale"]
    assert "2 passed" in r.stdout and "scale tier: PASS" in r.stdout  # the workers deselect the other 10


def test_an_unknown_scale_case_is_a_usage_error_naming_the_valid_ones(tmp_path, child_env, run_pytest, gpu_check):
    r = run_pytest("--k3ref-tier", "scale", "--k3ref-device", "cpu", "--k3ref-cases", "nope", "-q", cwd=tmp_path)
    assert r.returncode == 4, r.stdout[-2000:] + r.stderr[-2000:]
    line = next(l for l in r.stderr.splitlines() if "nope" in l)
    assert "unknown scale case 'nope'" in line and all(c in line for c in scale.CASES), r.stderr
    r = gpu_check("run", "--tier", "scale", "--device", "cpu", "--cases", "nope", "--out", tmp_path / "o", cwd=tmp_path)
    assert r.returncode == 2 and "unknown scale case 'nope'" in r.stderr, r.stderr[-2000:]
    assert all(c in r.stderr for c in scale.CASES)


def test_the_ragged_case_fails_exactly_the_residues_the_read_past_mutant_reads_poison_at(small_run):
    r = _rows(small_run, "standin.last_chunk_read_past_end")["ragged_tail"]
    # T = 16 + r: its last 16-token tile holds r tokens (16 when r = 0); 1..8 are loaded whole.
    assert r["failing_residues"] == list(range(1, TILE // 2 + 1)), r["reason"]


def test_the_index_case_judges_the_straddling_documents():
    cu, judged = scale.index_layout(scale.FULL.H, scale.FULL.HV, scale.FULL)
    per_token = scale.FULL.HV * scale.FULL.K
    boundary = 2**31 // per_token  # 262,144 tokens
    straddle = judged[2]
    assert cu[straddle] < boundary < cu[straddle + 1]
    assert judged == [0, straddle - 1, straddle, len(cu) - 2] and (len(cu) - 2) == straddle + 1
    assert cu[-1] * per_token > 2**31 and (cu[-1] * scale.FULL.H * scale.FULL.K) < 2**31  # GVA: q, k stay below
    assert cu[-1] * per_token * 2 / 1e9 < 4.5  # bf16 v (and g, o): 4.4 GB each


def test_a_window_beyond_its_bound_fails_and_is_named():
    gen = torch.Generator().manual_seed(0)
    ref = torch.rand((1, 256, 2, 8), generator=gen, dtype=torch.float64) + 0.5
    cand = ref.to(torch.bfloat16)
    ok = scale.judge_tensor("o", cand, ref, "floor:1.5", window=64)
    assert ok.ok and ok.ratio == pytest.approx(1.0) and len(ok.window_ratios) == 4
    worse = cand.clone()
    worse[:, 130] = (ref[:, 130] * 1.05).to(torch.bfloat16)  # 5 % on one token of window 2
    v = scale.judge_tensor("o", worse, ref, "floor:1.5", window=64)
    assert not v.ok and v.worst_window == 2 and "worst window 2 (tokens 128-191)" in v.reason
    nan = cand.clone()
    nan[0, 255, 1, 7] = float("nan")
    v = scale.judge_tensor("o", nan, ref, "floor:1.5")
    assert not v.ok and v.nonfinite == 1 and "non-finite" in v.reason


def test_sampled_heads_are_the_recurrence_of_those_heads_alone():
    inputs, params = scale.make_inputs(40, 2, 6, scale.replace(SMALL, HV=6, H=2), 3, "cpu")
    heads = scale.sampled_heads(inputs, 6, 2)
    assert heads == [0, 5]
    o, f = references.module_reference(inputs, params)
    so, sf = references.module_reference(scale.head_slice(inputs, heads), params)
    assert torch.equal(so, o[:, :, heads]) and torch.equal(sf, f[:, heads])


def test_the_default_tier_misses_the_scale_mutants_at_the_real_limits():
    for mutant in scale.lib.SCALE_MUTANTS:
        a = StandIn(mutant, scale.FULL)
        results = checks.run_all([a], SUITE, "cpu")
        ran = [r for r in results if r.status != "skip"]
        assert len(ran) == len([c for c in SUITE if a.case_unsupported(c) is None]) + len(checks.METAMORPHIC)
        bad = [(r.check, r.case, r.reason[:200]) for r in ran if r.status != "pass"]
        assert not bad, (mutant, bad)
        assert not math.isnan(sum(r.ratio or 0.0 for r in ran))


def test_a_kernel_with_a_contract_is_judged_by_it_on_the_sampled_heads():
    a = StandIn(None, SMALL)
    a.contract_name = "fla_recurrent"  # its contract: the fp32 recurrence, bf16 output (1.0x the floor)
    rows = {c: scale.run_case(a, c, SMALL, "cpu") for c in ("long_sequence", "packed_documents")}
    for case, r in rows.items():
        assert r.status == "pass", (case, r.reason)
        o = r.metrics["o"]
        assert o["multiple"] == 1.5 and 0 < o["contract"] and o["bound"] == 1.5 * max(o["floor"], o["contract"])
    # one sequence of 256 tokens, the contract on its first 128: windows 2 and 3 take the larger of 0 and 1
    inputs, params = scale.make_inputs(SMALL.long_T, SMALL.H, SMALL.HV, SMALL, 11, "cpu")
    ref_o, ref_f = scale.reference(inputs, params, "cpu")
    c_o, c_f, c_w = scale.contract_errors(a, inputs, params, ref_o, ref_f, SMALL, window=SMALL.window)
    assert len(c_w) == 4 and c_w[2] == c_w[3] == max(c_w[:2]) and min(c_w) > 0 and c_f > 0
    assert len(rows["long_sequence"].metrics["o"]["window_ratios"]) == 4


def test_the_fla_adapter_runs_the_tier_with_its_contract():
    # FLA's adapter class itself (keywords, the version probe, its own output allocation, the
    # chunk contract on the sampled heads) around a CPU stand-in of chunk_kda with GVA.
    from test_probe import StandInFla, fla_current

    a = StandInFla(fla_current)
    a.contract_name, a.policy = "fla_chunk", "chunk"
    L = scale.replace(SMALL, H=1, HV=4)
    rows = {c: scale.run_case(a, c, L, "cpu") for c in scale.CASE_FUNCTIONS}
    assert a.gva is True and set(rows) == set(scale.CASE_FUNCTIONS)
    for case, r in rows.items():
        assert r.status == "pass", (case, r.reason)
        assert r.extra["H"] == 1 and r.extra["HV"] == 4
        if case != "gradients":  # judged by its backward policy's bounds, not a multiple
            assert all(m["multiple"] == 2.0 for m in r.metrics.values())  # fla-chunk-contract: m = 2 for o and states


def test_limits_from_text():
    L = scale.limits_from("HV=16, long_T=0x4000")
    assert (L.HV, L.long_T, L.index) == (16, 16384, 2**31)
    with pytest.raises(ValueError, match="unknown name 'hv'"):
        scale.limits_from("hv=16")
    with pytest.raises(ValueError, match="long_T='big' is not an integer"):
        scale.limits_from("long_T=big")
    # A run's limits come from its options (--k3ref-scale-limits, else $K3REF_SCALE_LIMITS).
    from k3ref.gpu_check.protocol import RunOptions, UsageError

    assert scale.limits_of(RunOptions()) == scale.FULL
    assert scale.limits_of(RunOptions(scale_limits="HV=16")).HV == 16
    with pytest.raises(UsageError, match="--k3ref-scale-limits 'hv=16': unknown name 'hv'"):
        scale.limits_of(RunOptions(scale_limits="hv=16"))


def test_a_tier_in_which_nothing_ran_fails():
    a = StandIn(None, SMALL)
    skipped = [scale.CheckResult(a.name, "scale", c, "skip", "not available: no CUDA device") for c in scale.CASE_FUNCTIONS]
    s = scale.summarize(skipped, {a.name: a.kind})
    assert s["verdict"] == "FAIL" and s["failures"] == ["no kernel ran a case: nothing is vouched for"]
    asked = scale.summarize(skipped + [scale.CheckResult(a.name, "scale", "x", "pass", "")], {a.name: a.kind},
                            asked={a.name})
    assert asked["verdict"] == "FAIL" and len(asked["failures"]) == len(skipped)  # asked for, not available


def test_the_bf16_state_mutant_at_k3_head_size_exceeds_the_window_bound():
    # Its CPU form at K = V = 128 on the tier's gates, one sequence of 8,192 tokens (2 heads):
    # windows before token 4,096 are the floor itself, those after 1.87x-1.92x the floor
    # (measured), above the fp32 kernel's 1.5x: the long_sequence case's windows catch it.
    L = scale.replace(scale.FULL, H=1, HV=2)
    inputs, params = scale.make_inputs(8192, 1, 2, L, 11, "cpu")
    ref_o, _ = references.module_reference(inputs, params)
    o, _ = StandIn("bf16_state_long_t", scale.FULL).run(inputs, params)
    v = scale.judge_tensor("o", o, ref_o, "floor:1.5", window=1024)
    assert [round(r, 6) for r in v.window_ratios[:4]] == [1.0] * 4, v.window_ratios
    assert min(v.window_ratios[4:]) > 1.85 and not v.ok, v.window_ratios
