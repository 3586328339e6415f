"""The warm-up's shards (autotune.sharded, autotune.replayed, warmup.shard_units and the
scheduler): a backward unit split over processes compiles and times each configuration of
every autotuner exactly once, and its merge leaves Triton's autotune cache as an unsharded run
leaves it. A stand-in of Triton's Autotuner keeps the three methods the shards hook with
Triton 3.x's contract (run -> check_disk_cache(tuning_key, configs, bench_fn) -> _bench(*args,
config, **meta)); no GPU, no Triton, no torch needed."""
import functools
import threading
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from k3ref.gpu_check import autotune, warmup

DISK = {}  # the stand-in of Triton's on-disk autotune cache: (kernel, key, configs) -> timings


class Config:
    def __init__(self, **kwargs):
        self.kwargs = kwargs

    def __str__(self):
        return ", ".join(f"{k}: {v}" for k, v in sorted(self.kwargs.items()))


def kernel_fn():
    pass


class Tuner:
    """Triton's Autotuner as far as the shards see it. `speed[str(config)]` is the time a
    configuration measures; `ran` the configurations really benchmarked (compiled and run)."""

    def __init__(self, configs, speed):
        self.configs, self.speed, self.cache, self.ran = list(configs), speed, {}, []
        self.base_fn = kernel_fn

    def _bench(self, *args, config, **meta):
        self.ran.append(str(config))
        return [self.speed[str(config)]] * 3

    def check_disk_cache(self, tuning_key, configs, bench_fn):
        entry = ("kernel_fn", str(tuning_key), tuple(str(c) for c in configs))
        if entry in DISK:
            by_text = {str(c): c for c in configs}
            self.cache[tuning_key] = by_text[min(DISK[entry], key=DISK[entry].get)]
            return True
        bench_fn()
        DISK[entry] = {str(c): t for c, t in self.configs_timings.items()}
        return False

    def run(self, T, dtype="bf16"):
        key = (T, dtype)
        if key not in self.cache:
            def benchmark():
                timings = {c: self._bench(T, config=c, dtype=dtype) for c in self.configs}
                self.cache[key] = min(timings, key=timings.get)
                self.configs_timings = timings

            self.check_disk_cache(key, self.configs, benchmark)
        return str(self.cache[key])


def fresh(configs, speed):
    """A new process's autotuner: nothing in memory, the same disk."""
    return Tuner(configs, speed)


distinct_speeds = st.integers(1, 12).flatmap(
    lambda n: st.lists(st.integers(1, 10**6), min_size=n, max_size=n, unique=True))


@settings(max_examples=200, deadline=None)
@given(speeds=distinct_speeds, count=st.integers(2, 5), missing=st.one_of(st.none(), st.integers(0, 4)))
def test_shards_time_each_configuration_once_and_the_merge_writes_the_unsharded_winner(speeds, count, missing):
    configs = [Config(BK=16 * (i + 1), warps=4) for i in range(len(speeds))]
    speed = {str(c): float(s) for c, s in zip(configs, speeds)}
    DISK.clear()
    plain = fresh(configs, speed).run(64)  # what one unsharded process picks
    unsharded_entry = dict(DISK)
    DISK.clear()

    tables, ran = [], []
    for index in range(count):
        t = fresh(configs, speed)
        with autotune.sharded(index, count, cls=Tuner) as measured:
            t.run(64)
        assert DISK == {}, "a shard wrote the autotune cache"
        assert t.ran == [str(c) for i, c in enumerate(configs) if i % count == index]
        ran += t.ran
        tables.append(measured if index != missing else {})
    assert sorted(ran) == sorted(str(c) for c in configs), "not every configuration timed exactly once"

    merge = fresh(configs, speed)
    with autotune.replayed(autotune.merge_timings(tables), cls=Tuner) as counts:
        won = merge.run(64)
    lost = [str(c) for i, c in enumerate(configs) if missing is not None and i % count == missing]
    assert merge.ran == lost, "the merge benchmarked what a shard had timed"
    assert counts == {"replayed": len(configs) - len(lost), "benchmarked": len(lost)}
    assert won == plain
    assert DISK == unsharded_entry, "the merge's cache entry is not the unsharded run's"
    # The checks afterwards: a fresh process finds the entry and benchmarks nothing.
    check = fresh(configs, speed)
    assert check.run(64) == plain and check.ran == []


