"""libk3gc's fp64 reference: its fast form (precision 2) against the plain kernel, its
definition (precision 0), bit for bit: o and the final state compared as raw bits (signs of
zeros and NaN payloads included), on

- every KDA golden that libk3gc's reference takes (the cases and the inputs the golden check
  feeds k3gc.fp64_reference: LibReferenceAdapter and its domain);
- cases Hypothesis draws (prop's case strategy, with head sizes anywhere in 1..128 and every
  input, output and state dtype): GVA, varlen with empty and one-token sequences, both state
  layouts, every gate and beta mode, L2 norm on and off, T across the 8-token tiles; a failure
  prints the falsifying case and the @reproduce_failure line that replays it;
- a few fixed shapes: the K3 shape's column blocks (V = 128: 4 blocks per head), T = 0;
- inputs past one workspace window at K3's 96 heads (the fast form stages its rows a window of
  tokens at a time and carries the state across windows): one sequence over three windows,
  two batched sequences, and packed sequences that cross the boundaries, with an empty one.

Skipped without torch, a CUDA device or libk3gc (K3GC_LIB or build*/gpu_check/libk3gc.so);
the property test also without Hypothesis.
"""
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from k3ref import goldens  # noqa: E402
from k3ref.gpu_check import adapters, bench, drawn_case, lib, prop  # noqa: E402
from k3ref.gpu_check.protocol import bits  # noqa: E402

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
if not lib.available():
    pytest.skip(lib.load_error(), allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = adapters.LibReferenceAdapter()
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def both(inputs, params, **kw):
    """(fast, plain): each lib.kda_forward's (o, final state), o written over the same
    NaN-filled buffer (a position either kernel leaves unwritten then shows too)."""
    runs = []
    for precision in (2, 0):
        B, T, _, _ = inputs["q"].shape
        HV, V = inputs["v"].shape[2:]
        out = torch.full((B, T, HV, V), float("nan"), dtype=kw.get("output_dtype", torch.float64), device="cuda")
        runs.append(lib.kda_forward(inputs, params, precision=precision, out=out, **kw))
    torch.cuda.synchronize()
    return runs


def assert_bitwise(fast, plain, what):
    for name, a, b in (("o", fast[0], plain[0]), ("final_state", fast[1], plain[1])):
        assert a.dtype == b.dtype and a.shape == b.shape, (what, name)
        diff = (bits(a) != bits(b)).flatten().nonzero()
        assert diff.numel() == 0, (f"{what}: {name} differs in {diff.numel()} of {a.numel()} elements, first at flat "
                                   f"index {int(diff[0])}: fast {a.flatten()[diff[0]].item()!r}, plain "
                                   f"{b.flatten()[diff[0]].item()!r}")


# --------------------------------------------------------------------------- the goldens

SUITE = goldens.load_suite(ROOT / "goldens", ops=REFERENCE.golden_ops)
TAKEN = [c for c in SUITE if REFERENCE.case_unsupported(c) is None]


def test_the_reference_takes_goldens():
    assert len(TAKEN) >= 20, f"only {len(TAKEN)} of {len(SUITE)} KDA goldens inside libk3gc's domain"


@pytest.mark.parametrize("case", TAKEN, ids=lambda c: c.name)
def test_fast_equals_plain_on_a_golden(case):
    # The inputs as checks.golden_check gives them to a reference (its initial state's dtype kept).
    inputs = {k: v.to("cuda") for k, v in case.inputs.items()}
    assert_bitwise(*both(inputs, case.params, output_dtype=REFERENCE.output_dtype, state_dtype=REFERENCE.state_dtype),
                   case.name)


# --------------------------------------------------------------------------- fixed shapes

@pytest.mark.parametrize("T,H,HV,K,V", [(0, 2, 2, 128, 128), (1, 1, 1, 128, 128), (37, 2, 4, 128, 128),
                                        (300, 2, 2, 128, 128), (17, 1, 3, 100, 97), (9, 2, 2, 33, 65)])
def test_fast_equals_plain_on_the_k3_options(T, H, HV, K, V):
    inputs = bench.k3_inputs(T, HV, K, V, 7)  # q, k of the first H heads: GVA
    inputs["q"], inputs["k"] = inputs["q"][:, :, :H].contiguous(), inputs["k"][:, :, :H].contiguous()
    inputs["A_log"] = torch.rand(HV, device="cuda") - 0.5
    inputs["dt_bias"] = torch.rand(HV, K, device="cuda") - 0.5
    inputs["initial_state"] = torch.rand(1, HV, K, V, dtype=torch.float64, device="cuda")
    assert_bitwise(*both(inputs, bench.k3_params()), f"K3 options T={T} H={H} HV={HV} K={K} V={V}")


# Tokens per window of the fast form: its 1 GiB workspace over the doubles it stages per token
# ((2 H + 2 HV) * 128 + HV, k3gc.h): 2,725 at 96 heads.
WINDOW = (1 << 30) // 8 // ((2 * 96 + 2 * 96) * 128 + 96)


@pytest.mark.parametrize("layout", ["one sequence", "batch of 2", "packed"])
def test_fast_equals_plain_across_windows(layout):
    H = 96
    T = 3 * WINDOW + 101  # even: the batch layout halves it
    inputs = bench.k3_inputs(T, H, 128, 128, 3)
    inputs["A_log"], inputs["dt_bias"] = bench._k3_gate_inputs(H, 128)
    if layout == "batch of 2":  # sequence 0 crosses the first boundary, sequence 1 the second
        T = T // 2
        inputs = {n: t.reshape(2, T, *t.shape[2:]) if n in ("q", "k", "v", "g", "beta") else t for n, t in inputs.items()}
    if layout == "packed":  # a boundary inside a sequence, one a token after a sequence's end, an empty sequence
        W = WINDOW
        inputs["cu_seqlens"] = torch.tensor([0, W - 5, W + 1, W + 1, 2 * W + 7, 2 * W + 8, T], device="cuda")
    n_seq = inputs["cu_seqlens"].numel() - 1 if "cu_seqlens" in inputs else inputs["q"].shape[0]
    inputs["initial_state"] = torch.rand(n_seq, H, 128, 128, dtype=torch.float64, device="cuda")
    assert_bitwise(*both(inputs, bench.k3_params(), output_dtype=torch.float32), f"{layout}, T={T}, window {WINDOW}")


def test_an_unknown_precision_is_an_error():
    inputs = bench.k3_inputs(4, 1, 8, 8, 1)
    with pytest.raises(RuntimeError, match="precision must be 0"):
        lib.kda_forward(inputs, bench.k3_params(), precision=3)


# --------------------------------------------------------------------------- drawn cases

try:
    from hypothesis import HealthCheck, given, settings, strategies as st
except ImportError:  # the goldens and fixed shapes above still run
    st = None

if st is not None:
    @st.composite
    def drawn(draw):
        """prop's case (max T 40: up to 5 tiles) with, half the time, K and V anywhere in 1..128, and
        the dtypes of the inputs, the output and the state."""
        c = draw(prop.case_strategy(st, {}, 40))
        if draw(st.booleans()):
            c["K"], c["V"] = draw(st.integers(1, 128)), draw(st.integers(1, 128))
        c["input_dtype"] = draw(st.sampled_from([torch.bfloat16] + [d for d in DTYPES if d != torch.bfloat16]))
        c["output_dtype"] = draw(st.sampled_from(DTYPES))
        c["state_dtype"] = draw(st.sampled_from(DTYPES))
        return c

    @settings(max_examples=150, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
    @given(c=drawn())
    def test_fast_equals_plain_on_drawn_cases(c):
        inputs = drawn_case.make_inputs(c)
        inputs = {n: (t.to(c["input_dtype"]) if n in ("q", "k", "v", "g", "beta") else t).to("cuda")
                  for n, t in inputs.items()}
        assert_bitwise(*both(inputs, drawn_case.params_of(c), output_dtype=c["output_dtype"],
                             state_dtype=c["state_dtype"]), repr(c))
