"""The cache directory and the warm-up: compile the planned shapes in parallel before any check.

    python3 -m k3ref.gpu_check warmup [--cache-dir DIR] [--jobs N] [the selection options of run]
    python3 -m k3ref.gpu_check run ... [--no-warmup] [--jobs N]   (run warms up first by default)

The cache directory (`--cache-dir`, else $K3REF_CACHE_DIR, else ~/.cache/k3ref) holds
Triton's cache in DIR/triton: the compiled kernels, and the autotune results of kernels
decorated with `cache_results=True` (FLA passes it unless FLA_CACHE_RESULTS=0), so a warm
directory skips both compilation and benchmarking. TRITON_CACHE_DIR is set to DIR/triton in
this process before any kernel is imported, and every child inherits it. A CI job saves DIR
after the run and restores it before the next (docs/verify-your-kernel.md); the last warm-up's
record is DIR/warmup.json. TRITON_CACHE_AUTOTUNING=1 (unless set) extends the autotune cache to
every autotuner.

The warm-up takes the shape plan (shapes.py): one unit per shape group of the kernels compiled
at run time (Triton; shapes.units). `--jobs` worker processes (default: the CPU count,
warmup_worker.py) each take the next unit when free, costliest first (cost_estimate), and keep
their imports from one unit to the next (torch and FLA cost ~20 s a process on a busy machine:
paid per worker, not per unit). This module is the scheduler; the kernels run in the workers.
A unit loads the adapter and runs the kernel on inputs of each of the group's shapes (the
golden case itself, or the inputs the metamorphic check builds), so Triton compiles and autotunes them into the cache; its results are discarded, only the time is kept:
per group wall, compile and autotune seconds (timing.py's hooks), the number of
compilations and configurations benchmarked, the autotuned kernels the calls reached with
their autotune keys and configuration counts (read from the decorators), and any error (the
check that later runs the shape reports its own). A warm-up never changes a verdict.

A backward unit (the longest: FLA's chunk_kda backward autotunes about eight kernels) runs as
`--k3ref-warmup-shards` processes, each compiling and timing its share of every autotuner's
configurations, then once more as their merge, which replays their timings so that Triton
writes the cache entry an unsharded run writes (shard_units). Every unit benchmarks a
configuration for BENCHMARK_MS of kernel time, not Triton's longer default.
"""
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CACHE_VARIABLE = "K3REF_CACHE_DIR"
# How long the warm-up benchmarks one configuration (Triton's warm-up and repetition, ms of
# kernel time; Triton's default is 25 + 100). A cold default tier on an H200 benchmarked 2,665
# configurations in 2,725 s summed over 16 processes sharing the GPU, about 1 s each for 125 ms
# of kernel time: the benchmarks queue on the one GPU. At 5 + 20 ms each configuration still
# runs hundreds of times (these kernels take microseconds); the winner is the fastest within
# the noise that sharing the GPU brings to either length.
BENCHMARK_MS = (5, 20)


def cache_dir(path=None):
    """The cache directory: `path`, else $K3REF_CACHE_DIR, else ~/.cache/k3ref (a front end
    calls this once, for the run's RunOptions.cache_dir)."""
    if path:
        return Path(path).expanduser().resolve()
    if os.environ.get(CACHE_VARIABLE):
        return Path(os.environ[CACHE_VARIABLE]).expanduser().resolve()
    return Path("~/.cache/k3ref").expanduser()


def configure_cache(path=None):
    """Points Triton at DIR/triton (TRITON_CACHE_DIR, Triton's own setting, inherited by every
    child); returns DIR (cache_dir(path)). Call before any kernel is imported."""
    d = cache_dir(path)
    os.environ["TRITON_CACHE_DIR"] = str(d / "triton")
    # Triton's knob that makes every autotuner keep its results on disk, not only those
    # decorated with cache_results=True (FLA's are; Liger's are not). An explicit 0 is kept.
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    return d


# --------------------------------------------------------------------------- the parent

