"""The public references: torch tensors of any float dtype in, float64 torch tensors out,
the CLI's option and tier names, one-line errors."""
import os
import re
import subprocess

import pytest
import torch

import k3ref
from conftest import needs_core
from k3ref import goldens

pytestmark = needs_core


@pytest.fixture(scope="module")
def case():
    return goldens.load_case("kda_varlen_gva")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_any_float_dtype_in_float64_torch_out(case, dtype):
    # The stored inputs are bf16 values (initial_state fp32), exact in every dtype listed
    # except fp16 for initial_state's fp32 values; so feed the bf16 tensors as `dtype` and
    # require the outputs bit-identical to the golden (mp256, the golden's tier).
    inputs = {n: (t.to(dtype) if t.dtype == torch.bfloat16 else t) for n, t in case.inputs.items()}
    out = k3ref.kda(inputs, precision="mp256", **case.options)
    assert set(out) == {"o", "final_state"}
    for name, t in out.items():
        assert isinstance(t, torch.Tensor) and t.dtype == torch.float64 and t.device.type == "cpu"
        assert torch.equal(t, case.expected[name]), name


def test_bf16_inputs_are_taken_as_bf16(case):
    q = case.inputs["q"]
    assert q.dtype == torch.bfloat16
    out = k3ref.kda(case.inputs, **case.options)
    # double tier: within rounding of the mp256 golden. Was 1e-14: measured worst 1.83e-16 over
    # 1 golden (this one; date 2026-12-01); bound 4x (3.8x).
    err = (out["o"] - case.expected["o"]).norm() / case.expected["o"].norm()
    assert err < 7e-16


def _cli_help(sub):
    exe = os.environ.get("K3REF_EXE")
    if not exe or not os.path.exists(exe):
        pytest.skip("K3REF_EXE (the k3ref command of this build) not set")
    return subprocess.run([exe, sub, "--help"], capture_output=True, text=True, check=True).stdout


def test_option_and_tier_names_are_the_cli_s():
    text = _cli_help("kda")
    flags = {}
    for line in text.splitlines():
        m = re.match(r"\s+(--[a-z][a-z0-9-]*)(?:,\s*-\w)?\s+(\S+)?", line)
        if m:
            flags[m.group(1)] = line
    # --in, --out and --force name and guard the files, --memory-budget the run's resources,
    # --progress-after its progress lines; every other option is the computation's.
    names = {f[2:].replace("-", "_") for f in flags} - {"help", "in", "out", "force", "memory_budget", "progress_after"}
    assert names == set(k3ref.KDA_OPTIONS), (sorted(names), sorted(k3ref.KDA_OPTIONS))
    for name, choices in k3ref.KDA_OPTIONS.items():
        if isinstance(choices, tuple):
            line = flags["--" + name.replace("_", "-")]
            listed = re.search(r"\{([^}]*)\}", line) or re.search(r":\s*(.*)$", line)
            # CLI11 prints the allowed values of IsMember as {a,b,c}; the description lists them as a | b | c.
            described = set(re.findall(r"[a-z0-9_]+", line.split(None, 2)[-1]))
            assert set(choices) <= described, (name, choices, line)
    assert k3ref.PRECISIONS == ("double", "mp256")


def test_keywords_of_every_kda_reference_are_cli_names():
    import inspect
    extra = {"kda_chunkwise": {"chunk_form", "chunk_size", "sub_chunk", "stages"},
             "kda_backward": {"method", "chunk_size"}, "kcp_forward": {"merge"}, "kcp_backward": {"merge"}}
    for fn_name, own in [("kda", set())] + list(extra.items()):
        params = inspect.signature(getattr(k3ref, fn_name)).parameters
        # memory_budget is --memory-budget, the run's resources, progress_after --progress-after
        # (excluded from KDA_OPTIONS above)
        kw = {n for n, p in params.items() if p.kind == p.KEYWORD_ONLY} - {"memory_budget", "progress_after"}
        assert kw - own <= set(k3ref.KDA_OPTIONS), (fn_name, sorted(kw - own - set(k3ref.KDA_OPTIONS)))


@pytest.mark.parametrize("call, exc, message", [
    (lambda i: k3ref.kda(i, gate="nope"), ValueError, "k3ref.kda: option 'gate' must be one of log_decay"),
    (lambda i: k3ref.kda(i, precision="high"), ValueError, "option 'precision' must be one of double, mp256, not 'high'"),
    (lambda i: k3ref.kda(i, lower_bound="-5"), TypeError, "option 'lower_bound' must be a number"),
    (lambda i: k3ref.kda(i, l2norm=1), TypeError, "option 'l2norm' must be True or False"),
    (lambda i: k3ref.kda(i, scale=float("nan")), ValueError, "option 'scale' must be finite, not nan"),
    (lambda i: k3ref.kda(i, gate="lower_bound", lower_bound=float("-inf")), ValueError,
     "option 'lower_bound' must be finite, not -inf"),
    (lambda i: k3ref.kda(i, threads=0), ValueError, "option 'threads' must be at least 1"),
    (lambda i: k3ref.kda(dict(i, q=i["q"].to(torch.int32))), TypeError, "tensor 'q' must have a floating-point dtype"),
    (lambda i: k3ref.kda(dict(i, q=i["q"].tolist())), TypeError, "tensor 'q' must be a torch.Tensor, not list"),
    (lambda i: k3ref.kda(dict(i, z=i["q"])), ValueError, "unknown input tensor 'z'"),
    (lambda i: k3ref.kda({n: t for n, t in i.items() if n != "beta"}), ValueError, "missing input tensor 'beta'"),
    (lambda i: k3ref.kda(i["q"]), TypeError, "inputs must be a mapping"),
    (lambda i: k3ref.kda(dict(i, q=i["q"][:, :5])), ValueError, "k3ref.kda: kda: argument 'k': expected shape"),
    (lambda i: k3ref.kda(dict(i, cu_seqlens=[0, 3.5])), TypeError, "'cu_seqlens' must hold integers"),
    (lambda i: k3ref.kda_chunkwise(i, chunk_form="ut"), ValueError, "option 'chunk_form' must be one of flashkda, fla"),
    (lambda i: k3ref.kda_backward(i), ValueError, "missing input tensor 'd_o'"),
    (lambda i: k3ref.kcp_forward(i), ValueError, "missing 'splits'"),
])
def test_bad_arguments_raise_one_line_errors(case, call, exc, message):
    inputs = dict(case.inputs)
    with pytest.raises(exc) as info:
        call(inputs)
    text = str(info.value)
    assert message in text
    assert "\n" not in text and "Invoked with" not in text and "incompatible function arguments" not in text


def test_strided_inputs(case):
    def strided(t):
        big = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        big[..., ::2] = t
        return big[..., ::2]
    inputs = {n: (strided(t) if t.is_floating_point() else t) for n, t in case.inputs.items()}
    assert not inputs["q"].is_contiguous()
    out = k3ref.kda(inputs, precision="mp256", **case.options)
    assert torch.equal(out["o"], case.expected["o"])