def test_a_merge_in_the_process_of_one_of_its_shards_still_replays_and_writes():
    # A warm-up worker keeps its imports, and so its autotuners, from one unit to the next.
    configs = [Config(BK=b) for b in (16, 32, 64, 128)]
    speed = {str(c): t for c, t in zip(configs, (4.0, 3.0, 1.0, 2.0))}
    DISK.clear()
    worker = fresh(configs, speed)
    tables = []
    for index in range(2):
        with autotune.sharded(index, 2, cls=Tuner) as measured:
            worker.run(64)
        tables.append(measured)
    assert worker.cache == {}, "a shard's winner stayed in the autotuner's memory"
    with autotune.replayed(autotune.merge_timings(tables), cls=Tuner) as counts:
        assert worker.run(64) == "BK: 64"
    assert counts["replayed"] == 4 and len(DISK) == 1


def test_the_warm_up_benchmarks_a_configuration_for_the_shorter_length(monkeypatch):
    import sys
    import types

    calls = []
    def benchmarker(fn, warmup=25, rep=100, quantiles=None):
        calls.append((warmup, rep))
        return [1.0]

    driver = types.SimpleNamespace(active=types.SimpleNamespace(get_benchmarker=lambda: benchmarker))
    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
    monkeypatch.setitem(sys.modules, "triton.runtime", types.ModuleType("triton.runtime"))
    monkeypatch.setitem(sys.modules, "triton.runtime.driver", types.SimpleNamespace(driver=driver))

    class Timed(Tuner):
        _do_bench = None

        @functools.cached_property  # as Triton 3.x declares it
        def do_bench(self):
            return driver.active.get_benchmarker()

        def _bench(self, *args, config, **meta):
            return self.do_bench(lambda: None, quantiles=(0.5, 0.2, 0.8))

    class Own(Timed):
        _do_bench = object()  # built with a benchmarker of its own

    configs = [Config(BK=16), Config(BK=32)]
    inside = Timed(configs, {})
    with autotune.benchmark_length(5, 20, cls=Timed):
        inside.run(8)
        Own(configs, {}).run(9)
    assert "do_bench" not in inside.__dict__, "the shorter benchmarker outlived the block"
    inside.run(10)
    assert calls == [(5, 20), (5, 20), (25, 100), (25, 100), (25, 100), (25, 100)]


def test_a_shard_uses_an_entry_an_earlier_unit_wrote():
    configs = [Config(BK=b) for b in (16, 32, 64)]
    speed = {str(c): t for c, t in zip(configs, (3.0, 1.0, 2.0))}
    DISK.clear()
    fresh(configs, speed).run(8)
    t = fresh(configs, speed)
    with autotune.sharded(1, 2, cls=Tuner) as measured:
        assert t.run(8) == "BK: 32"
    assert t.ran == [] and measured == {}


def test_the_hooks_are_removed_after_the_block_even_on_error():
    bench, check = Tuner._bench, Tuner.check_disk_cache
    for block in (autotune.sharded(0, 2, cls=Tuner), autotune.replayed({}, cls=Tuner)):
        try:
            with block:
                raise RuntimeError("kernel failed")
        except RuntimeError:
            pass
        assert (Tuner._bench, Tuner.check_disk_cache) == (bench, check)


def test_without_the_hooked_methods_a_shard_runs_whole():
    class Old:
        def run(self):
            return "ran"

    with autotune.sharded(0, 3, cls=Old) as measured, autotune.replayed({}, cls=Old) as counts:
        assert Old().run() == "ran"
    assert measured == {} and counts == {"replayed": 0, "benchmarked": 0}


