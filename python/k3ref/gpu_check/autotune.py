"""Triton's autotuners as the checks see them: which ones a kernel call uses, and the deep mode
(`--autotune-configs all`) that runs a golden check once per autotune configuration.

An autotuner benchmarks its configurations and keeps the fastest per key; a bug that lives in
one configuration (a miscompile at one block size and warp count) is invisible to the checks
whenever another configuration wins. The deep mode forces each configuration in turn: for
every autotuner the golden case's kernel call reaches (recorded around Autotuner.run) and
each of its configurations, `Autotuner.configs` is narrowed to that one configuration for one
call (Triton's autotuner then runs it without benchmarking; FLA's CachedAutotuner is a
subclass that defers to it) while the other autotuners keep their winners, and the golden
verdict is taken. A configuration the autotuner itself would discard for this shape (it does
not compile: out of resources, a compile-time assertion, ptxas) is reported as not
applicable, as the autotuner skips it; any other error, or a verdict that fails, fails the
check and names the kernel and the configuration.
"""
import contextlib

# Exceptions Triton's autotuner catches while benchmarking (the configuration is then skipped).
NOT_APPLICABLE = ("OutOfResources", "CompileTimeAssertionFailure", "PTXASError", "OutOfResourcesError")


def _autotuner_class():
    try:
        from triton.runtime.autotuner import Autotuner
    except Exception:  # no Triton: nothing is autotuned
        return None
    return Autotuner


@contextlib.contextmanager
def _replaced(cls, **methods):
    """Inside the block `cls`'s named attributes are the given functions; the originals are
    back after it, whatever happens inside (every hook of this module is installed so)."""
    saved = {name: getattr(cls, name) for name in methods}
    for name, f in methods.items():
        setattr(cls, name, f)
    try:
        yield
    finally:
        for name, f in saved.items():
            setattr(cls, name, f)


@contextlib.contextmanager
def recording():
    """Yields the list of Autotuner objects whose run() is called inside the block (in the
    order of their first call)."""
    cls = _autotuner_class()
    used = []
    if cls is None:
        yield used
        return
    original = cls.run

    def run(self, *args, **kwargs):
        if not any(self is u for u in used):
            used.append(self)
        return original(self, *args, **kwargs)

    with _replaced(cls, run=run):
        yield used


@contextlib.contextmanager
def pinned(autotuner, config):
    """The autotuner runs `config` (only) inside the block."""
    saved = autotuner.configs
    autotuner.configs = [config]
    try:
        yield
    finally:
        autotuner.configs = saved


def describe(config):
    """One line of a Triton Config: its kwargs, warps and stages."""
    kw = getattr(config, "kwargs", None) or {}
    parts = [f"{k}={v}" for k, v in sorted(kw.items())]
    for attr in ("num_warps", "num_stages", "num_ctas", "maxnreg"):
        v = getattr(config, attr, None)
        if v is not None and not (attr == "num_ctas" and v == 1):
            parts.append(f"{attr}={v}")
    return ", ".join(parts) or str(config)


def _unwrap(fn, limit=8):
    """The chain fn, fn.fn, ... (Autotuner -> Heuristics -> JITFunction)."""
    chain = []
    while fn is not None and len(chain) < limit:
        chain.append(fn)
        fn = getattr(fn, "fn", None)
    return chain


def kernel_name(obj):
    for f in _unwrap(obj):
        name = getattr(f, "__name__", None)
        if isinstance(name, str):
            return name
    return type(obj).__name__


# --------------------------------------------------------------------------- prop's outside draws

@contextlib.contextmanager
def first_config_only():
    """Inside the block every autotuner with several configurations runs its first one
    without benchmarking (a shape no bucket compiled then costs its compilation, not an
    autotune: 40-160 s for FLA chunk_kda). Verdicts do not depend on which configuration
    runs (the deep mode checks every one on the goldens)."""
    cls = _autotuner_class()
    if cls is None:
        yield
        return
    original = cls.run

    def run(self, *args, **kwargs):
        saved = self.configs
        if len(saved) > 1:
            self.configs = saved[:1]
        try:
            return original(self, *args, **kwargs)
        finally:
            self.configs = saved

    with _replaced(cls, run=run):
        yield


