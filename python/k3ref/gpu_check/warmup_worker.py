"""A warm-up worker process: `python3 -m k3ref.gpu_check.warmup_worker --serve`, started by
warmup.Worker (the scheduler, warmup.py), runs the units sent to it one after the other.

A unit loads the adapter and runs the kernel on inputs of each of the group's shapes (the
golden case itself, the inputs the metamorphic check builds, or a drawn case of a `prop`
bucket), so that Triton compiles and autotunes them into the cache directory; its results
are discarded, only the time is kept (timing.py's hooks, the autotuners reached: the record
the scheduler collects). The worker keeps its imports from one unit to the next.
"""
import contextlib
import json
import os
import pickle
import sys
import time
from pathlib import Path

from .warmup import BENCHMARK_MS, DONE


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


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] == "--serve":
        sys.exit(serve())
    print("usage: python3 -m k3ref.gpu_check warmup ... (the --serve form is internal)", file=sys.stderr)
    sys.exit(2)
