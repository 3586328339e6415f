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
at run time (Triton). `--jobs` worker processes (default: the CPU count) each take the next
unit when free, costliest first (cost_estimate), and keep their imports from one unit to the
next (torch and FLA cost ~20 s a process on a busy machine: paid per worker, not per unit).
A unit loads the adapter and runs the kernel on inputs of each of the group's shapes (the golden case itself, or the inputs the metamorphic check builds), so Triton
compiles and autotunes them into the cache; its results are discarded, only the time is kept:
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
import contextlib
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
    """The cache directory: `path`, else $K3REF_CACHE_DIR, else ~/.cache/k3ref."""
    if path:
        return Path(path).expanduser().resolve()
    if os.environ.get(CACHE_VARIABLE):
        return Path(os.environ[CACHE_VARIABLE]).expanduser().resolve()
    return Path("~/.cache/k3ref").expanduser()


def configure_cache(path=None):
    """Points Triton at DIR/triton (TRITON_CACHE_DIR, inherited by every child) and
    $K3REF_CACHE_DIR at DIR; returns DIR. Call before any kernel is imported."""
    d = cache_dir(path)
    os.environ[CACHE_VARIABLE] = str(d)
    os.environ["TRITON_CACHE_DIR"] = str(d / "triton")
    # Triton's knob that makes every autotuner keep its results on disk, not only those
    # decorated with cache_results=True (FLA's are; Liger's are not). An explicit 0 is kept.
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    return d


# --------------------------------------------------------------------------- inputs of a shape

def inputs_of(adapter, recipe, device):
    """(inputs on device, params) of one planned shape (shapes.Shape.recipe)."""
    if "golden" in recipe:
        from .. import goldens

        case = goldens.load_case(recipe["golden"])
        inputs = {k: v.to(device) for k, v in case.inputs.items()}
        if "initial_state" in inputs and adapter.kind != "reference":
            inputs["initial_state"] = inputs["initial_state"].float()
        return inputs, case.params
    if "config" in recipe:
        from .problems import make_problem

        return make_problem(recipe["config"], recipe["T"], 0, device, cu_seqlens=recipe.get("cu_seqlens"))
    if "check" in recipe:  # no shape model: warm-up runs the check itself (child() does)
        return None, None
    if "prop_case" in recipe:
        from .drawn_case import make_inputs, params_of

        case = recipe["prop_case"]
        return {k: v.to(device) for k, v in make_inputs(case).items()}, params_of(case)
    raise ValueError(f"unknown warm-up recipe {sorted(recipe)}")


# --------------------------------------------------------------------------- the worker process

def child(job_path, out_path):
    """Runs one group's shapes (the job pickled at job_path); writes its record as JSON.
    Called once per unit by a worker (serve): imports made for an earlier unit are kept, so
    only a worker's first unit pays them (import_s); the counters are this unit's alone."""
    with open(job_path, "rb") as f:
        job = pickle.load(f)
    sys.path[:] = job["sys_path"]
    os.environ.update(job.get("env", {}))
    t0 = time.perf_counter()
    rec = {"started": time.time(), "shapes": len(job["recipes"]), "errors": [], "kernels": [], "pid": os.getpid()}
    from . import autotune, timing

    status = timing.install()
    rec["timing"] = dict(status)
    before = timing.COUNTERS.snapshot()
    from .registry import import_module_of

    for spec in job.get("modules", ()):
        import_module_of(spec)
    adapter = pickle.loads(job["adapter"])
    device = job["device"]
    if not adapter.available():
        rec.update(status="unavailable", reason=adapter.unavailable_reason)
    else:
        rec["import_s"] = time.perf_counter() - t0
        adapter.device_sync = str(device).startswith("cuda")
        seen = {}
        shard, replay = job.get("shard"), job.get("replay")
        role = (autotune.sharded(*shard) if shard else autotune.replayed(replay) if replay is not None
                else contextlib.nullcontext(None))
        with autotune.benchmark_length(*BENCHMARK_MS), role as shard_record:
            run_recipes(job, adapter, device, rec, seen)
        if shard:
            rec["timings"] = shard_record
        elif replay is not None:
            rec["replay"] = shard_record
        from .shapes import autotuner_info, uncovered_keys

        rec["kernels"] = [autotuner_info(u) for u in seen.values()]
        rec["uncovered_keys"] = uncovered_keys(rec["kernels"])
        rec["status"] = "error" if rec["errors"] else "ok"
    rec.update({k: v - before[k] for k, v in timing.COUNTERS.snapshot().items()})
    rec["wall_s"] = time.perf_counter() - t0
    rec["finished"] = time.time()
    Path(out_path).write_text(json.dumps(rec))
    return 0