DONE = "k3ref-warmup-done"  # a worker's answer to a unit, on its stdout (warmup_worker.serve)


class Worker:
    """One warm-up worker process (warmup_worker.serve) and the units sent to it. A unit that kills the
    process or outlasts the timeout is that unit's error; the next unit gets a new process."""

    def __init__(self, workdir):
        self.workdir, self.proc, self.lines, self.stderr_path, self.started = workdir, None, None, None, 0

    def _start(self):
        import queue
        import threading

        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        self.started += 1
        self.stderr_path = Path(self.workdir) / f"stderr_{self.started}.txt"
        with open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "k3ref.gpu_check.warmup_worker", "--serve"], env=env,
                                         text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
        self.lines = queue.Queue()

        def read(stream, q):
            for line in stream:
                q.put(line)
            q.put(None)  # end of stream: the process exited

        threading.Thread(target=read, args=(self.proc.stdout, self.lines), daemon=True).start()

    def _stderr_tail(self):
        try:
            tail = [line for line in self.stderr_path.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            tail = []
        return tail[-1] if tail else "(no stderr)"

    def _release(self):
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except Exception:
                pass
        self.proc = None

    def _stop(self):
        if self.proc is not None:
            try:
                self.proc.kill()
                self.proc.wait(timeout=30)
            except Exception:
                pass
            self._release()

    def close(self):
        """Ends the worker: stdin closed, so it leaves its loop and exits."""
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except Exception:
            self._stop()
            return
        self._release()

    def run(self, unit, device, timeout, index, role=None):
        """`role`: what the job adds for a shard ({"shard": [index, count]}) or for the unit
        that merges its shards ({"replay": their timings})."""
        import queue

        adapter, group, recipes = unit
        base = {"adapter": adapter.name, "group": dict(group), "shapes": len(recipes)}
        job, out = Path(self.workdir) / f"job_{index}.pickle", Path(self.workdir) / f"out_{index}.json"
        spec = getattr(adapter, "_k3ref_spec", None)
        try:
            payload = pickle.dumps({"sys_path": list(sys.path), "device": str(device),
                                    "modules": [spec] if spec else [], "adapter": pickle.dumps(adapter),
                                    "recipes": recipes, **(role or {})})
        except Exception as e:
            return dict(base, status="error", reason=f"the adapter cannot be pickled: {type(e).__name__}: {e}"[:300])
        job.write_bytes(payload)
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        first = self.started
        t0 = time.perf_counter()
        try:
            self.proc.stdin.write(f"{job}\t{out}\n")
            self.proc.stdin.flush()
        except OSError:
            pass  # the process is gone; the read below sees the end of its stream
        deadline = t0 + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.perf_counter()))
            except queue.Empty:
                self._stop()
                return dict(base, status="error", reason=f"warm-up worker killed after {timeout:g} s",
                            wall_s=time.perf_counter() - t0)
            if line is None:
                rc = self.proc.wait()
                self._release()
                return dict(base, status="error", wall_s=time.perf_counter() - t0,
                            reason=f"warm-up worker exited with {rc}: {self._stderr_tail()}"[:300])
            if line.startswith(DONE):
                break
        if not out.is_file():
            return dict(base, status="error", wall_s=time.perf_counter() - t0, reason="warm-up worker wrote no record")
        rec = json.loads(out.read_text())
        rec.update(base)
        rec["process_s"] = time.perf_counter() - t0
        rec["worker_process"] = first
        return rec


# A backward shape against a forward one: FLA's chunk_kda backward autotunes eight kernels
# (chunk_bwd, chunk_intra, wy_fast, chunk_delta_h, gate) where its forward autotunes four, and
# runs the forward too. An estimate for the order only; the record has the measured times.
BACKWARD_WEIGHT = 3.0


def is_backward(group):
    return bool(dict(group).get("backward"))


def pending_key(adapter_name, backward=False):
    """What a test waits for in the warm-up: its adapter's forward units, or (a backward test)
    its adapter's backward units, so that neither waits for the other's autotuning."""
    return f"{adapter_name}:backward" if backward else adapter_name


