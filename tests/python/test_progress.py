"""Progress lines of long reference calls (include/k3ref/exec/progress.h): `k3ref.kda` and
`k3ref kda` estimate the duration from the shapes, the precision and the threads before they
start (kda::recurrent_progress: 0.7 us per token-head and element of the K x V state at
256 bits, 3 ns in double, on one thread), and a call estimated at 5 s or more writes a line
at once, one every 2 s while it runs (token-heads done of the total, elapsed, left) and one
when done, on stderr; a shorter call writes nothing. `progress_after` / `--progress-after`
moves the threshold (0: always; negative: never). The other references (chunkwise, contract,
backward, KCP, AttnRes, QB) estimate by their cost relative to the recurrence (or their own
figure) and, reporting no units as they go, say every 2 s how long they have run."""
import os
import re
import subprocess

import pytest

torch = pytest.importorskip("torch")
k3ref = pytest.importorskip("k3ref")
try:
    k3ref._compiled()
except ImportError as e:
    pytest.skip(f"k3ref._core not built: {e}", allow_module_level=True)

EXE = os.environ.get("K3REF_EXE")


def inputs(T, HV, K, V, seed=0):
    gen = torch.Generator().manual_seed(seed)
    u = lambda *s, lo=-1.0, hi=1.0: lo + (hi - lo) * torch.rand(*s, generator=gen, dtype=torch.float64)
    return dict(q=u(1, T, HV, K), k=u(1, T, HV, K, lo=-K ** -0.5, hi=K ** -0.5), v=u(1, T, HV, V),
                g=u(1, T, HV, K, lo=-1.0, hi=0.0), beta=u(1, T, HV, lo=0.0, hi=1.0))


def lines(text, what):
    start = re.compile(rf"{what}: about ([0-9.]+) s estimated for (\d+) token-heads; progress every 2\.0 s")
    middle = re.compile(rf"{what}: (\d+) of (\d+) token-heads \((\d+)%\), ([0-9.]+) s elapsed, about ([0-9.]+) s left")
    end = re.compile(rf"{what}: (\d+) of (\d+) token-heads done in ([0-9.]+) s")
    got = text.strip().splitlines()
    assert len(got) >= 2, text
    first, *between, last = got
    assert start.fullmatch(first) and end.fullmatch(last), got
    return start.fullmatch(first), [middle.fullmatch(x) for x in between], end.fullmatch(last)


def test_a_long_call_prints_progress_every_few_seconds(capsys):
    # 448 tokens x 4 value heads at K = V = 64, 256 bits, one thread: 1792 token-heads x 4096
    # elements x 0.7 us = 5.1 s estimated, just over the threshold.
    out = k3ref.kda(inputs(448, 4, 64, 64), precision="mp256", threads=1)
    first, between, last = lines(capsys.readouterr().err, "k3ref.kda")
    assert float(first.group(1)) == pytest.approx(1792 * 4096 * 0.7e-6, abs=0.05) and first.group(2) == "1792"
    assert between and all(between), between  # at least one line while it ran, each as documented
    done = [int(m.group(1)) for m in between]
    assert done == sorted(done) and 0 < done[0] < 1792 and done[-1] <= 1792 and {m.group(2) for m in between} == {"1792"}
    elapsed = [float(m.group(4)) for m in between]
    assert all(b - a >= 1.9 for a, b in zip(elapsed, elapsed[1:])) and elapsed[0] >= 1.9, elapsed  # every 2 s
    assert last.group(1) == last.group(2) == "1792" and float(last.group(3)) >= elapsed[-1]
    assert out["o"].shape == (1, 448, 4, 64)


def test_a_short_call_prints_nothing(capsys):
    k3ref.kda(inputs(64, 2, 16, 16), precision="mp256", threads=1)  # 128 x 256 x 0.7 us: 23 ms
    k3ref.kda(inputs(4096, 4, 64, 64))  # double: 16384 x 4096 x 3 ns / threads: 0.2 s at most
    assert capsys.readouterr().err == ""


def test_the_threshold_moves(capsys):
    x = inputs(16, 2, 16, 16)
    reference = k3ref.kda(x, progress_after=-1)
    out = k3ref.kda(x, progress_after=0)
    first, between, last = lines(capsys.readouterr().err, "k3ref.kda")
    assert first.group(2) == "32" and not between and last.group(1) == "32"
    assert all(torch.equal(out[n], reference[n]) for n in reference)  # progress changes no bit
    # packed sequences: the token-heads are the sequences' tokens times the value heads
    k3ref.kda(dict(inputs(20, 2, 8, 8), cu_seqlens=[0, 5, 5, 20]), progress_after=0)
    first, between, last = lines(capsys.readouterr().err, "k3ref.kda")
    assert first.group(2) == "40" and last.group(1) == "40"
    with pytest.raises(TypeError, match="k3ref.kda: option 'progress_after' must be a number"):
        k3ref.kda(x, progress_after="soon")