def run_recipes(job, adapter, device, rec, seen):
    """The kernel calls of one unit: each recipe's shape; the autotuners reached go into `seen`."""
    from . import autotune

    for recipe in job["recipes"]:
        try:
            with autotune.recording() as used:
                if recipe.get("backward"):
                    run_backward(adapter, recipe["golden"], device, rec)
                elif "check" in recipe:
                    from ..goldens import load_case

                    case = load_case(recipe["case_path"]) if recipe.get("case_path") else None
                    adapter.run_check(recipe["check"], case, device)
                else:
                    inputs, params = inputs_of(adapter, recipe, device)
                    adapter.run(inputs, params)
                if adapter.device_sync:
                    import torch

                    torch.cuda.synchronize()
            for u in used:
                seen.setdefault(id(u), u)
        except Exception as e:  # the check of this shape will report it; the warm-up goes on
            rec["errors"].append(f"{type(e).__name__}: {e}".splitlines()[0][:300])


def run_backward(adapter, golden, device, rec):
    """One gradient golden forward and backward through the adapter (backward.py), so that the
    backward kernels compile and autotune; a version without a backward is noted, not an error."""
    from ..goldens import load_case
    from . import backward
    from .protocol import NotSupported

    case = load_case(golden)
    try:
        adapter.run_backward(backward.gradient_inputs(case, device), case.params, case.tensors["d_o"],
                             case.tensors["d_final_state"])
    except NotSupported as e:
        rec.setdefault("not_applicable", []).append(str(e)[:300])


DONE = "k3ref-warmup-done"


def serve():
    """A worker: runs units (a job path and an output path per line of stdin) one after the
    other in this process and answers each with a line on the protocol stream. The imports of
    torch and of the kernel (about 20 s for FLA on a busy machine) are paid once per worker,
    not once per unit. Anything a kernel prints goes to stderr, so stdout carries only the
    protocol."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    for line in sys.stdin:
        job_path, out_path = line.rstrip("\n").split("\t")
        try:
            child(job_path, out_path)
        except BaseException as e:  # this unit's error; the worker takes the next one
            if isinstance(e, KeyboardInterrupt):
                raise
            Path(out_path).write_text(json.dumps({"status": "error", "errors": [f"{type(e).__name__}: {e}"[:300]],
                                                  "reason": f"{type(e).__name__}: {e}"[:300]}))
        proto.write(f"{DONE}\t{out_path}\n")
    return 0


# --------------------------------------------------------------------------- the parent

def shapes_mod():
    from . import shapes

    return shapes


def units(plan, adapters):
    """[(adapter, group, recipes)]: one unit per shape group of an adapter declared to be
    compiled by Triton (shapes.compiler_of; an adapter of unknown build is planned, counted,
    but not warmed up: declare `compiler = "triton"` on it)."""
    by_name = {a.name: a for a in adapters if shapes_mod().compiler_of(a) == "triton"}  # declared only
    out = []
    for (name, group), shapes in plan.groups().items():
        a = by_name.get(name)
        if a is not None:
            out.append((a, group, [s.recipe for s in shapes]))
    for name, tests in plan.untracked.items():
        a = by_name.get(name)
        for test_id, check, case_path in tests if a is not None else ():
            out.append((a, (("test", test_id),), [{"check": check, "case_path": case_path}]))
    return out


class Worker:
    """One warm-up worker process (serve) and the units sent to it. A unit that kills the
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
            self.proc = subprocess.Popen([sys.executable, "-m", "k3ref.gpu_check.warmup", "--serve"], env=env,
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

    def run(self, unit, device, timeout, env, index, role=None):
        """`role`: what the job adds for a shard ({"shard": [index, count]}) or for the unit
        that merges its shards ({"replay": their timings})."""
        import queue

        adapter, group, recipes = unit
        base = {"adapter": adapter.name, "group": dict(group), "shapes": len(recipes)}
        job, out = Path(self.workdir) / f"job_{index}.pickle", Path(self.workdir) / f"out_{index}.json"
        spec = getattr(adapter, "_k3ref_spec", None)
        try:
            payload = pickle.dumps({"sys_path": list(sys.path), "env": dict(env), "device": str(device),
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


def run(plan, adapters, device, jobs=None, timeout=1800.0, progress=None, env=None, warm=None, shards=None):
    """Warms up every group of the plan, `jobs` worker processes at a time. Returns the
    record: {jobs, wall_s, groups: [per group], totals}. `warm`: keys (unit_key) of units an
    earlier warm-up finished into the same cache directory; they are not run again."""
    return run_units(units(plan, adapters), device, jobs, timeout, progress, env, warm, shards)


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


def run_units(work, device, jobs=None, timeout=1800.0, progress=None, env=None, warm=None, shards=None):
    """select, then run_selected: the warm-up record of the units `work`."""
    return run_selected(select(work, device, warm), device, jobs, timeout, progress, env, shards=shards)


def run_selected(selected, device, jobs=None, timeout=1800.0, progress=None, env=None, on_unit_done=None,
                 shards=None):
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
                    rec = w.run(unit, device, timeout, env or {}, next(counter), extra)
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


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] == "--serve":
        sys.exit(serve())
    print("usage: python3 -m k3ref.gpu_check warmup ... (the --serve form is internal)", file=sys.stderr)
    sys.exit(2)
