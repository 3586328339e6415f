"""The kernel domains (policy/kernel_domains.json, k3ref.kernel_domains): every built-in kernel
has at least 12 KDA goldens inside its domain, counted from the data and the committed
manifest; the C++ reader (`k3ref golden list --kernel`) selects the same goldens as the Python
one; malformed domains are refused in one line naming the entry."""
import json
import os
import struct
import subprocess

import pytest

from conftest import GOLDENS, ROOT
from k3ref import kernel_domains as D
from k3ref import kernel_domains_file as F

MIN_GOLDENS_PER_KERNEL = 12
MANIFEST = json.loads((GOLDENS / "MANIFEST.json").read_text())


def input_dtype(case):
    """The storage format of q, read from the golden file's safetensors header."""
    with open(GOLDENS / case["file"], "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F64": "fp64"}[header["q"]["dtype"]]


def inside(domain):
    return [c["name"] for c in MANIFEST["cases"]
            if domain.outside(c["op"], c["params"], None, input_dtype(c) if c["op"].startswith("kda.") else None) is None]


@pytest.mark.parametrize("kernel", sorted(F.load()))
def test_each_builtin_kernel_has_enough_kda_goldens_inside_its_domain(kernel):
    domain = F.load()[kernel]
    ops = {c["name"]: c["op"] for c in MANIFEST["cases"]}
    if domain.ops is not None and "kda.recurrent" not in domain.ops:
        # a serving kernel (the engines' pool decode, verify, replay): a golden of one of its operators
        mine = [n for n in inside(domain) if ops[n] in domain.ops]
        assert mine, f"{kernel}: no golden of {domain.ops} inside its domain"
        return
    kda = [n for n in inside(domain) if ops[n] == "kda.recurrent"]
    assert len(kda) >= MIN_GOLDENS_PER_KERNEL, f"{kernel}: {len(kda)} KDA goldens inside its domain: {kda}"


def k3ref_exe():
    exe = os.environ.get("K3REF_EXE")
    if not exe:
        pytest.skip("K3REF_EXE (the k3ref command of this build) not set")
    return exe


@pytest.mark.parametrize("kernel", sorted(F.load()))
def test_cpp_and_python_readers_select_the_same_goldens(kernel):
    r = subprocess.run([k3ref_exe(), "golden", "list", "--kernel", kernel, "--json"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert [c["name"] for c in json.loads(r.stdout)] == inside(F.load()[kernel])


def test_unknown_kernel_is_one_line_naming_the_known_ones():
    r = subprocess.run([k3ref_exe(), "golden", "list", "--kernel", "fla.chunk_kda[nope]"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and all(k in r.stderr for k in F.load()), r.stderr


def test_the_domains_say_what_the_kernels_accept():
    flashkda, safe_gate = F.builtin("flashkda.fwd"), F.builtin("fla.chunk_kda[safe_gate]")
    base = dict(B=1, T=40, H=2, HV=2, K=128, V=128, gate="lower_bound", gate_base="2", lower_bound=-5.0, A_log=True,
                beta="sigmoid", qk_l2norm=True, state_layout="k_first", cu_seqlens=None, initial_state=True)
    assert flashkda.outside("kda.recurrent", base, None, "bf16") is None
    assert flashkda.outside("kda.recurrent", dict(base, K=64), None, "bf16") == "K = 64: the kernel takes K = 128"
    assert flashkda.outside("kda.recurrent", dict(base, HV=4), None, "bf16") == "HV/H = 2: the kernel takes HV/H = 1"
    assert flashkda.outside("kda.recurrent", base, None, "fp16") == "inputs fp16: the kernel takes inputs bf16"
    assert flashkda.outside("kda.recurrent", dict(base, lower_bound=0.0), None, "bf16") is None  # [-5, 0] closed
    assert flashkda.outside("qb.solve", base) == "operator qb.solve: the kernel takes operator kda.recurrent"
    # The safe gate's range is [-5, 0): its bound -5 inside, 0 outside; shapes override params.
    assert safe_gate.outside("kda.recurrent", dict(base, lower_bound=-5.0)) is None
    assert safe_gate.outside("kda.recurrent", dict(base, lower_bound=0.0)) == \
        "lower_bound = 0: the kernel takes lower_bound in [-5, 0)"
    assert safe_gate.outside("kda.recurrent", dict(base, gate="softplus")) == "gate softplus: the kernel takes gate lower_bound"
    assert safe_gate.outside("kda.recurrent", base, dict(K=512)) == "K = 512: the kernel takes K <= 256"
    fla = F.builtin("fla.chunk_kda")
    assert fla.outside("kda.recurrent", dict(base, gate="softplus", A_log=False)) == \
        "gate softplus without A_log: the kernel takes it with A_log"
    # A parameter a case does not have constrains nothing (a metamorphic check's configuration).
    assert flashkda.outside(None, dict(gate="lower_bound", lower_bound=-5.0), dict(K=128, V=128, H=1, HV=1)) is None


def test_an_adapters_domain_in_the_same_schema():
    d = D.domain_of({"K": {"in": [64, 128]}, "varlen": False, "initial_state": [False], "state_layouts": ["v_first"]},
                    "mine")
    p = dict(K=64, cu_seqlens=None, initial_state=False, state_layout="v_first")
    assert d.outside("kda.recurrent", p) is None
    assert d.outside("kda.recurrent", dict(p, K=32)) == "K = 32: the kernel takes K in {64, 128}"
    assert d.outside("kda.recurrent", dict(p, cu_seqlens=[0, 3])) == "varlen (cu_seqlens): the kernel takes no varlen"
    assert d.outside("kda.recurrent", dict(p, initial_state=True)) == "initial_state yes: the kernel takes initial_state no"
    assert d.outside("kda.recurrent", dict(p, state_layout="k_first")) == \
        "state_layout k_first: the kernel takes state_layout v_first"
    assert D.domain_of(None) is None


@pytest.mark.parametrize("bad, message", [
    ({"K": {"max": "128"}}, "domain of mine.K.max: must be a finite number"),
    ({"K": {"in": [128], "max": 128}}, "domain of mine.K: 'in' takes no bound beside it"),
    ({"K": {"max": 1, "below": 2}}, "domain of mine.K: min/above and max/below: one of each at most"),
    ({"K": {}}, "domain of mine.K: must bound something"),
    ({"head_size": {"max": 1}}, "domain of mine: unknown key 'head_size'"),
    ({"gates": [{"form": "softplus"}, {"form": "softplus"}]}, "domain of mine.gates[1]: gate 'softplus' listed twice"),
    ({"betas": []}, "domain of mine.betas: must be a non-empty list"),
    ({"varlen": 1}, "domain of mine.varlen: must be true or false"),
])
def test_malformed_domains_are_refused_naming_the_entry(bad, message):
    with pytest.raises(D.KernelDomainError) as e:
        D.domain_of(bad, "mine")
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_the_file_is_read_under_the_packages_json_rules(tmp_path):
    text = (ROOT / "policy" / "kernel_domains.json").read_text()
    dup = tmp_path / "dup.json"
    dup.write_text(text.replace('"kernels": {', '"kernels": {"x": {"about": ""}, "x": {"about": ""},', 1))
    with pytest.raises(D.KernelDomainError, match="duplicate key 'x'"):
        F.load(dup)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(text.replace('"version": 1', '"version": 2', 1))
    with pytest.raises(D.KernelDomainError, match="'version' must be 1"):
        F.load(wrong)