# Counts of prop's draws (run_drawn): inside a bucket, outside, and the times of each example.
DRAWN = {"inside": 0, "outside": 0, "unbucketed": 0, "outside_retried_with_autotune": 0, "times": []}


def run_drawn(run_case, adapter, case, device, progress=False):
    """prop's run of one drawn case: a case outside the buckets (case['bucket'] is None) runs
    with first_config_only, and again with the autotuner when that configuration does not
    compile for the shape (as the autotuner would skip it). `progress`: one line per example
    (prop --progress), for runs cut off by a time limit."""
    import time

    outside = "bucket" in case and case["bucket"] is None
    DRAWN["unbucketed" if "bucket" not in case else "outside" if outside else "inside"] += 1
    if outside:
        with first_config_only():
            ok, reason, src = run_case(adapter, case, device)
        if not ok and any(f"raised {name}" in reason for name in NOT_APPLICABLE):
            DRAWN["outside_retried_with_autotune"] += 1
            ok, reason, src = run_case(adapter, case, device)
    else:
        ok, reason, src = run_case(adapter, case, device)
    DRAWN["times"].append(time.time())
    if progress:
        print(f"prop example {len(DRAWN['times'])} {'outside' if outside else 'inside'} at {DRAWN['times'][-1]:.3f}: "
              f"{'pass' if ok else 'fail'}", flush=True)
    return ok, reason, src


# --------------------------------------------------------------------------- the warm-up's shards

def _table_id(autotuner):
    """Names one autotuner across processes: its kernel's module and name, and a digest of its
    configurations (two autotuners over one kernel with other configurations are told apart)."""
    import hashlib

    base = getattr(autotuner, "base_fn", None) or autotuner
    configs = "|".join(str(c) for c in getattr(autotuner, "configs", ()))
    digest = hashlib.sha256(configs.encode()).hexdigest()[:12]
    return f"{getattr(base, '__module__', '?')}.{getattr(base, '__qualname__', kernel_name(autotuner))}:{digest}"


def _position(autotuner, config):
    for i, c in enumerate(getattr(autotuner, "configs", ())):
        if c is config:
            return i
    import hashlib  # a configuration a pruning hook made anew: its text decides, in every process alike

    return int(hashlib.sha256(str(config).encode()).hexdigest(), 16)


class _NotCached(Exception):
    pass


def _hookable(cls):
    """Whether `cls` has the two methods the warm-up's hooks replace (Triton 3.x: _bench(*args,
    config, **meta) and check_disk_cache(tuning_key, configs, bench_fn)); without them a shard
    runs its unit whole and benchmarks keep Triton's length (more work, nothing wrong)."""
    return cls is not None and callable(getattr(cls, "_bench", None)) and callable(getattr(cls, "check_disk_cache", None))


@contextlib.contextmanager
def sharded(index, count, cls=None):
    """Shard `index` of `count` of a warm-up unit. Inside the block every autotuner benchmarks
    (and so compiles) only the configurations at positions p with p mod count == index; the
    others read as infinitely slow without running. Nothing is written to Triton's autotune
    cache (a winner out of a fraction of the configurations is not the kernel's winner). Yields
    {autotuner id: {str(tuning key): {str(config): timings}}}: the timings this shard measured,
    for `replayed` in the unit that merges the shards."""
    cls = cls or _autotuner_class()
    measured = {}
    if not _hookable(cls):
        yield measured
        return
    bench, check = cls._bench, cls.check_disk_cache
    inf = float("inf")
    chosen = []

    def _bench(self, *args, config, **meta):
        if _position(self, config) % count != index:
            return [inf, inf, inf]
        return bench(self, *args, config=config, **meta)

    def check_disk_cache(self, tuning_key, configs, bench_fn):
        def missing():
            raise _NotCached

        try:  # Triton's own look-up (its cache key): an entry an earlier unit wrote is used as is
            return check(self, tuning_key, configs, missing)
        except _NotCached:
            pass
        bench_fn()  # sets self.configs_timings and self.cache[tuning_key]
        chosen.append((self, tuning_key))
        mine = {str(c): t for c, t in self.configs_timings.items() if _position(self, c) % count == index}
        measured.setdefault(_table_id(self), {})[str(tuning_key)] = mine
        return False

    try:
        with _replaced(cls, _bench=_bench, check_disk_cache=check_disk_cache):
            yield measured
    finally:
        # A shard's winners are not the kernel's: the worker's next unit (its merge, say) must
        # not find them in the autotuners' memory (Triton then skips its disk cache).
        for tuner, key in chosen:
            tuner.cache.pop(key, None)


