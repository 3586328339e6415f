#!/usr/bin/env python3
"""`k3ref compare` (C++) and the Python judge (k3ref.policy) on the same files: the same
verdict, the same reason and the same figures, bit for bit (both sum in index order), for
candidates made from the committed goldens by rounding, perturbing, dropping and renaming
their outputs, and for a correct fp32 kernel whose final state is fp32 (judged at the
contract's bf16 floor, not the fp32 floor of its storage). Also each fail-closed rule of
the command: its exit code and its one-line message. Skips (exit 77) without torch.
The GPU harness's golden verdict is checked against compare's too (HarnessParity).
Usage: policy_parity_test.py SOURCE_ROOT K3REF_EXE"""
import json
import struct
import subprocess
import sys
import tempfile
import unittest
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2]
EXE = sys.argv[2] if len(sys.argv) > 2 else "k3ref"
try:
    import torch
except ImportError:
    print("torch is not importable: skipped")
    sys.exit(77)
sys.path.insert(0, str(ROOT / "python"))
from k3ref import goldens, policy  # noqa: E402

TMP = Path(tempfile.mkdtemp(prefix="k3ref_policy_parity_"))
_CODES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
          torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8"}


# A golden-like file of two outputs, with the metadata of the golden schema (docs/golden-format.md):
# no inputs, both tensors outputs, the recurrent policy recommended.
RECURRENT_GOLDEN_METADATA = {"k3ref.schema": "2", "k3ref.op": "kda.recurrent", "k3ref.params": "{}",
                             "k3ref.inputs": "", "k3ref.outputs": "o,final_state", "k3ref.layout": "",
                             "k3ref.policies": json.dumps({"o": "recurrent", "final_state": "recurrent"})}