# --------------------------------------------------------------------------- the scheduler

class Adapter:
    def __init__(self, name):
        self.name = name


def unit(adapter, backward, H=2):
    group = (("H", H), ("HV", H), ("K", 32), ("V", 32)) + ((("backward", True),) if backward else ())
    return (adapter, group, [{"T": 37}])


class StubWorker:
    """warmup.Worker without a process: logs what each job was given and when it ran; a shard
    'measures' the configurations of its residue class of five."""
    log, lock = [], threading.Lock()

    def __init__(self, workdir):
        pass

    def run(self, unit, device, timeout, index, role=None):
        t0 = time.monotonic()
        time.sleep(0.02)
        rec = {"adapter": unit[0].name, "group": dict(unit[1]), "shapes": len(unit[2]), "status": "ok"}
        if role and "shard" in role:
            k, n = role["shard"]
            rec["timings"] = {"kern:abc": {"(37,)": {f"c{i}": [float(i)] * 3 for i in range(5) if i % n == k}}}
        with self.lock:
            self.log.append({"group": dict(unit[1]), "role": role, "start": t0, "end": time.monotonic()})
        return rec

    def close(self):
        pass


def test_a_backward_unit_runs_as_shards_then_its_merge(monkeypatch):
    StubWorker.log.clear()
    monkeypatch.setattr(warmup, "Worker", StubWorker)
    fwd, bwd = Adapter("fwd"), Adapter("bwd")
    todo = [unit(fwd, False), unit(bwd, True)]
    done = []
    rec = warmup.run_selected((todo, []), "cpu", jobs=3, on_unit_done=done.append, shards=4)
    shards = [e for e in StubWorker.log if e["role"] and "shard" in e["role"]]
    merges = [e for e in StubWorker.log if e["role"] and "replay" in e["role"]]
    assert sorted(e["role"]["shard"] for e in shards) == [[k, 4] for k in range(4)]
    assert len(merges) == 1 and merges[0]["start"] >= max(e["end"] for e in shards)
    assert merges[0]["role"]["replay"] == {"kern:abc": {"(37,)": {f"c{i}": [float(i)] * 3 for i in range(5)}}}
    assert sorted(done) == ["bwd:backward", "fwd"], "a shard was counted as a unit done"
    groups = rec["groups"]
    assert [g.get("shard") for g in groups] == [None, "1/4", "2/4", "3/4", "4/4", None]
    assert [g["key"] is None for g in groups] == [False, True, True, True, True, False]
    assert groups[5]["key"] == warmup.unit_key("bwd", todo[1][1], todo[1][2])
    assert all("timings" not in g for g in groups)
    assert groups[5]["shards"] == 4


def test_one_shard_is_no_split(monkeypatch):
    StubWorker.log.clear()
    monkeypatch.setattr(warmup, "Worker", StubWorker)
    rec = warmup.run_selected(([unit(Adapter("bwd"), True)], []), "cpu", jobs=2, shards=1)
    assert [e["role"] for e in StubWorker.log] == [None]
    assert len(rec["groups"]) == 1 and rec["groups"][0]["key"]


def test_shards_of_a_unit_sharing_autotuned_kernels_wait_for_the_first_of_its_dims():
    a = Adapter("fla")
    a.warmup_share = "fla-chunk"
    dims = (("varlen", False), ("state_layout", "k_first"))
    lead = (a, unit(a, True)[1] + dims, [{"T": 37}])
    follower = (a, lead[1] + (("beta", "sigmoid"),), [{"T": 37}])
    todo, roles = warmup.shard_units([lead, follower], 2)
    assert [r and r[0] for r in roles] == ["shard", "shard", "merge", "shard", "shard", "merge"]
    order, waits = warmup.schedule(todo, roles)
    assert waits == {2: [0, 1], 3: [2], 4: [2], 5: [2, 3, 4]}
    assert order[:3] == [0, 1, 2], "the lead's shards and merge are not first"
