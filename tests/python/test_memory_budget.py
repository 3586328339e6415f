"""Memory budgets of the Python references: every KDA-family reference (and attnres) estimates
its working memory before computing, by the rule of `k3ref kda --memory-budget` (the estimate is
the C++ one, io/memory_budget.h through k3ref._core), and refuses past `memory_budget=` (default:
half the machine's memory, the command's default) in one line naming the function and the budget."""
import os
import resource
import subprocess

import pytest

from conftest import ROOT, needs_core

pytestmark = needs_core
EXE = os.path.abspath(os.environ.get("K3REF_EXE", str(ROOT / "build" / "k3ref")))


def inputs(B=1, T=4, H=1, HV=1, K=2, V=2):
    import torch
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.rand(*s, generator=g, dtype=torch.float64) * 0.5
    return dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), g=-r(B, T, HV, K), beta=r(B, T, HV))


def test_a_huge_chunk_on_four_tokens_is_refused_before_any_allocation():
    import k3ref
    x = inputs(T=4)
    with pytest.raises(ValueError, match=r"^k3ref\.kda_chunkwise: .*chunk_size = 1024.*over the memory_budget of 1\.00 GiB"):
        k3ref.kda_chunkwise(x, chunk_size=1024, precision="mp256", memory_budget="1G")
    # 8192 is refused too (by the budget in mp256, by the chunk-size limit in double), at once
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for precision in ("double", "mp256"):
        with pytest.raises(ValueError, match=r"^k3ref\.kda_chunkwise: .*(memory_budget|chunk_size)"):
            k3ref.kda_chunkwise(x, chunk_size=8192, precision=precision, memory_budget="4G")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 * 1024  # KiB: nothing large taken
    assert set(k3ref.kda_chunkwise(x, chunk_size=16)) >= {"o", "final_state"}  # within the default budget


def test_mp256_states_per_thread_count():
    import k3ref
    x = inputs(T=1, HV=64, K=256, V=256)
    # 64 sequence-heads x 2 states x 256 x 256 x 150 bytes = 1.2 GiB at 64 threads, 19 MiB at one
    with pytest.raises(ValueError, match=r"^k3ref\.kda: .*mp256, 64 thread\(s\), K = 256, V = 256.*memory_budget"):
        k3ref.kda(x, precision="mp256", threads=64, memory_budget="512M")
    with pytest.raises(ValueError, match=r"^k3ref\.kda: .*double.*memory_budget"):
        k3ref.kda(x, precision="double", threads=64, memory_budget="16M")
    assert "o" in k3ref.kda(x, precision="double", threads=1, memory_budget="512M")


@pytest.mark.parametrize("fn", ["kda", "kda_chunkwise", "kda_backward", "kcp_forward", "kcp_backward", "kda_contract"])
def test_every_kda_reference_takes_a_budget(fn):
    import torch

    import k3ref
    x = inputs(T=4)
    args = {"kda_backward": lambda: ((dict(x, d_o=torch.ones(1, 4, 1, 2, dtype=torch.float64)),), {}),
            "kcp_forward": lambda: ((x,), {"splits": [0, 2, 4]}),
            "kcp_backward": lambda: ((dict(x, d_o=torch.ones(1, 4, 1, 2, dtype=torch.float64)),), {"splits": [0, 2, 4]}),
            "kda_contract": lambda: ((x, "flashkda"), {})}.get(fn, lambda: ((x,), {}))
    a, kw = args()
    with pytest.raises(ValueError, match=rf"^k3ref\.{fn}: the computation needs about \d+ bytes .* over the memory_budget of 256 bytes"):
        getattr(k3ref, fn)(*a, **kw, memory_budget=256)
    assert getattr(k3ref, fn)(*a, **kw, memory_budget="64M")


def test_attnres_takes_a_budget():
    import torch

    import k3ref
    t = dict(values=torch.rand(9, 512, 64, dtype=torch.float64), queries=torch.rand(9, 64, dtype=torch.float64),
             norm_weights=torch.ones(9, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"^k3ref\.attnres: .*mp256, L \+ 1 = 9, T = 512, d = 64.*memory_budget"):
        k3ref.attnres(t, precision="mp256", memory_budget="64M")
    assert "h" in k3ref.attnres(t, precision="double", memory_budget="64M")


@pytest.mark.parametrize("bad,exc", [("abc", ValueError), ("1X", ValueError), ("-1", ValueError), ("0", ValueError),
                                     (0, ValueError), (-5, ValueError), (True, TypeError), (1.5, TypeError),
                                     ([1], TypeError), ("99999999999T", ValueError)])
def test_a_bad_budget_is_one_line_naming_the_argument(bad, exc):
    import k3ref
    with pytest.raises(exc, match=r"^k3ref\.kda: option 'memory_budget'") as e:
        k3ref.kda(inputs(), memory_budget=bad)
    assert "\n" not in str(e.value)


def test_the_default_is_the_commands_half_of_physical_memory():
    import k3ref
    core = k3ref._compiled()
    assert core.default_memory_budget() == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    assert core.parse_memory_budget("3K", "x") == 3072 and core.parse_memory_budget("2G", "x") == 2 << 30
    assert (core.bytes_per_element_double, core.bytes_per_element_mp256) == (8, 150)


@pytest.mark.skipif(not os.path.exists(EXE), reason="no k3ref command")
@pytest.mark.parametrize("precision", ["double", "mp256"])
def test_the_estimate_is_the_commands(tmp_path, precision):
    """One byte under the estimate both refuse, one byte over both compute: the same rule."""
    import math

    import k3ref
    x = inputs(T=5, HV=2, K=3, V=4)
    k3ref.save(tmp_path / "x.safetensors", x)
    core = k3ref._compiled()
    numel = lambda t: t.numel()
    outputs = 1 * 5 * 2 * 4 + 1 * 2 * 3 * 4
    need = core.working_memory(outputs, sum(numel(t) for t in x.values()), 2, 2, 3, 4, 0, precision)
    for budget, refused in ((math.floor(need) - 1, True), (math.ceil(need) + 1, False)):
        p = subprocess.run([EXE, "kda", "--in", "x.safetensors", "--out", "o.safetensors", "--threads", "2",
                            "--precision", precision, "--memory-budget", str(budget), "--force"],
                           cwd=tmp_path, capture_output=True, text=True)
        assert (p.returncode == 2 and "--memory-budget" in p.stderr) == refused, (budget, p.returncode, p.stderr)
        if refused:
            with pytest.raises(ValueError, match="memory_budget"):
                k3ref.kda(x, precision=precision, threads=2, memory_budget=budget)
        else:
            assert "o" in k3ref.kda(x, precision=precision, threads=2, memory_budget=budget)