def write_candidate(name, tensors, metadata=None):
    """A kernel's output file (safetensors: u64 header length, JSON header, data), as any
    writer makes it; k3ref only reads candidates. `metadata` makes a golden-like file."""
    header, blobs, offset = ({"__metadata__": metadata} if metadata else {}), [], 0
    for key, t in tensors.items():
        t = t.detach().contiguous()
        raw = t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t
        data = raw.numpy().tobytes()
        header[key] = {"dtype": _CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path = TMP / f"{name}.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    return path


def fp32_recurrence(case):
    """A correct kernel: the KDA recurrence in fp32 arithmetic on the golden's bf16 inputs
    (log-decay gate, K-first state, no varlen), bf16 o and an fp32 final state."""
    t, p = case.tensors, case.params
    q, k, v, g, beta = (t[n].float() for n in ("q", "k", "v", "g", "beta"))
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    assert p["gate"] == "log_decay" and p["beta"] == "as_given" and not p["qk_l2norm"] and H == HV
    assert p["state_layout"] == "k_first" and p["cu_seqlens"] is None
    scale = K ** -0.5 if p["scale"] is None else p["scale"]
    o = torch.zeros(B, T, HV, V)
    S = t["initial_state"].float().clone() if "initial_state" in t else torch.zeros(B, HV, K, V)
    for i in range(T):
        S = S * torch.exp(g[:, i]).unsqueeze(-1)
        u = v[:, i] - torch.einsum("bhk,bhkv->bhv", k[:, i], S)
        S = S + beta[:, i].reshape(B, HV, 1, 1) * k[:, i].unsqueeze(-1) * u.unsqueeze(2)
        o[:, i] = torch.einsum("bhk,bhkv->bhv", q[:, i] * scale, S)
    return {"o": o.to(torch.bfloat16), "final_state": S}


def compare(golden, candidate, pol, *extra):
    out_json, out_xml = TMP / "verdict.json", TMP / "verdict.xml"
    for f in (out_json, out_xml):
        f.unlink(missing_ok=True)
    r = subprocess.run([EXE, "compare", "--golden", str(golden), "--candidate", str(candidate), "--policy", pol,
                        "--json", str(out_json), "--junit", str(out_xml), *extra], capture_output=True, text=True)
    return r, json.loads(out_json.read_text()), ET.parse(out_xml).getroot()


def judge(golden, candidate_path, pol, tensors=None):
    case = goldens.load_case(golden, reader="k3ref")
    cand, _ = goldens.read_tensors(candidate_path, reader="k3ref")
    return policy.judge_case(case, cand, pol, tensors=tensors)


def g(name):
    return ROOT / "goldens" / f"{name}.safetensors"


class Parity(unittest.TestCase):
    def assert_same(self, golden, candidate, pol, tensors=None):
        """C++ and Python agree on everything; returns the Python verdict."""
        extra = ["--tensors", ",".join(tensors)] if tensors else []
        run, doc, xml = compare(golden, candidate, pol, *extra)
        v = judge(golden, candidate, pol, tensors)
        mine = v.to_dict()
        self.assertEqual(run.returncode, v.exit_code, run.stdout + run.stderr)
        for key in ("op", "policy", "policy_table_version", "verdict", "exit_code", "reason"):
            self.assertEqual(doc[key], mine[key], key)
        self.assertEqual([t["tensor"] for t in doc["tensors"]], [t["tensor"] for t in mine["tensors"]])
        for cpp, py in zip(doc["tensors"], mine["tensors"]):
            self.assertEqual(cpp, py, f"{golden.name} {candidate.name} {pol} tensor {cpp['tensor']}")
        suite = xml.find("testsuite")
        self.assertEqual(int(suite.get("failures")) + int(suite.get("errors")) > 0, v.exit_code != 0)
        return v

    def test_fp32_final_state_passes_recurrent_on_three_goldens(self):
        # The reported defect: judged at the fp32 floor of its storage, this correct kernel's
        # state (1.8x-2.6x that floor) failed --policy recurrent on 3 of 3 goldens.
        for name in ("kda_b2_t37", "kda_t100", "kda_k128_t65"):
            case = goldens.load_case(g(name), reader="k3ref")
            cand = write_candidate(f"fp32_{name}", fp32_recurrence(case))
            v = self.assert_same(g(name), cand, "recurrent")
            self.assertEqual(v.exit_code, 0, v.reason)
            fs = v["final_state"]
            self.assertEqual((fs.floor_dtype, fs.candidate_dtype), ("bf16", "F32"))
            # fp32 arithmetic: far inside the bf16 floor. Was 1e-3: measured worst 3.76e-5 over the
            # 3 goldens (2026-12-01); bound 4x (3.99x).
            self.assertLess(fs.ratio, 1.5e-4)
            # o rounded once to bf16: at the floor. Was 1.01: measured worst 1 + 4.50e-13 over the
            # 3 goldens (2026-12-01); bound 4x on ratio - 1 (3.78x).
            self.assertLess(v["o"].ratio, 1 + 1.7e-12)
            # Against the fp32 floor it is what the old command measured: over 1.5x.
            over = policy.judge_case(case, {"final_state": fp32_recurrence(case)["final_state"]}, "recurrent",
                                     tensors=["final_state"], table=_fp32_state_table())
            self.assertEqual(over.exit_code, 1, over.reason)
            # measured least 2.09 over the 3 goldens (2026-12-01): within 4x (1.39x)
            self.assertGreater(over["final_state"].ratio, 1.5)

    def test_rounded_and_perturbed_outputs_of_every_family(self):
        cases = [("kda_varlen_gva", "recurrent"), ("kda_all_states", "chunk"), ("kcp_p2_docs", "recurrent"),
                 ("kda_chunkwise_fla_c64_t100", "chunk"), ("kda_chunkwise_flashkda_c16_b2_t37", "flashkda"),
                 ("kda_backward_b2_t37", "fla-test"), ("attnres_block_k3_like", "liger-attnres"),
                 ("qb_solver_m12_n4_k3", "qb-exact"), ("qb_online_m32_n8_k2", "qb-exact")]
        for name, pol in cases:
            case = goldens.load_case(g(name), reader="k3ref")
            floats = {n: t for n, t in case.expected.items() if t.is_floating_point()}
            ints = {n: t for n, t in case.expected.items() if not t.is_floating_point()}
            for label, factor, dtype in (("bf16", 1.0, torch.bfloat16), ("fp32", 1.0, torch.float32),
                                         ("off", 1.001, torch.float32), ("far", 1.05, torch.bfloat16)):
                tensors = {n: (t * factor).to(dtype) for n, t in floats.items()}
                tensors.update(ints)
                cand = write_candidate(f"{name}_{label}", tensors)
                v = self.assert_same(g(name), cand, pol)
                if label == "far":
                    self.assertEqual(v.exit_code, 1, f"{name}: 5% off must fail {pol}")
            # The same file under a parametric policy and exact.
            self.assert_same(g(name), cand, "floor:3")
            self.assertEqual(self.assert_same(g(name), cand, "exact").exit_code, 1)

    def test_nan_and_a_single_bad_element(self):
        case = goldens.load_case(g("kda_b2_t37"), reader="k3ref")
        o, f = case.expected["o"].clone(), case.expected["final_state"].clone()
        o[1, 17, 0, 5] += 0.25
        v = self.assert_same(g("kda_b2_t37"), write_candidate("one_bad", {"o": o, "final_state": f}), "recurrent")
        self.assertEqual(v["o"].worst_index, [1, 17, 0, 5])
        o[0, 3, 1, 2] = float("nan")
        v = self.assert_same(g("kda_b2_t37"), write_candidate("nan", {"o": o, "final_state": f}), "floor:1000")
        self.assertEqual(v.exit_code, 1)
        self.assertIn("NaN/Inf where the golden has none", v.reason)

    def test_a_golden_beyond_the_floor_dtype_fails_closed(self):
        # 3.398e38 rounds to bf16 infinity: the floor is infinite, and a floor rule would
        # pass anything; it fails instead (a rel-rms rule only reports the floor, as null).
        o = torch.tensor([3.398e38, 1, 2, 3, 4, 5, 6, 7], dtype=torch.float64).reshape(1, 2, 1, 4)
        s = torch.ones(1, 1, 2, 4, dtype=torch.float64)
        golden = write_candidate("overflow_golden", {"o": o, "final_state": s},
                                 RECURRENT_GOLDEN_METADATA)
        cand = write_candidate("overflow_candidate", {"o": o, "final_state": s})
        v = self.assert_same(golden, cand, "recurrent")
        self.assertEqual((v.exit_code, v.reason), (1, "o: the golden overflows bf16: its floor is infinite"))
        v = self.assert_same(golden, cand, "fla-test")
        self.assertEqual(v.exit_code, 0)
        self.assertIsNone(v["o"].to_dict()["floor"])

    def test_optional_stages_and_requested_tensors(self):
        case = goldens.load_case(g("kda_chunkwise_fla_c64_t100"), reader="k3ref")
        e = case.expected
        cand = write_candidate("chunk_outputs_only", {"o": e["o"].to(torch.bfloat16), "final_state": e["final_state"],
                                                      "L": e["L"] * 1.1})
        v = self.assert_same(g("kda_chunkwise_fla_c64_t100"), cand, "chunk")
        self.assertEqual(v.exit_code, 1)
        self.assertEqual(v["L"].status, "fail")
        self.assertEqual(v["INV"].status, "skipped")
        v = self.assert_same(g("kda_chunkwise_fla_c64_t100"), cand, "chunk", tensors=["o", "INV"])
        self.assertEqual(v.reason, "INV: missing from the candidate (a required stage)")


def _fp32_state_table():
    """The shipped table with final_state's contract dtype set to fp32 (what the candidate's
    storage dtype gave before): the figure the defect report saw."""
    data = json.loads(policy.table_path().read_text())
    data["operators"]["kda.recurrent"]["outputs"]["final_state"]["dtype"] = "fp32"
    return policy.PolicyTable(data, "fp32-state table")


class FailClosed(unittest.TestCase):
    """Each rule: exit code and one line on stderr naming the problem; the same from Python."""

    def run_rule(self, golden, tensors, pol="floor:2", extra=(), code=None, message=None):
        cand = write_candidate("rule", tensors)
        run = subprocess.run([EXE, "compare", "--golden", str(golden), "--candidate", str(cand), "--policy", pol,
                              *extra], capture_output=True, text=True)
        self.assertEqual(run.returncode, code, run.stdout + run.stderr)
        text = run.stderr if code == 2 else run.stdout
        self.assertIn(message, text)
        if code == 2:
            self.assertEqual(run.stderr.count("\n"), 1, run.stderr)
            self.assertEqual(run.stdout, "")
        tensors_arg = extra[1].split(",") if extra and extra[0] == "--tensors" else None
        self.assertIn(message, judge(golden, cand, pol, tensors_arg).reason)

    def test_backward_candidate_without_dg_dbeta_fails(self):
        e = goldens.load_case(g("kda_backward_b2_t37"), reader="k3ref").expected
        self.run_rule(g("kda_backward_b2_t37"), {n: e[n] for n in ("dq", "dk", "dv")}, "fla-test", code=1,
                      message="dg: missing from the candidate (a required gradient)")

    def test_missing_final_state_fails(self):
        e = goldens.load_case(g("kda_t100"), reader="k3ref").expected
        self.run_rule(g("kda_t100"), {"o": e["o"]}, "recurrent", code=1,
                      message="final_state: missing from the candidate (a required output)")

    def test_unknown_candidate_tensor_is_unusable(self):
        e = goldens.load_case(g("kda_t100"), reader="k3ref").expected
        self.run_rule(g("kda_t100"), {"o": e["o"], "final_sate": e["final_state"]}, code=2,
                      message="candidate tensor 'final_sate' is neither an output nor an input of the golden")

    def test_unknown_requested_tensor_policy_and_operator_coverage(self):
        e = goldens.load_case(g("kda_t100"), reader="k3ref").expected
        self.run_rule(g("kda_t100"), dict(e), extra=("--tensors", "o,h"), code=2,
                      message="no output 'h' in the golden (outputs: o, final_state)")
        self.run_rule(g("kda_t100"), dict(e), "nearly", code=2, message="unknown tolerance policy 'nearly'")
        self.run_rule(g("kda_t100"), dict(e), "qb-exact", code=2,
                      message="policy 'qb-exact' has no rules for operator 'kda.recurrent'")

    def test_shape_mismatch_is_unusable(self):
        e = goldens.load_case(g("kda_t100"), reader="k3ref").expected
        self.run_rule(g("kda_t100"), {"o": e["o"].transpose(1, 2), "final_state": e["final_state"]}, code=2,
                      message="o: shape [1, 1, 100, 64] differs from the golden's [1, 100, 1, 64]")

    def test_unusable_input_still_writes_reports(self):
        out = TMP / "unusable.json"
        run = subprocess.run([EXE, "compare", "--golden", str(g("kda_t100")), "--candidate", str(TMP / "absent"),
                              "--json", str(out)], capture_output=True, text=True)
        self.assertEqual(run.returncode, 2)
        self.assertEqual(json.loads(out.read_text())["verdict"], "unusable")


class TableParity(unittest.TestCase):
    """Both readers refuse the same malformed tables, naming the same entry in the same words."""

    MUTATIONS = {
        "version": lambda t: t.update(version=2),
        "unknown_key": lambda t: t.update(extra=1),
        "missing_rule": lambda t: t["policies"]["chunk"]["rules"]["kda.backward"].pop("dq"),
        "int_floor": lambda t: t["policies"]["qb-exact"]["rules"]["qb.solver"].update(loads={"metric": "floor", "multiple": 2}),
        "negative": lambda t: t["policies"]["recurrent"]["rules"]["kda.recurrent"]["output"].update(multiple=-1),
        "misplaced_bound": lambda t: t["policies"]["recurrent"]["rules"]["kda.recurrent"]["output"].update(bound=1),
        "metric": lambda t: t["policies"]["recurrent"]["rules"]["kda.recurrent"]["output"].update(metric="close"),
        "reserved": lambda t: t["policies"].update({"floor:3": {"rules": {}}}),
        "operator": lambda t: t["policies"]["recurrent"]["rules"].update({"kda.nothing": {}}),
        "dtype": lambda t: t["operators"]["kda.recurrent"]["outputs"]["o"].update(dtype="fp8"),
        "role": lambda t: t["operators"]["kda.recurrent"]["outputs"]["o"].update(role="result"),
        "version_bool": lambda t: t.update(version=True),
        "version_missing": lambda t: t.pop("version"),
        "operators_array": lambda t: t.update(operators=[]),
        "no_outputs": lambda t: t["operators"]["kda.recurrent"].update(outputs={}),
        "inputs": lambda t: t["operators"]["kda.recurrent"].update(inputs=[1]),
        "metric_missing": lambda t: t["policies"]["recurrent"]["rules"]["kda.recurrent"]["output"].pop("metric"),
        "floor_dtype_number": lambda t: t["policies"]["recurrent"]["rules"]["kda.recurrent"]["output"].update(
            floor_dtype=16),
        "rule_key": lambda t: t["policies"]["recurrent"]["rules"]["kda.recurrent"].update(ooo={"metric": "exact"}),
        "rules_array": lambda t: t["policies"]["recurrent"].update(rules=[]),
        "policy_array": lambda t: t["policies"].update(recurrent=[]),
    }

    def test_malformed_tables(self):
        base = json.loads(policy.table_path().read_text())
        for label, mutate in self.MUTATIONS.items():
            data = json.loads(json.dumps(base))
            mutate(data)
            path = TMP / f"table_{label}.json"
            path.write_text(json.dumps(data))
            with self.assertRaises(policy.PolicyTableError, msg=label) as ctx:
                policy.PolicyTable.load(path)
            run = subprocess.run([EXE, "compare", "--golden", str(g("kda_t1")), "--candidate", str(g("kda_t1")),
                                  "--policy-table", str(path)], capture_output=True, text=True)
            self.assertEqual(run.returncode, 2, label)
            self.assertEqual(run.stderr.count("\n"), 1, run.stderr)
            # The same entry and words; C++ prefixes "k3ref: ".
            self.assertEqual(run.stderr.strip().removeprefix("k3ref: "), str(ctx.exception), label)
        # The shipped table itself: both read it, and the C++ built-in copy is this file.
        self.assertEqual(subprocess.run([EXE, "compare", "--golden", str(g("kda_t1")), "--candidate", str(g("kda_t1")),
                                         "--policy-table", str(policy.table_path()), "--policy", "exact"]).returncode, 0)


class RandomParity(unittest.TestCase):
    """Hypothesis: on random goldens and candidates (zeros, NaN, Inf, tiny and huge values,
    every candidate dtype, every named and parametric policy of kda.recurrent) both judges
    give identical JSON. Deterministic (derandomize); a failure prints its reproduce blob."""

    def test_random_files(self):
        try:
            from hypothesis import given, settings, strategies as st
        except ImportError:
            self.skipTest("hypothesis is not importable")
        finite = st.floats(-1e6, 1e6, allow_nan=False, width=64) | st.sampled_from([0.0, 1e-300, -2.5e-310, 3e38, 3.398e38])
        value = finite | st.sampled_from([float("nan"), float("inf"), -float("inf")])
        dtypes = st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16])
        policies = st.sampled_from(["recurrent", "chunk", "flashkda", "fla-test", "exact", "floor:1", "floor:2.5",
                                    "rel-rms:0.01"])

        @settings(max_examples=40, deadline=None, derandomize=True, print_blob=True)
        @given(st.lists(finite, min_size=8, max_size=8), st.lists(value, min_size=8, max_size=8),
               st.floats(0, 0.05), dtypes, dtypes, policies, st.booleans())
        def check(ref, noise, scale, dtype_o, dtype_s, pol, drop_state):
            o = torch.tensor(ref, dtype=torch.float64).reshape(1, 2, 1, 4)
            state = torch.tensor(ref[::-1], dtype=torch.float64).reshape(1, 1, 2, 4)
            n = torch.tensor(noise, dtype=torch.float64)
            golden = write_candidate("random_golden", {"o": o, "final_state": state},
                                     RECURRENT_GOLDEN_METADATA)
            cand = {"o": (o + scale * n.reshape(o.shape)).to(dtype_o)}
            if not drop_state:
                cand["final_state"] = (state * (1 + scale)).to(dtype_s)
            Parity.assert_same(self, golden, write_candidate("random_candidate", cand), pol)

        check()


