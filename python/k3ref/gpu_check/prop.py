"""Property-based testing of a KDA kernel against the reference.

    python3 -m k3ref.gpu_check prop --kernel NAME [--examples N] [--seed S] [--max-T T] [--out DIR]
    python3 -m k3ref.gpu_check prop --kernel NAME --replay FILE

Hypothesis draws a case (shapes, options, values; the edges of the golden catalogue: odd T,
odd head sizes such as 100, extreme gates at -5 and beyond, beta near 0 and near 2, empty
varlen sequences, grouped value heads), runs the kernel, computes the reference in-process
(the k3ref Python module in double; libk3gc's fp64 GPU recurrence for long cases when a GPU
is present; the PyTorch fp64 recurrence when neither is there) and judges o and the final
state under the kernel's tolerance policy. On a failure Hypothesis shrinks the case to a
minimal one, which is written as a golden file (the layout of goldens/kda_*.safetensors,
reference at 256 bits when the module is available) and printed with the one command that
replays it. The seed printed at the start replays the whole run.

Judging: the one judge (k3ref.policy) under the adapter's contract or policy. For floor and contract rules the floor is the
larger of the measured rounding floor and the nominal one (metrics.nominal_floor): on the
few elements of a shrunk case the measured floor can be near zero by chance (reference
values that happen to lie near bf16 numbers), and a correct kernel must not fail for that.
"""
import hashlib
import json
import os
import random
import shlex
import sys
import time
from pathlib import Path

import torch

from . import registry
from .. import goldens
from . import lib, metrics as M
from .drawn_case import make_inputs, params_of  # noqa: F401  (params_of: prop.params_of for callers)
from .protocol import shapes_of

GENERATOR_VERSION = "k3gc.prop/1"

# --------------------------------------------------------------------------- reference

from .references import LONG_CASE_ELEMENTS, _module, compute_reference, module_reference  # noqa: E402,F401


# --------------------------------------------------------------------------- judging


# --------------------------------------------------------------------------- cases