def cost_estimate(unit):
    """What the scheduler sorts by, largest first (longest processing time first: the units
    that autotune start before the ones that only compile, so none of them is left for the
    end). An adapter may state `warmup_weight` (relative cost of one shape); the default is 1."""
    adapter, group, recipes = unit
    weight = float(getattr(adapter, "warmup_weight", 1) or 1) * (BACKWARD_WEIGHT if is_backward(group) else 1.0)
    return weight * max(1, len(recipes))


def versions():
    """What a compiled kernel depends on besides its shape: a cache written under other
    versions is not taken as warm."""
    out = {"python": sys.version.split()[0]}
    for mod in ("torch", "triton"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:
            out[mod] = None
    return out


def unit_key(adapter_name, group, recipes):
    return json.dumps([adapter_name, sorted(dict(group).items()), recipes, versions()], sort_keys=True, default=str)


def warm_keys(directory):
    """Keys of the units recorded as finished ('ok') in DIR/warmup.json. Each worker only
    compiles into the Triton cache of DIR, so a unit finished there is compiled and autotuned:
    running it again costs a process start and imports (about 20 s for FLA) and compiles
    nothing. If DIR/triton was emptied by hand, the checks compile what they need (slower,
    not wrong)."""
    path = Path(directory) / "warmup.json" if directory else None
    if path is None or not path.is_file():
        return set()
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return set()
    return {g["key"] for g in record.get("groups", []) if g.get("status") in ("ok", "warm") and g.get("key")}


def select(work, device, warm=None):
    """(units to run, records of the units not run): warm ones (finished into this cache
    directory by an earlier warm-up) and those whose kernel cannot run here (probe)."""
    todo, skipped = [], []
    warm = warm or set()
    for unit in work:
        a = unit[0]
        key = unit_key(a.name, unit[1], unit[2])
        if key in warm:
            skipped.append({"adapter": a.name, "group": dict(unit[1]), "shapes": len(unit[2]), "status": "warm",
                            "reason": "compiled into this cache directory by an earlier warm-up", "key": key})
            continue
        why = a.probe(device) if hasattr(a, "probe") else None
        if why:
            skipped.append({"adapter": a.name, "group": dict(unit[1]), "shapes": len(unit[2]), "status": "skipped",
                            "reason": why})
        else:
            todo.append(unit)
    return todo, skipped


AUTOTUNE_DIMS = ("H", "HV", "K", "V", "varlen", "state_layout")


def autotune_dims(unit):
    """What the autotuned kernels of a unit key on, for adapters that share them
    (`warmup_share`: FLA's chunk adapters name one family): the head counts and sizes, varlen
    and the state layout (FLA's autotune keys; the gate, beta and norm flags select extra
    kernels but leave these kernels' keys alone). None: nothing known to be shared."""
    adapter, group, _ = unit
    share = getattr(adapter, "warmup_share", None)
    g = dict(group)
    if not share or not all(k in g for k in AUTOTUNE_DIMS):
        return None
    return (share, is_backward(group)) + tuple(g[k] for k in AUTOTUNE_DIMS)


# A backward unit is the default tier's longest: FLA's chunk_kda backward, measured on an H200,
# spent 214 s compiling and 175 s benchmarking its autotuned kernels' configurations in one
# process while the forward's units had ended. Its shards split the configurations of every
# autotuner it reaches (autotune.sharded) over `count` processes, each compiling and timing
# its share; the unit itself then runs once more, replaying their timings (autotune.replayed),
# so that Triton writes the same cache entry an unsharded run writes: the checks find every
# kernel compiled and every winner chosen.
BACKWARD_SHARDS = 4
SHARDS_HELP = (f"processes each backward unit of the warm-up is split over, each compiling and timing its share of "
               f"every autotuner's configurations (default {BACKWARD_SHARDS}; 1: not split)")


def shard_units(todo, shards=BACKWARD_SHARDS):
    """(units, roles): the backward units of `todo` each preceded by `shards` copies of it run
    as shards; roles[i] is None, ("shard", index, count, i of the merge) or ("merge", [i of
    its shards]). shards <= 1: nothing is split."""
    units, roles = [], []
    for unit in todo:
        if shards > 1 and is_backward(unit[1]):
            merge = len(units) + shards
            for k in range(shards):
                units.append(unit)
                roles.append(("shard", k, shards, merge))
            roles.append(("merge", list(range(merge - shards, merge))))
        else:
            roles.append(None)
        units.append(unit)
    return units, roles


def schedule(todo, roles=None):
    """(order, waits_for): the units by cost, largest first, and per unit the indices of the
    units it waits for. The first unit of each autotune_dims benchmarks the shared kernels'
    configurations into the cache; a later unit of the same dims started beside it would
    benchmark them again (measured on an H200: three such units at 85 configurations each, side
    by side), so it waits for the first and then benchmarks only its own kernels (6-31
    configurations measured): its cost is counted as a fifth. A merge waits for its shards (and
    they for the first of its dims); a shard costs what its unit costs, so that shards start
    first, and a merge too, so that it starts as soon as its shards end."""
    roles = roles or [None] * len(todo)
    first, waits_for = {}, {}
    for i, unit in enumerate(todo):
        if roles[i] and roles[i][0] == "shard":
            continue
        d = autotune_dims(unit)
        if d is None:
            continue
        if d in first:
            waits_for[i] = [first[d]]
        else:
            first[d] = i
    for i, role in enumerate(roles):
        if role and role[0] == "shard":
            waits_for[i] = list(waits_for.get(role[3], ()))
    for i, role in enumerate(roles):
        if role and role[0] == "merge":
            waits_for[i] = waits_for.get(i, []) + role[1]
    waits_for = {i: w for i, w in waits_for.items() if w}
    cost = {i: cost_estimate(u) / (5.0 if i in waits_for and not roles[i] else 1.0) for i, u in enumerate(todo)}
    return sorted(range(len(todo)), key=lambda i: -cost[i]), waits_for


def run_units(work, device, jobs=None, timeout=1800.0, progress=None, warm=None, shards=None):
    """Warms up the units `work` (shapes.units of a shape plan, or prop's buckets), `jobs`
    worker processes at a time: select, then run_selected. Returns the record: {jobs, wall_s,
    groups: [per group], totals}. `warm`: keys (unit_key) of units an earlier warm-up finished
    into the same cache directory; they are not run again."""
    return run_selected(select(work, device, warm), device, jobs, timeout, progress, shards=shards)


def run_selected(selected, device, jobs=None, timeout=1800.0, progress=None, on_unit_done=None, shards=None):
    """Runs the units select() kept on `jobs` persistent workers, each backward unit as
    `shards` shards and their merge (shard_units); on_unit_done(pending_key) after each unit (a
    shard is not one). Returns the warm-up record."""
    jobs = max(1, int(jobs or os.cpu_count() or 1))
    todo, skipped = selected
    t0 = time.perf_counter()
    todo, roles = shard_units(todo, BACKWARD_SHARDS if shards is None else int(shards))
    order, waits_for = schedule(todo, roles)
    timings = {}  # i of a merge -> the timings of its shards so far
    done = [None] * len(todo)
    import itertools
    import threading

    from . import autotune

    cond, counter = threading.Condition(), itertools.count()
    remaining = list(order)
    finished = set()

    def take():
        """The next unit in order whose first-of-dims has finished; waits while none is free."""
        with cond:
            while remaining:
                for i in remaining:
                    if all(j in finished for j in waits_for.get(i, ())):
                        remaining.remove(i)
                        return i
                cond.wait()
            return None

    def slot(workdir):
        w = Worker(workdir)
        try:
            while True:
                i = take()
                if i is None:
                    return
                unit, role = todo[i], roles[i]
                extra = ({"shard": list(role[1:3])} if role and role[0] == "shard"
                         else {"replay": timings.get(i, {})} if role else None)
                rec = None
                try:
                    rec = w.run(unit, device, timeout, next(counter), extra)
                finally:
                    with cond:
                        if rec is not None and role and role[0] == "shard":
                            timings[role[3]] = autotune.merge_timings([timings.get(role[3]), rec.pop("timings", None)])
                        finished.add(i)
                        cond.notify_all()
                rec["slot"] = Path(workdir).name
                waited = [j for j in waits_for.get(i, ()) if not (roles[j] and roles[j][0] == "shard")]
                if waited:
                    rec["waited_for"] = short_group(todo[waited[0]][1])
                done[i] = rec
                if role and role[0] == "shard":
                    rec["key"] = None  # warm only once its merge is: the merge's record carries the key
                    rec["shard"] = f"{role[1] + 1}/{role[2]}"
                else:
                    rec["key"] = unit_key(unit[0].name, unit[1], unit[2])
                    if role:
                        rec["shards"] = len(role[1])
                    if on_unit_done:
                        on_unit_done(pending_key(unit[0].name, is_backward(unit[1])))
                if progress:
                    shard = f" shard {rec['shard']}" if rec.get("shard") else ""
                    progress(f"warm-up {rec['adapter']} {short_group(rec['group'])}{shard}: {rec.get('status')} "
                             f"{rec.get('wall_s', 0):.1f}s (import {rec.get('import_s', 0) or 0:.1f}s, compile "
                             f"{rec.get('compile_s', 0):.1f}s, autotune {rec.get('autotune_s', 0):.1f}s)")
        finally:
            w.close()

    if todo:
        with tempfile.TemporaryDirectory(prefix="k3ref_warmup_") as d:
            n = min(jobs, len(todo))
            dirs = [Path(d) / f"worker{j}" for j in range(n)]
            for p in dirs:
                p.mkdir()
            with ThreadPoolExecutor(max_workers=n) as pool:
                list(pool.map(slot, dirs))
    groups = done + skipped
    totals = {k: sum(g.get(k, 0) or 0 for g in groups) for k in ("compile_s", "autotune_s", "compiles",
                                                               "configs_benchmarked", "import_s")}
    totals["worker_processes"] = len({(g.get("slot"), g.get("worker_process")) for g in done if g.get("slot")})
    return {"jobs": jobs, "wall_s": time.perf_counter() - t0, "groups": groups, "totals": totals,
            "errors": sum(g.get("status") == "error" for g in groups)}


def short_group(group):
    g = dict(group)
    if "test" in g:
        return f"test {g['test']}"
    head = "H{H} HV{HV} K{K} V{V}".format(**{k: g.get(k, "?") for k in ("H", "HV", "K", "V")})
    flags = [k if v is True else f"{k}={v}" for k, v in g.items() if k not in ("H", "HV", "K", "V") and v not in (False, None)]
    return head + (" " + " ".join(flags) if flags else "")


def write_record(record, directory):
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "warmup.json").write_text(json.dumps(record, indent=1, default=str))


def table(record):
    lines = [f"warm-up: {len(record['groups'])} groups, {record['jobs']} jobs, wall {record['wall_s']:.1f} s, "
             f"compile {record['totals']['compile_s']:.1f} s, autotune {record['totals']['autotune_s']:.1f} s "
             f"(summed over workers), {record['errors']} errors"]
    for g in record["groups"]:
        label = short_group(g['group']) + (f" shard {g['shard']}" if g.get("shard") else "")
        lines.append(f"  {g['adapter']:28s} {label:60s} {g.get('shapes', 0):3d} shapes "
                     f"{g.get('status', '?'):11s} wall {g.get('wall_s', 0):7.1f} compile {g.get('compile_s', 0):7.1f} "
                     f"autotune {g.get('autotune_s', 0):7.1f}" + (f"  {g['reason']}" if g.get("reason") else ""))
    return "\n".join(lines)