@pytest.mark.skipif(not EXE, reason="K3REF_EXE (the k3ref command of a build) not set")
def test_the_command_prints_progress_past_the_threshold_only(tmp_path):
    made = subprocess.run([EXE, "inputs", "--out", "in.safetensors", "--T", "32", "--H", "2"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    quiet = subprocess.run([EXE, "kda", "--in", "in.safetensors", "--out", "a/ref.safetensors", "--precision", "mp256"],
                           cwd=tmp_path, capture_output=True, text=True)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    shown = subprocess.run([EXE, "kda", "--in", "in.safetensors", "--out", "b/ref.safetensors", "--precision", "mp256",
                            "--progress-after", "0"], cwd=tmp_path, capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    first, between, last = lines(shown.stderr, "k3ref kda")
    assert first.group(2) == "64" and last.group(1) == last.group(2) == "64"  # 32 tokens x 2 heads
    assert (tmp_path / "a" / "ref.safetensors").read_bytes() == (tmp_path / "b" / "ref.safetensors").read_bytes()
    bad = subprocess.run([EXE, "kda", "--in", "in.safetensors", "--out", "c.safetensors", "--progress-after", "nan"],
                         cwd=tmp_path, capture_output=True, text=True)
    assert bad.returncode == 2 and "--progress-after" in bad.stderr and len(bad.stderr.splitlines()) == 1


def _cotangent(x, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return dict(x, d_o=torch.rand(x["v"].shape, generator=gen, dtype=torch.float64) - 0.5)


def _attnres_inputs(L1, T, d):
    gen = torch.Generator().manual_seed(2)
    return dict(values=torch.randn(L1, T, d, generator=gen, dtype=torch.float64),
                queries=torch.randn(L1, d, generator=gen, dtype=torch.float64),
                norm_weights=1 + 0.1 * torch.randn(L1, d, generator=gen, dtype=torch.float64))


# (what, call with progress_after=A, the total its first line names and its unit)
CALLS = [
    ("k3ref.kda_chunkwise", lambda a: k3ref.kda_chunkwise(inputs(20, 2, 8, 8), progress_after=a), "40 token-heads"),
    ("k3ref.kda_chunkwise", lambda a: k3ref.kda_chunkwise(inputs(20, 2, 8, 8), chunk_form="fla", progress_after=a),
     "40 token-heads"),
    ("k3ref.kda_contract", lambda a: k3ref.kda_contract(inputs(20, 2, 8, 8), "fla_chunk", progress_after=a),
     "40 token-heads"),
    ("k3ref.kda_backward", lambda a: k3ref.kda_backward(_cotangent(inputs(20, 2, 8, 8)), progress_after=a),
     "40 token-heads"),
    ("k3ref.kda_backward", lambda a: k3ref.kda_backward(_cotangent(inputs(20, 2, 8, 8)), method="chunkwise",
                                                        progress_after=a), "40 token-heads"),
    ("k3ref.kcp_forward", lambda a: k3ref.kcp_forward(dict(inputs(20, 2, 8, 8), cu_seqlens=[0, 20]), [0, 8, 20],
                                                      progress_after=a), "40 token-heads"),
    ("k3ref.kcp_backward", lambda a: k3ref.kcp_backward(_cotangent(dict(inputs(20, 2, 8, 8), cu_seqlens=[0, 20])),
                                                        splits=[0, 8, 20], progress_after=a), "40 token-heads"),
    ("k3ref.attnres", lambda a: k3ref.attnres(_attnres_inputs(5, 6, 8), progress_after=a), "30 token-slots"),
    ("k3ref.qb_solver", lambda a: k3ref.qb_solver({"scores": torch.rand(16, 8, dtype=torch.float64,
                                                                        generator=torch.Generator().manual_seed(3))}, k=2,
                                                  iterations=3, progress_after=a), "3 iterations"),
]


@pytest.mark.parametrize("what, call, total", CALLS, ids=[f"{c[0]}-{i}" for i, c in enumerate(CALLS)])
def test_every_reference_has_progress_lines_past_its_threshold_only(capsys, what, call, total):
    quiet = call(-1)
    assert capsys.readouterr().err == ""
    shown = call(0)
    got = capsys.readouterr().err.strip().splitlines()
    count, unit = total.split(" ", 1)
    assert len(got) == 2, got  # done well under 2 s: the first line and the last
    assert re.fullmatch(rf"{what}: about [0-9.]+ s estimated for {total}; progress every 2\.0 s", got[0]), got
    assert re.fullmatch(rf"{what}: {count} of {total} done in [0-9.]+ s", got[1]), got
    assert quiet.keys() == shown.keys() and all(torch.equal(quiet[n], shown[n]) for n in quiet)  # no bit changed
    call(None)  # the default threshold, 5 s: these calls are estimated far under it
    assert capsys.readouterr().err == ""


def test_a_reference_that_reports_no_units_says_how_long_it_has_run(capsys):
    # kcp_forward at 256 bits, one thread, 384 tokens x 2 heads at K = V = 64: 768 token-heads x
    # 4096 elements x 0.7 us x 2.53 (kda::RelativeCost::kcp_forward) = 5.6 s estimated, over the
    # default threshold, so at least one line of the ticker (every 2 s) between the first and the last.
    x = dict(inputs(384, 2, 64, 64), cu_seqlens=[0, 384])
    k3ref.kcp_forward(x, [0, 128, 256, 384], precision="mp256", threads=1)
    got = capsys.readouterr().err.strip().splitlines()
    first, *between, last = got
    start = re.fullmatch(r"k3ref.kcp_forward: about ([0-9.]+) s estimated for 768 token-heads; progress every 2\.0 s",
                         first)
    assert start and float(start.group(1)) == pytest.approx(768 * 4096 * 0.7e-6 * 2.53, abs=0.05), got
    ticks = [re.fullmatch(r"k3ref.kcp_forward: ([0-9.]+) s elapsed of about ([0-9.]+) s estimated", b) for b in between]
    assert ticks and all(ticks), got
    elapsed = [float(m.group(1)) for m in ticks]
    assert elapsed[0] >= 1.9 and all(b - a >= 1.9 for a, b in zip(elapsed, elapsed[1:])), elapsed
    done = re.fullmatch(r"k3ref.kcp_forward: 768 of 768 token-heads done in ([0-9.]+) s", last)
    assert done and float(done.group(1)) >= elapsed[-1], got