def case_strategy(st, fixed, max_T):
    """A Hypothesis strategy of cases. `fixed` pins what the kernel cannot vary (e.g.
    FlashKDA: K = V = 128). Each choice lists its mildest value first: that is where
    Hypothesis shrinks to."""

    def pick(name, strategy):
        if name not in fixed:
            return strategy
        value = fixed[name]
        return st.sampled_from(value) if isinstance(value, list) else st.just(value)

    @st.composite
    def case(draw):
        c = {}
        c["H"] = draw(pick("H", st.integers(1, 2)))
        c["HV"] = c["H"] * draw(pick("group", st.sampled_from([1, 2, 3])))
        head = st.one_of(st.integers(1, 8), st.sampled_from([16, 31, 64, 100, 128]))
        c["K"] = draw(pick("K", head))
        c["V"] = draw(pick("V", head))
        if draw(pick("varlen", st.booleans())):
            lengths = draw(st.lists(st.integers(0, max(1, max_T // 3)), min_size=1, max_size=4))
            cu = [0]
            for n in lengths:
                cu.append(cu[-1] + n)
            if cu[-1] == 0:
                cu[-1] = 1
            c["B"], c["T"], c["cu_seqlens"] = 1, cu[-1], cu
        else:
            c["B"] = draw(pick("B", st.integers(1, 2)))
            c["T"] = draw(st.integers(1, max_T))
            c["cu_seqlens"] = None
        c["gate"] = draw(pick("gate", st.sampled_from(["log_decay", "lower_bound", "softplus"])))
        c["gate_base"] = "e"
        c["lower_bound"] = None
        c["A_log"] = c["dt_bias"] = False
        if c["gate"] == "log_decay":
            # no decay, mild, the safe-gate bound -5, beyond it
            c["g_range"] = draw(st.sampled_from([(-1.0, 0.0), (0.0, 0.0), (-5.0, -5.0), (-5.0, 0.0), (-8.0, -5.0),
                                                 (-12.0, 0.0)]))
        else:
            c["g_range"] = draw(st.sampled_from([(-4.0, 4.0), (-20.0, 20.0), (20.0, 30.0)]))
            # k3ref's softplus gate needs A_log (as FLA's does); the lower-bound gate may omit it.
            c["A_log"] = True if c["gate"] == "softplus" else draw(pick("A_log", st.booleans()))
            c["dt_bias"] = draw(pick("dt_bias", st.booleans()))
            if c["gate"] == "lower_bound":
                c["lower_bound"] = draw(pick("lower_bound", st.sampled_from([-5.0, -1.0, -0.25, -8.0])))
        c["beta"] = draw(pick("beta", st.sampled_from(["as_given", "sigmoid", "two_sigmoid"])))
        if c["beta"] == "as_given":
            ranges = [(0.0, 1.0), (0.0, 2.0**-8), (2.0 - 2.0**-6, 2.0)]  # beta near 0, near 2
        else:
            ranges = [(-4.0, 4.0), (-12.0, -8.0), (8.0, 12.0)]  # sigmoid near 0, near 1 (2 for two_sigmoid)
        c["beta_range"] = draw(st.sampled_from(ranges))
        c["qk_l2norm"] = draw(pick("qk_l2norm", st.booleans()))
        c["scale"] = draw(pick("scale", st.sampled_from([None, 0.5])))
        c["state_layout"] = draw(pick("state_layout", st.sampled_from(["k_first", "v_first"])))
        c["initial_state"] = draw(pick("initial_state", st.booleans()))
        c["all_states"] = False
        c["seed"] = draw(st.integers(0, 2**32 - 1))
        return c

    return case()


# Cases a kernel cannot take are pinned here rather than filtered (filtering would reject
# most draws for FlashKDA).
FIXED = {
    "flashkda.fwd": dict(K=128, V=128, group=1, gate="lower_bound", beta="sigmoid", qk_l2norm=True, A_log=True,
                         dt_bias=True, lower_bound=[-5.0, -1.0, -0.25]),
    "fla.chunk_kda[safe_gate]": dict(gate="lower_bound", lower_bound=[-5.0, -1.0, -0.25]),
}


def fixed_for(adapter):
    return dict(getattr(adapter, "prop_fixed", None) or FIXED.get(adapter.name, {}))


# --------------------------------------------------------------------------- golden writing


def write_failure(case, adapter, reason, out_dir, device):
    """Writes the case as a golden file; returns its path. The expected outputs are the
    reference at 256 bits (k3ref.kda at precision 'mp256') rounded once to double when the extension
    is present, else the fp64 reference used for judging (named in the metadata)."""
    inputs = make_inputs(case)
    params = params_of(case)
    if _module() is not None:
        o, final = module_reference(inputs, params, precision="mp256")
        precision = _module().tier_descriptions()["mp256"]  # what the goldens record for the tier
    else:
        o, final, src = compute_reference(inputs, params, device)
        precision = f"binary64 ({src})"
    digest = hashlib.sha256(json.dumps([case, adapter.name], sort_keys=True).encode()).hexdigest()[:10]
    safe = "".join(ch if ch.isalnum() else "_" for ch in adapter.name).strip("_")
    name = f"prop_{safe}_{digest}"
    tensors = {}
    for n in ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias", "cu_seqlens"):
        if n in inputs:
            tensors[n] = inputs[n]
    input_names = ",".join(tensors)
    tensors["o"] = o.to(torch.float64)
    tensors["final_state"] = final.to(torch.float64)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.safetensors"
    write_safetensors(path, tensors, {
        "k3ref.case": name,
        "k3ref.op": "kda.recurrent",
        "k3ref.seed": str(case["seed"]),
        "k3ref.params": json.dumps(params, separators=(",", ":")),
        "k3ref.generator_version": GENERATOR_VERSION,
        "k3ref.reference_precision": precision,
        "k3ref.inputs": input_names,
        "k3ref.outputs": "o,final_state",
        "k3ref.layout": "",
        "k3ref.policies": json.dumps({"o": "recurrent", "final_state": "recurrent"}, separators=(",", ":")),
        "k3ref.schema": goldens.SCHEMA,
        "k3gc.kernel": adapter.name,
        "k3gc.failure": reason[:1000],
    })
    return path


def python_path():
    """PYTHONPATH for the printed commands: the directory holding the k3ref package; and
    K3REF_CORE_PATH, when the extension comes from a build directory, is printed too."""
    return str(Path(__file__).resolve().parents[2])


def _env_prefix():
    core = os.environ.get("K3REF_CORE_PATH")
    return f"PYTHONPATH={python_path()}" + (f" K3REF_CORE_PATH={core}" if core else "")


def _interpreter():
    """The running interpreter, quoted for a shell: a replay must use the Python that has k3ref."""
    return shlex.quote(sys.executable or "python3")


def replay_command(path, adapter_name, extra=""):
    return f"{_env_prefix()} {_interpreter()} -m k3ref.gpu_check prop --kernel '{adapter_name}' --replay {path}{extra}"


# --------------------------------------------------------------------------- golden files

# The reader is k3ref.goldens, the writer k3ref.save (k3ref._safetensors); shrunk failures
# are written with it.
def write_safetensors(path, tensors, metadata):
    """The package's writer (k3ref.save), with the metadata values as strings."""
    from .._safetensors import save

    save(path, tensors, {k: str(v) for k, v in metadata.items()})


# --------------------------------------------------------------------------- runs


def run_case(adapter, case, device):
    """(passed, reason, reference source) of one case."""
    inputs = make_inputs(case)
    params = params_of(case)
    ref_o, ref_f, src = compute_reference(inputs, params, device)
    dev_inputs = {k: v.to(device) for k, v in inputs.items()}
    try:
        o, final = adapter.run(dev_inputs, params)
        if str(device).startswith("cuda"):
            torch.cuda.synchronize()
    except Exception as e:  # a kernel that raises on a valid case fails it
        return False, f"raised {type(e).__name__}: {str(e).splitlines()[0][:200]}", src
    ok, reason = judge(adapter, inputs, params, o, final, ref_o, ref_f)
    return ok, reason, src


def judge(adapter, inputs, params, o, final, ref_o, ref_f):
    """(passed, reason): the one judge (k3ref.policy) under the kernel's contract where it has
    one (docs/contracts.md), else under its policy; the floor of each tensor at least its
    nominal floor (metrics.nominal_floor: on the few elements of a shrunk case the measured
    floor can be near zero by chance). The property and a replay judge alike."""
    from .. import policy

    candidate, reference = {"o": o, "final_state": final}, {"o": ref_o, "final_state": ref_f}
    for what, x in candidate.items():
        if x is None:
            return False, f"{what}: the kernel returned None"
    floors = {n: M.nominal_floor(r, adapter.output_dtype) for n, r in reference.items()}
    if getattr(adapter, "contract_name", None):
        from . import contracts
        v = contracts.judge(adapter.contract_name, inputs, params, candidate, reference, floor_at_least=floors)
    else:
        v = policy.judge(reference, candidate, "kda.recurrent", adapter.policy, tensors=list(reference),
                         floor_at_least=floors)
    if v.exit_code == policy.EXIT_UNUSABLE:
        return False, v.reason
    return v.passed, "; ".join(f"{r.tensor}: {r.reason}" for r in v.results)


def property_run(adapter, examples=100, seed=None, max_T=48, out_dir="prop_failures", device="cpu", log=print,
                 buckets=None, outside_share=1.0, progress=False):
    """Runs the property; returns a dict: passed, examples run, seed, and on failure the
    shrunk case, the reason, the golden file and the replay command."""
    from hypothesis import HealthCheck, given, settings, strategies as st
    from hypothesis import seed as hypothesis_seed

    from . import autotune, shapes

    if seed is None:
        seed = random.SystemRandom().randrange(2**32)
    adapter.device_sync = str(device).startswith("cuda")
    if not adapter.available():
        return {"passed": None, "skipped": adapter.unavailable_reason, "seed": seed}
    state = {"examples": 0, "failure": None, "sources": set()}

    @hypothesis_seed(seed)
    @settings(max_examples=examples, deadline=None, database=None, print_blob=False,
              suppress_health_check=list(HealthCheck))
    @given(shapes.bucketed_strategy(st, case_strategy, fixed_for(adapter), max_T, buckets, outside_share))
    def prop(case):
        shapes = dict(B=case["B"], T=case["T"], H=case["H"], HV=case["HV"], K=case["K"], V=case["V"])
        from hypothesis import assume

        assume(adapter.unsupported(params_of(case), shapes) is None)
        state["examples"] += 1
        ok, reason, src = autotune.run_drawn(run_case, adapter, case, device, progress)  # shapes.py's buckets
        state["sources"].add(src)
        if not ok:
            state["failure"] = (case, reason)  # Hypothesis replays the shrunk case last
            raise AssertionError(reason)

    t0 = time.time()
    try:
        prop()
        return {"passed": True, "examples": state["examples"], "seed": seed, "seconds": time.time() - t0,
                "reference": sorted(state["sources"])}
    except AssertionError:
        case, reason = state["failure"]
    except KeyboardInterrupt:  # Ctrl-C, or `timeout -s INT`: where it stopped, not a traceback
        if state["failure"] is None:
            return {"passed": None, "interrupted": True, "examples": state["examples"], "seed": seed,
                    "seconds": time.time() - t0, "reference": sorted(state["sources"])}
        case, reason = state["failure"]  # stopped while shrinking: the failing case found so far
    path = write_failure(case, adapter, reason, out_dir, device)
    return {"passed": False, "examples": state["examples"], "seed": seed, "seconds": time.time() - t0,
            "case": case, "reason": reason, "golden": str(path), "reference": sorted(state["sources"]),
            "replay": replay_command(path, adapter.name)}


def replay(adapter, path, device):
    """Runs the kernel on one golden file (the written failure, or any KDA golden) and judges
    it as the property does. Returns (passed, reason)."""
    case = goldens.load_case(path)
    if case.op != "kda.recurrent":
        raise ValueError(f"{path}: op {case.op}, not kda.recurrent")
    if not adapter.available():
        return None, "not available: " + adapter.unavailable_reason
    why = adapter.unsupported(case.params, shapes_of(case.inputs))
    if why:
        return None, "unsupported: " + why
    inputs = {k: v.to(device) for k, v in case.inputs.items()}
    o, final = adapter.run(inputs, case.params)
    return judge(adapter, case.inputs, case.params, o, final, case.expected["o"], case.expected["final_state"])


def prepare(args, adapter, fixed, seed):
    """(buckets, outside share, the flags that replay this choice) for `prop`: the coverage
    buckets (shapes.prop_buckets on the golden directory's cases) and --seeded-shapes more
    drawn with the run's seed (shapes.seeded_buckets), warmed up in parallel (one unit per
    bucket on the warm-up's workers) unless --no-warmup or the share is 1."""
    from . import shapes, warmup
    from .protocol import UsageError

    share = float(getattr(args, "outside_share", 1.0))
    if not 0 <= share <= 1:
        raise UsageError(f"--outside-share {share}: must be in [0, 1]")
    n_seeded = int(getattr(args, "seeded_shapes", 0))
    if n_seeded < 0:
        raise UsageError(f"--seeded-shapes {n_seeded}: must be at least 0")
    flags = f" --outside-share {share:g} --seeded-shapes {n_seeded}"
    if share >= 1:
        return None, share, flags
    if not shapes.compiles_at_run_time(adapter):
        print(f"prop: draws without shape buckets: {adapter.name} is built {shapes.compiler_of(adapter)}", flush=True)
        return None, 1.0, flags
    suite = []
    try:
        from .. import goldens

        suite = goldens.load_suite(goldens.directory(), ops=("kda.recurrent",))
    except Exception as e:  # no golden directory here: the coverage buckets alone
        print(f"prop: golden directory not read ({type(e).__name__}); buckets without the goldens' shapes")
    coverage = shapes.prop_buckets(adapter, fixed, suite)
    buckets = coverage + shapes.seeded_buckets(adapter, fixed, coverage, n_seeded, seed)
    print(f"prop: {len(buckets)} shape buckets ({len(coverage)} for coverage, {len(buckets) - len(coverage)} drawn "
          f"with the seed), {share:.1%} of draws outside them (cache {adapter.run_options.cache_dir})",
          flush=True)
    if buckets and not getattr(args, "no_warmup", False) and shapes.compiler_of(adapter) == "triton":
        work = [(adapter, tuple(sorted(b.items())), [{"prop_case": c} for c in shapes.bucket_cases(b, args.max_T, fixed)])
                for b in buckets]
        record = warmup.run_units(work, args.device, jobs=args.jobs, timeout=args.warmup_timeout,
                           progress=lambda line: print(line, flush=True))
        print(warmup.table(record), flush=True)
        warmup.write_record(dict(record, prop_buckets=buckets),
                            Path(adapter.run_options.cache_dir or ".") / "prop")
    return buckets, share, flags


def rate(seconds, examples):
    """Examples per minute overall and after the first minute of drawing (autotune.DRAWN)."""
    from .autotune import DRAWN

    times = DRAWN["times"]
    rate = 60.0 * examples / seconds if seconds > 0 else float("nan")
    after = [t for t in times if times and t - times[0] >= 60.0]
    late = float("nan")
    if times and times[-1] - times[0] > 60.0:
        late = 60.0 * len(after) / (times[-1] - times[0] - 60.0) if times[-1] - times[0] > 60.0 else float("nan")
    return (f"prop rate: {rate:.1f} examples/minute overall, {late:.1f} after the first minute; "
            f"draws inside buckets {DRAWN['inside']}, outside {DRAWN['outside']} "
            f"({DRAWN['outside_retried_with_autotune']} re-run with the autotuner), without buckets "
            f"{DRAWN['unbucketed']}")


def main(args, opts):
    """`prop`: fails closed. An unknown kernel is a usage error (exit 2); a kernel that is not
    available, or a replayed file it does not support, exits 1 with the reason. `opts`: the
    command's RunOptions (cli.command_options)."""
    from .protocol import UsageError
    from .registry import AdapterSpecError, discover

    lib.use(opts.kernel_path("lib"))
    try:
        extra, _ = discover(specs=args.adapter, entry_points=True, options=opts)
        adapter = registry.kernel_by_name(args.kernel, extra=extra, options=opts)
    except (AdapterSpecError, ValueError) as e:
        raise UsageError(str(e).splitlines()[0]) from e
    from .run import device_of

    args.device = device_of(args.device)
    if not hasattr(adapter, "run") or adapter.family != "kda":
        raise UsageError(f"--kernel {args.kernel}: prop draws KDA cases; {adapter.name} is a {adapter.family} adapter")
    adapter.device_sync = args.device.startswith("cuda")
    if not adapter.available():
        print(f"FAIL {adapter.name}: not available, nothing was tested: {adapter.unavailable_reason}")
        return 1
    if args.replay:
        ok, reason = replay(adapter, args.replay, args.device)
        status = {True: "PASS", False: "FAIL", None: "FAIL"}[ok]
        print(f"{status} {adapter.name} on {args.replay}: {reason}")
        return 0 if ok else 1
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    flags = (f" --fla-path {args.fla_path}" if args.fla_path else "") + (
        f" --flashkda-path {args.flashkda_path}" if args.flashkda_path else "") + "".join(
        f" --adapter {spec}" for spec in args.adapter) + "".join(f" --set {item}" for item in args.set)
    buckets, share, bucket_flags = prepare(args, adapter, fixed_for(adapter), seed)  # shapes.py
    flags += bucket_flags
    print(f"prop: kernel {adapter.name}, {args.examples} examples, T <= {args.max_T}, seed {seed}", flush=True)
    print(f"replay the whole run: {_env_prefix()} {_interpreter()} -m k3ref.gpu_check prop "
          f"--kernel '{adapter.name}' --examples {args.examples} --max-T {args.max_T} --seed {seed}{flags}", flush=True)
    res = property_run(adapter, args.examples, seed, args.max_T, args.out, args.device, buckets=buckets,
                       outside_share=share, progress=args.progress)
    if res.get("seconds"):
        print(rate(res["seconds"], res["examples"]), flush=True)
    if res.get("interrupted"):
        print(f"STOPPED {adapter.name}: interrupted after {res['examples']} of {args.examples} examples in "
              f"{res['seconds']:.1f} s, none failing; not a pass of the run asked for")
        return 130
    if res["passed"] is None:
        print(f"FAIL {adapter.name}: not available, nothing was tested: {res['skipped']}")
        return 1
    if res["passed"] and res["examples"] == 0:
        print(f"FAIL {adapter.name}: no drawn case was supported by the kernel, nothing was tested")
        return 1
    if res["passed"]:
        print(f"PASS {adapter.name}: {res['examples']} examples in {res['seconds']:.1f} s "
              f"(reference: {', '.join(res['reference'])})")
        return 0
    print(f"FAIL {adapter.name} after {res['examples']} kernel runs (drawing and shrinking); shrunk case:")
    print(json.dumps(res["case"]))
    print(f"reason: {res['reason']}")
    print(f"written: {res['golden']}")
    print(f"replay this case: {res['replay']}{flags}")
    return 1


if __name__ == "__main__":  # the child of the `prop` command (cli.in_child)
    from . import cli

    sys.exit(cli.command_child(main))