class HarnessParity(unittest.TestCase):
    """The GPU harness's golden verdict (k3ref.gpu_check.checks.judge_golden, run here on the
    CPU with the kernel's tensors) is compare's on the same tensors written to a file."""

    def test_harness_and_compare_agree(self):
        try:
            from k3ref.gpu_check import adapters, checks
        except ImportError as e:
            self.skipTest(f"k3ref.gpu_check is not importable: {e}")
        adapter = adapters.TorchKernelAdapter()  # policy "recurrent", bf16 output
        for name in ("kda_b2_t37", "kda_t100", "kda_k128_t65"):
            case = goldens.load_case(g(name), reader="k3ref")
            good = fp32_recurrence(case)
            bad = {"o": (case.expected["o"] * 1.01).to(torch.bfloat16), "final_state": good["final_state"]}
            for label, out in (("fp32", good), ("off", bad)):
                res = checks.judge_golden(adapter, case, out["o"], out["final_state"])
                run, doc, _ = compare(g(name), write_candidate(f"harness_{name}_{label}", out), adapter.policy)
                self.assertEqual(res.status, {0: "pass", 1: "fail", 2: "error"}[run.returncode], f"{name} {label}")
                self.assertEqual(res.extra["verdict"]["tensors"], doc["tensors"], f"{name} {label}")
                self.assertEqual(res.status, "pass" if label == "fp32" else "fail")


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]], verbosity=1)
