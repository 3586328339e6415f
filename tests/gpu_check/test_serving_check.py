"""The serving checks (python/k3ref/gpu_check/serving_check.py) on the CPU with the pure-PyTorch
serving kernel: the correct kernel passes every check on every serving golden, and each
mutation (accepted count off by one, a write to an unnamed slot, the K/V layout swap, a
checkpoint one token late, verify writing the committed slot, an empty sequence's final state
not its initial state, the replay's rebuild without the later gates' decays) fails at least one
check and errors in none: the kill rate is 7 of 7 (docs/serving.md's table).

The FLA serving adapters, wired to a CPU emulation of fused_recurrent_kda's documented semantics
and chunk_kda's results (fla_emulation.py here, on pytest.ini's pythonpath), make their calls,
and the checks find what FLA's source predicts and nothing else.

Skipped without torch, or without k3ref._core (K3REF_CORE_PATH=BUILD/python): the checks are
judged against k3ref's compiled references (gpu_check/references.py)."""
from pathlib import Path

import pytest

pytest.importorskip("torch")
from k3ref.gpu_check import serving_check as sc  # noqa: E402
from k3ref.gpu_check.references import _module  # noqa: E402

if _module() is None:  # one skip, the run 77 to meson (conftest.py)
    pytest.skip("k3ref._core not built (K3REF_CORE_PATH): the serving checks' references", allow_module_level=True)

GOLDENS = Path(__file__).resolve().parents[2] / "goldens"
MUTATIONS = sc.TorchServingAdapter.MUTATIONS[1:]
KILL_RATE = 7  # the mutants of docs/serving.md's table, each caught


def run(adapter, suite):
    """(check, case id, status, reason) of every check of `adapter` on every case it takes."""
    results = []
    for check in adapter.checks:
        for case_id, case, why in adapter.cases(check, suite):
            if why:
                results.append((check, case_id, "skip", why))
                continue
            r = adapter.run_check(check, case, "cpu")
            results.append((check, case_id, r.status, r.reason))
    return results


@pytest.fixture(scope="module")
def suite():
    return sc.load_serving_suite(GOLDENS)


@pytest.fixture(scope="module")
def mutant_results(suite):
    """The results of each mutant, by mutation name, each mutant run once."""
    cache = {}

    def results(mutation):
        if mutation not in cache:
            cache[mutation] = run(sc.TorchServingAdapter(mutation), suite)
        return cache[mutation]

    return results


def test_the_suite_holds_the_serving_goldens(suite):
    assert len(suite) >= 10, f"only {len(suite)} serving goldens in {GOLDENS}"


def test_the_correct_kernel_passes_every_check(suite):
    correct = sc.torch_serving_kernels()[0]
    assert correct.mutation is None
    results = run(correct, suite)
    failures = [f"{check}[{case}] {status}: {reason}" for check, case, status, reason in results if status != "pass"]
    print(f"{correct.name}: {len(results) - len(failures)} of {len(results)} checks pass")
    assert results and not failures, f"{correct.name}: {len(failures)} of {len(results)} checks not passed:\n" + \
        "\n".join(failures)


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_the_mutant_is_caught_and_judged(mutation, mutant_results):
    results = mutant_results(mutation)
    name = sc.TorchServingAdapter(mutation).name
    errors = [(c, case, reason) for c, case, s, reason in results if s == "error"]
    caught = [(c, case, reason) for c, case, s, reason in results if s == "fail"]
    assert not errors, f"{name}: a check errored instead of judging: {errors[0]}"
    assert caught, f"{name}: survived every check"
    print(f"{name}: caught by {len(caught)} checks, e.g. {caught[0][0]}[{caught[0][1]}]: {caught[0][2][:150]}")


def test_the_kill_rate_is_7_of_7(mutant_results):
    mutants = sc.torch_serving_kernels()[1:]
    assert [m.mutation for m in mutants] == list(MUTATIONS)
    killed = sum(any(s == "fail" for _, _, s, _ in mutant_results(m.mutation)) for m in mutants)
    print(f"kill rate {killed} of {len(mutants)}")
    assert killed == len(mutants) == KILL_RATE, f"kill rate {killed}/{len(mutants)}, expected {KILL_RATE}/{KILL_RATE}"


# What FLA's source predicts for the real kernels: accepted count 0 reads the neighbour's slot,
# an empty sequence's final state is never stored; everything else passes.
EXPECTED_FAILURES = {("fla.fused_recurrent_kda[spec_decode]", "accepted_zero"),
                     ("fla.fused_recurrent_kda[spec_decode]", "empty_sequences")}
UNPREDICTED = {("fla.chunk_kda[serving]", "empty_sequences")}  # the source read says nothing about it


def emulated_adapter(which):
    import fla_emulation as emu

    if which == "chunk":
        a = sc.FlaChunkIntermediateAdapter()
        a.fn = emu.chunk_kda
    else:
        a = sc.FlaServingAdapter(which)
        a.fwd, a.plain = emu.fused_recurrent_kda_fwd, emu.fused_recurrent_kda
    return a


@pytest.mark.parametrize("which", ["continuous_batching", "spec_decode", "chunk"])
def test_the_fla_adapter_on_the_emulation_gives_the_predicted_verdicts(which, suite):
    a = emulated_adapter(which)
    failures, judged = [], 0
    for check, case, status, reason in run(a, suite):
        if status == "skip":
            continue
        judged += 1
        if (a.name, check) in UNPREDICTED:
            print(f"{a.name} {check}[{case}] {status} on the emulation (no prediction for the real kernel)")
            continue
        predicted = "fail" if (a.name, check) in EXPECTED_FAILURES else "pass"
        print(f"{a.name} {check}[{case}] {status} (predicted for the real kernel: {predicted}): {reason[:120]}")
        if status != predicted:
            failures.append(f"{a.name} {check}[{case}] on the emulation: {status}, expected {predicted}: {reason}")
    assert judged, f"{a.name}: no check judged on the emulation"
    assert not failures, "\n".join(failures)


def test_the_checks_split_over_processes_give_the_whole_table(suite):
    # serving_check --checks / --skip-checks: what device_engines.sh's SPLIT runs side by side,
    # merged, is the one table of a single process (verdicts per kernel, check and case).
    a = sc.torch_serving_kernels()[0]
    whole = sc.engine_table([a], suite, "cpu")
    golden = sc.engine_table([a], suite, "cpu", {"golden"})
    others = sc.engine_table([a], suite, "cpu", set(sc.SERVING_CHECKS) - {"golden"})

    def verdicts(rows):
        return sorted((r["kernel"], r["check"], r["case"], r["verdict"]) for r in rows if r["check"] != "(all)")

    assert {r["check"] for r in golden} == {"golden", "(all)"}
    assert "golden" not in {r["check"] for r in others}
    assert verdicts(golden + others) == verdicts(whole)
    assert sc.table_cells(golden + others) == sc.table_cells(whole)
    times = sc.measurement_of(golden + others, "cpu", ["test"], None)["tables"]["sources"]["rows"][0]["seconds"]
    assert times.count(" s") == 2 and " + " in times, times