def merge_timings(tables):
    """One table out of the shards' `sharded` tables."""
    out = {}
    for table in tables:
        for kernel, keys in (table or {}).items():
            for key, timings in keys.items():
                out.setdefault(kernel, {}).setdefault(key, {}).update(timings)
    return out


@contextlib.contextmanager
def replayed(table, cls=None):
    """Inside the block an autotuner's benchmark of a configuration the shards timed returns
    their timing instead of running it; Triton's autotuner then picks the fastest and writes its
    cache entry (the whole configuration list, as an unsharded run would) from these timings.
    The tuning key is the one Triton's check_disk_cache receives, so an autotuner that does not
    cache its results (and a configuration no shard timed: its shard failed) is benchmarked
    here. Yields the counts of timings replayed and benchmarked."""
    cls = cls or _autotuner_class()
    counts = {"replayed": 0, "benchmarked": 0}
    if not _hookable(cls):
        yield counts
        return
    bench, check = cls._bench, cls.check_disk_cache

    def check_disk_cache(self, tuning_key, configs, bench_fn):
        self._k3ref_timings = table.get(_table_id(self), {}).get(str(tuning_key), {})
        try:
            return check(self, tuning_key, configs, bench_fn)
        finally:
            self._k3ref_timings = None

    def _bench(self, *args, config, **meta):
        timings = getattr(self, "_k3ref_timings", None) or {}
        if str(config) in timings:
            counts["replayed"] += 1
            return timings[str(config)]
        counts["benchmarked"] += 1
        return bench(self, *args, config=config, **meta)

    with _replaced(cls, _bench=_bench, check_disk_cache=check_disk_cache):
        yield counts


@contextlib.contextmanager
def benchmark_length(warmup_ms, rep_ms, cls=None):
    """Inside the block an autotuner's benchmark of one configuration runs Triton's benchmarker
    for `warmup_ms` + `rep_ms` of kernel time instead of its default 25 + 100 ms (an autotuner
    built with a benchmarker of its own keeps it). Each configuration still runs hundreds of
    times at these kernels' microseconds; the warm-up's processes share one GPU, whose time the
    benchmarks of a cold run wait on."""
    cls = cls or _autotuner_class()
    if not _hookable(cls):
        yield
        return
    bench = cls._bench
    short = []

    def shortened():
        if not short:
            from triton.runtime.driver import driver

            default = driver.active.get_benchmarker()
            short.append(lambda fn, quantiles=None: default(fn, warmup=warmup_ms, rep=rep_ms, quantiles=quantiles))
        return short[0]

    def _bench(self, *args, config, **meta):
        if getattr(self, "_do_bench", None) is not None:
            return bench(self, *args, config=config, **meta)
        missing = object()
        saved = self.__dict__.get("do_bench", missing)
        self.__dict__["do_bench"] = shortened()  # Triton reads self.do_bench (a cached property)
        try:
            return bench(self, *args, config=config, **meta)
        finally:
            if saved is missing:
                self.__dict__.pop("do_bench", None)
            else:
                self.__dict__["do_bench"] = saved

    with _replaced(cls, _bench=_bench):
        yield
