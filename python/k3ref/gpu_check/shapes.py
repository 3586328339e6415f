"""The shape plan: which kernel specialisations a run compiles, grouped so that each group is
compiled (and autotuned) once, in parallel, before any check runs (warmup.py).

A Triton kernel is compiled once per *specialisation*: the values of its `tl.constexpr`
arguments, the dtypes of its tensors, whether an optional argument is None, and, for every
integer argument not marked `do_not_specialize`, whether it equals 1 and whether it is
divisible by 16. `@triton.autotune(configs, key=[...])` benchmarks every configuration once
per distinct value of its key arguments. FLA's KDA kernels key on the head counts and head
sizes, the varlen flag and the state layout (['H', 'HV', 'K', 'V', 'BT', 'BK', 'BV',
'IS_VARLEN', 'STATE_V_FIRST'] and the like), never on T: a new T reuses the autotune result
and only recompiles when its divisibility class is new (seconds, not the minutes an autotune
costs).

So a compiled *shape* here is (adapter, group, integer classes), where the *group* is what the
autotune keys and constexpr arguments see (for a KDA kernel: H, HV, K, V, varlen, state
layout and the gate / beta / norm options the adapter turns into kernel flags) and the
integer classes are those of T, B, the number of sequences and the number of 64-token
chunks. The group is the unit of warm-up (`units`; warmup.py runs them on a pool of worker processes).

What a kernel specialises on is read from its decorators where the library exposes them
(`autotuner_info`: Triton's Autotuner.keys and .configs, JITFunction.params and their
is_constexpr / do_not_specialize; the warm-up's workers record them per group) and declared per adapter
where it does not (`Adapter.shape_key(params, shapes)`, else the KDA default `kda_group`,
which covers every autotune key FLA's KDA kernels use: `uncovered_keys` names any that a
kernel reports and the default does not model). The plan is a model; the compilations it
causes are measured (timing.py), and the report gives both.
"""
import math
from dataclasses import dataclass, field

from .autotune import _unwrap, kernel_name
from .problems import CONFIGS, P_SPLIT, T_META
from .protocol import KDA_METAMORPHIC, MutantTest

# --------------------------------------------------------------------------- the key model

# How a kernel is built, by adapter class (an adapter's own `compiler` attribute wins).
# Only "triton" adapters compile per shape at run time; the others are built ahead of time.
COMPILER = {
    "FlaAdapter": "triton",
    "FlaServingAdapter": "triton",
    "FlaChunkIntermediateAdapter": "triton",
    "LigerAttnResAdapter": "triton",
    "FlashKdaAdapter": "ahead of time (CUTLASS extension)",
    "FlashKdaVarlenAdapter": "ahead of time (CUTLASS extension)",
    "LibKernelAdapter": "ahead of time (libk3gc, CUDA)",
    "LibReferenceAdapter": "ahead of time (libk3gc, CUDA)",
    "TorchKernelAdapter": "none (PyTorch operators)",
    "TorchServingAdapter": "none (PyTorch operators)",
    "TorchtitanQbAdapter": "none (PyTorch operators)",
}

CHUNK = 64  # FLA's chunk length BT: the number of chunks is an integer argument of its kernels


def compiler_of(adapter):
    own = getattr(adapter, "compiler", None)
    if own:
        return own
    for cls in type(adapter).__mro__:
        if cls.__name__ in COMPILER:
            return COMPILER[cls.__name__]
    return "unknown (treated as compiled per case)"


def compiles_at_run_time(adapter):
    c = compiler_of(adapter)
    return c == "triton" or c.startswith("unknown")


def int_class(n):
    """Triton's specialisation of one integer argument: == 1, divisible by 16, or neither."""
    n = int(n)
    return "1" if n == 1 else ("16k" if n % 16 == 0 else "n")


def kda_group(adapter, params, shapes):
    """The KDA default group: everything FLA's KDA kernels take as an autotune key, a
    constexpr or a None-or-tensor argument, from the case alone (not T)."""
    gate = params.get("gate", "log_decay")
    return (
        ("H", shapes["H"]), ("HV", shapes["HV"]), ("K", shapes["K"]), ("V", shapes["V"]),
        ("varlen", bool(params.get("cu_seqlens"))),
        ("state_layout", params.get("state_layout", "k_first")),
        ("gate", gate),
        ("A_log", bool(params.get("A_log")) and gate != "log_decay"),
        ("dt_bias", bool(params.get("dt_bias")) and gate != "log_decay"),
        ("lower_bound", params.get("lower_bound") is not None and gate == "lower_bound"),
        ("beta", params.get("beta", "as_given")),
        ("qk_l2norm", bool(params.get("qk_l2norm"))),
        ("initial_state", bool(params.get("initial_state", True))),
    )


# The FLA autotune key names kda_group models (each is a function of the group's fields or a
# constant of the kernel: BT, BC, NC are fixed chunk sizes; BK, BV follow K, V; D is K).
MODELLED_KEYS = {"H", "HV", "K", "V", "D", "BT", "BC", "NC", "BK", "BV", "IS_VARLEN", "STATE_V_FIRST",
                 "USE_G", "USE_GK", "USE_GV", "USE_G_GAMMA", "USE_DW", "REVERSE", "S"}


def uncovered_keys(kernels):
    """Autotune key names reported by the kernels (autotuner_info dicts) that kda_group does
    not model: the plan may merge shapes those keys separate. Empty when all are modelled."""
    names = set()
    for k in kernels:
        names |= set(k.get("autotune_keys") or ())
    return sorted(names - MODELLED_KEYS)


def int_classes(params, shapes):
    """The integer classes of one run: T (total tokens), B, the number of sequences, the
    number of 64-token chunks (summed over sequences in varlen)."""
    cu = params.get("cu_seqlens")
    T, B = shapes["T"], shapes["B"]
    if cu:
        lengths = [e - b for b, e in zip(cu[:-1], cu[1:])]
        n_seq, chunks = len(lengths), sum(math.ceil(n / CHUNK) for n in lengths)
    else:
        n_seq, chunks = B, B * math.ceil(T / CHUNK)
    return (("T", int_class(T)), ("B", int_class(B)), ("N", int_class(n_seq)), ("NT", int_class(chunks)))


def group_of(adapter, params, shapes):
    own = getattr(adapter, "shape_key", None)
    if callable(own):
        return tuple(own(params, shapes))
    return kda_group(adapter, params, shapes)


# --------------------------------------------------------------------------- runs of each check

def metamorphic_runs(check):
    """(T, cu_seqlens) of every kernel run a metamorphic check makes (checks.py), from the
    constants the checks use; tests/gpu_check/speed_test.py records the runs and compares."""
    cu = [0, 37, 38, T_META]
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    return {
        "causality": [(T_META, None)],
        "suffix": [(T_META + 28, None), (T_META, None)],
        "varlen": [(T_META, cu)] + [(n, None) for n in lengths],
        "split": [(T_META, None), (P_SPLIT, None), (T_META - P_SPLIT, None)],
        "determinism": [(T_META, cu)],
        "poisoned_memory": [(T_META, cu)],
        "inputs_unchanged": [(T_META, cu)],
    }.get(check, [])


def config_params(c, T, cu):
    """The golden-style params and shapes of problems.make_problem(c, T, ..., cu_seqlens=cu)."""
    params = dict(gate=c["gate"], lower_bound=c["lower_bound"], beta=c["beta"], qk_l2norm=c["qk_l2norm"], scale=None,
                  state_layout=c["state_layout"], A_log=c["gate"] != "log_decay", dt_bias=c["gate"] != "log_decay",
                  cu_seqlens=cu, initial_state=True, g_range=list(c["g_range"]))
    shapes = dict(B=1, T=T, H=c["H"], HV=c["HV"], K=c["K"], V=c["V"])
    return params, shapes


def case_shapes(case):
    q, v = case.inputs["q"], case.inputs["v"]
    B, T, H, K = q.shape
    return dict(B=B, T=T, H=H, K=K, HV=v.shape[2], V=v.shape[3])


# --------------------------------------------------------------------------- metamorphic configs

def _properties(c):
    """What a metamorphic configuration was chosen to exercise (problems.CONFIGS): grouped
    value heads, a head size that is not a multiple of 16, the in-kernel lower-bound gate
    with sigmoid beta, L2 norm and the V-first state at K = V = 128."""
    props = set()
    if c["HV"] > c["H"]:
        props.add("gva")
    if c["K"] % 16:
        props.add("K_not_16k")
    if c["V"] % 16:
        props.add("V_not_16k")
    if c["gate"] == "lower_bound" and c["beta"] == "sigmoid" and c["qk_l2norm"] and c["state_layout"] == "v_first":
        props.add("k3_options")
    return props


def golden_configs(suite):
    """A metamorphic configuration per KDA golden case: the case's head counts, head sizes and
    options, the value ranges of the configuration it stands for."""
    out = []
    for case in suite:
        if case.op != "kda.recurrent":
            continue
        p, s = case.params, case_shapes(case)
        gate = p.get("gate", "log_decay")
        if gate != "log_decay" and not (p.get("A_log") and p.get("dt_bias")):
            continue  # make_problem always gives the in-kernel gate both A_log and dt_bias
        out.append(dict(name=f"{case.name}_shape", H=s["H"], HV=s["HV"], K=s["K"], V=s["V"], gate=gate,
                        g_range=(-1.0, 0.0) if gate == "log_decay" else (-4.0, 4.0),
                        beta=p.get("beta", "as_given"), qk_l2norm=bool(p.get("qk_l2norm")),
                        state_layout=p.get("state_layout", "k_first"),
                        lower_bound=p.get("lower_bound") if gate == "lower_bound" else None,
                        golden=case.name))
    return out


def _supports(adapter, c):
    params, shapes = config_params(c, 100, None)
    return adapter.unsupported(params, shapes) is None


def choose_metamorphic_config(adapter, suite):
    """(config, why) for the adapter's metamorphic checks: the configuration problems.CONFIGS
    gives it (the first it supports), replaced by a golden case's shape when one has every
    property that configuration was chosen for (so the checks run on shapes the goldens
    compile anyway) and adds more of the check's shapes to the golden groups; never one that
    exercises less."""
    old = next((c for c in CONFIGS if _supports(adapter, c)), None)
    if old is None:
        return None, "no supported configuration"
    golden = golden_groups(adapter, suite)
    need = _properties(old)

    def reused(c):
        return sum(group_of(adapter, *config_params(c, T, cu)) in golden
                   for check in KDA_METAMORPHIC for T, cu in metamorphic_runs(check))

    runs = sum(len(metamorphic_runs(check)) for check in KDA_METAMORPHIC)
    best, best_reuse = old, reused(old)
    for c in golden_configs(suite):
        if need <= _properties(c) and _supports(adapter, c):
            r = reused(c)
            if r > best_reuse:
                best, best_reuse = c, r
    if best is old:
        return old, (f"{old['name']} kept ({best_reuse} of its {runs} runs in golden groups): no golden case the "
                     f"kernel takes has its properties ({', '.join(sorted(need)) or 'none'}) and more runs in "
                     f"golden groups")
    return best, (f"{best['name']} ({best_reuse} of {runs} runs in golden groups, {reused(old)} with "
                  f"{old['name']}): the shape of golden {best['golden']}, with {', '.join(sorted(need))} like {old['name']}")


def choose_all(adapters, suite):
    """Sets each KDA adapter's `metamorphic_config` (choose_metamorphic_config) and
    `metamorphic_config_reason`; call before collecting (the tests' case ids name the config)."""
    for a in adapters:
        if getattr(a, "family", None) == "kda" and hasattr(a, "unsupported") and a.kind != "reference":
            c, why = choose_metamorphic_config(a, suite)
            if c is not None:
                a.metamorphic_config = c
            a.metamorphic_config_reason = why


def golden_groups(adapter, suite):
    groups = set()
    for case in suite:
        if case.op in getattr(adapter, "golden_ops", ()) and adapter.case_unsupported(case) is None:
            groups.add(group_of(adapter, case.params, case_shapes(case)))
    return groups


# --------------------------------------------------------------------------- the plan

@dataclass
class Shape:
    adapter: str
    group: tuple
    classes: tuple
    recipe: dict           # how warm-up builds inputs of this shape (warmup_worker.inputs_of)
    tests: list = field(default_factory=list)


@dataclass
class Plan:
    shapes: dict = field(default_factory=dict)    # (adapter, group, classes) -> Shape
    untracked: dict = field(default_factory=dict)  # adapter -> [(test id, check, case path)]: no shape model,
    # one shape per test (warm-up runs the test's check itself)
    compilers: dict = field(default_factory=dict)  # adapter -> compiler_of
    metamorphic: dict = field(default_factory=dict)  # adapter -> why its metamorphic config
    before: int = None                            # distinct shapes with problems.CONFIGS' configs

    def groups(self):
        """{(adapter, group): [Shape, ...]} of the adapters compiled at run time."""
        out = {}
        for s in self.shapes.values():
            out.setdefault((s.adapter, s.group), []).append(s)
        return out

    def distinct(self):
        return len(self.shapes) + sum(len(v) for v in self.untracked.values())

    def summary(self):
        by = {}
        for s in self.shapes.values():
            b = by.setdefault(s.adapter, {"groups": set(), "shapes": 0})
            b["groups"].add(s.group)
            b["shapes"] += 1
        return {
            "distinct_compiled_shapes": self.distinct(),
            "distinct_compiled_shapes_before": self.before,
            "groups": len(self.groups()),
            "by_adapter": {a: {"groups": len(b["groups"]), "shapes": b["shapes"], "compiler": self.compilers.get(a)}
                           for a, b in sorted(by.items())},
            "untracked": {a: len(v) for a, v in sorted(self.untracked.items())},
            "precompiled": sorted(a for a, c in self.compilers.items() if a not in by and a not in self.untracked),
            "metamorphic_configs": dict(self.metamorphic),
            "shapes": [{"adapter": s.adapter, "group": dict(s.group), "classes": dict(s.classes), "tests": len(s.tests)}
                       for s in self.shapes.values()],
        }


def _runs_of(test, config, cases, load_case):
    """[(params, shapes, recipe)] of the kernel runs a KDA test makes. A backward test runs its
    gradient golden forward and backward: its recipe says `backward`, and its group is the
    forward's with ("backward", True) (the backward kernels autotune on the same keys)."""
    if test.check in ("golden", "backward"):
        if test.case_path is None:
            return []
        case = cases.get(test.case_path)
        if case is None:
            if load_case is None:
                raise LookupError(f"shapes.build: test {test.id}: its case {test.case_path} is not in the suite")
            case = cases[test.case_path] = load_case(test.case_path)
        if test.check == "backward":
            shapes = {k: case.params[k] for k in ("B", "T", "H", "HV", "K", "V")}
            return [(case.params, shapes, {"golden": test.case_path, "backward": True})]
        return [(case.params, case_shapes(case), {"golden": test.case_path})]
    if config is None:
        return []
    out = []
    for T, cu in metamorphic_runs(test.check):
        params, shapes = config_params(config, T, cu)
        out.append((params, shapes, {"config": dict(config), "T": T, "cu_seqlens": cu}))
    return out


def _tests_of(tests):
    for t in tests:
        if isinstance(t, MutantTest):
            yield from t.tests
        else:
            yield t


def build(tests, suite=(), load_case=None):
    """The plan of a collection (collection.collect's list, after choose_all); `before`
    counts the shapes the first supported configs of problems.CONFIGS would compile.
    load_case: reads a golden case by path that `suite` lacks (an adapter may check cases of
    its own; k3ref.goldens.load_case), given by the front end that holds the golden reader."""
    plan = Plan()
    adapters = []
    for t in _tests_of(tests):
        if t.adapter not in adapters:
            adapters.append(t.adapter)
    old_configs, new_configs = {}, {}
    cases = {str(c.path): c for c in suite if getattr(c, "path", None)}
    for a in adapters:
        plan.compilers[a.name] = compiler_of(a)
        if getattr(a, "family", None) == "kda" and hasattr(a, "unsupported"):
            old_configs[a.name] = next((c for c in CONFIGS if _supports(a, c)), None)
            if getattr(a, "metamorphic_config_reason", None):
                plan.metamorphic[a.name] = a.metamorphic_config_reason
            new_configs[a.name] = getattr(a, "metamorphic_config", None) or old_configs[a.name]

    def fill(target, configs, record):
        for t in _tests_of(tests):
            a = t.adapter
            if t.skip or not compiles_at_run_time(a):
                continue
            modelled = (getattr(a, "family", None) == "kda" and hasattr(a, "unsupported")
                        and (t.check in ("golden", "backward") or metamorphic_runs(t.check)))
            if not modelled:  # a check the plan has no model of: one shape of its own
                if record is None:
                    target.add((a.name, t.id))
                else:
                    record.untracked.setdefault(a.name, []).append((t.id, t.check, t.case_path))
                continue
            for params, shapes, recipe in _runs_of(t, configs.get(a.name), cases, load_case):
                group = group_of(a, params, shapes) + ((("backward", True),) if recipe.get("backward") else ())
                key = (a.name, group, int_classes(params, shapes))
                if record is None:
                    target.add(key)
                    continue
                s = record.shapes.get(key)
                if s is None:
                    s = record.shapes[key] = Shape(a.name, key[1], key[2], recipe)
                if t.id not in s.tests:
                    s.tests.append(t.id)

    fill(None, new_configs, plan)
    before = set()
    fill(before, old_configs, None)
    plan.before = len(before)
    return plan


def plan_line(summary):
    """One line of a shape plan's summary (ShapePlan.summary), as the run and `warmup` print it."""
    s = summary
    return (f"shape plan: {s['distinct_compiled_shapes']} distinct compiled shapes in {s['groups']} groups "
            f"({s['distinct_compiled_shapes_before']} with the metamorphic configs of problems.CONFIGS)")


def units(plan, adapters):
    """The warm-up's units of shape plan `plan` (warmup.run_units): [(adapter, group, recipes)],
    one per shape group of an adapter declared to be compiled by Triton (compiler_of; an
    adapter of unknown build is planned, counted, but not warmed up: declare
    `compiler = "triton"` on it)."""
    by_name = {a.name: a for a in adapters if compiler_of(a) == "triton"}  # declared only
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


def order(tests, plan):
    """The tests with each adapter's tests of one group next to each other (the adapter order
    and the order inside a group kept): checks of one shape run together."""
    first_group, index = {}, {}
    for s in plan.shapes.values():
        n = index.setdefault((s.adapter, s.group), len(index))
        for tid in s.tests:
            first_group.setdefault(tid, (s.adapter, n))
    position = {}
    for n, t in enumerate(tests):
        name = t.adapter.name
        position.setdefault(name, n)
    def key(item):
        n, t = item
        if isinstance(t, MutantTest):
            return (position[t.adapter.name], 1, n)
        g = first_group.get(t.id)
        return (position[t.adapter.name], 0, g[1] if g else 1 << 30, n)

    return [t for _, t in sorted(enumerate(tests), key=key)]


# --------------------------------------------------------------------------- Triton introspection

def autotuner_info(autotuner):
    """What an autotuned kernel specialises on, read from its decorators: {name,
    autotune_keys, configs, constexprs, specialised_ints (the non-constexpr arguments Triton
    specialises), heuristics}."""
    info = {"name": kernel_name(autotuner), "autotune_keys": list(getattr(autotuner, "keys", None) or []),
            "configs": len(getattr(autotuner, "configs", None) or []), "constexprs": [], "specialised_args": [],
            "heuristics": []}
    for f in _unwrap(autotuner)[1:]:
        values = getattr(f, "values", None)
        if isinstance(values, dict):
            info["heuristics"] += sorted(values)
        params = getattr(f, "params", None)
        if isinstance(params, (list, tuple)) and params and hasattr(params[0], "name"):
            info["constexprs"] = [p.name for p in params if getattr(p, "is_constexpr", False)]
            info["specialised_args"] = [p.name for p in params if not getattr(p, "is_constexpr", False)
                                        and not getattr(p, "do_not_specialize", False)]
    return info


# --------------------------------------------------------------------------- prop buckets

HEAD_SIZES = list(range(1, 9)) + [16, 31, 64, 100, 128]  # prop.case_strategy's head sizes
# The dimensions a bucket pins (the names of prop.case_strategy's choices): those that select
# a kernel, an autotune key or a constexpr. T, the varlen lengths (empty sequences included),
# B, value ranges, lower_bound, scale and the seed stay free inside a bucket.
BUCKET_DIMS = ("H", "group", "K", "V", "varlen", "state_layout", "gate", "beta", "qk_l2norm", "initial_state",
               "A_log", "dt_bias")


def _bucket_supported(adapter, b):
    params = dict(gate=b["gate"], lower_bound=-5.0 if b["gate"] == "lower_bound" else None, beta=b["beta"],
                  qk_l2norm=b["qk_l2norm"], state_layout=b["state_layout"], A_log=b["A_log"], dt_bias=b["dt_bias"],
                  cu_seqlens=[0, 20] if b["varlen"] else None, initial_state=b["initial_state"])
    shapes = dict(B=1, T=20, H=b["H"], HV=b["H"] * b["group"], K=b["K"], V=b["V"])
    return adapter.unsupported(params, shapes) is None


def _bucket_dims(fixed):
    """Each BUCKET_DIMS dimension's values as prop.case_strategy draws them, `fixed` respected."""
    def allowed(name, values):
        if name not in fixed:
            return list(values)
        v = fixed[name]
        return list(v) if isinstance(v, list) else [v]

    return {"H": allowed("H", [1, 2]), "group": allowed("group", [1, 2, 3]), "K": allowed("K", HEAD_SIZES),
            "V": allowed("V", HEAD_SIZES), "varlen": allowed("varlen", [False, True]),
            "state_layout": allowed("state_layout", ["k_first", "v_first"]),
            "gate": allowed("gate", ["log_decay", "lower_bound", "softplus"]),
            "beta": allowed("beta", ["as_given", "sigmoid", "two_sigmoid"]),
            "qk_l2norm": allowed("qk_l2norm", [False, True]), "initial_state": allowed("initial_state", [True, False]),
            "A_log": allowed("A_log", [True, False]), "dt_bias": allowed("dt_bias", [True, False])}


def _bucket_adder(adapter, out):
    def add(b):
        if b["gate"] == "log_decay":
            b["A_log"] = b["dt_bias"] = False  # the strategy draws neither for this gate
        elif b["gate"] == "softplus":
            b["A_log"] = True  # k3ref's softplus gate needs A_log (the strategy sets it)
        if b not in out and _bucket_supported(adapter, b):
            out.append(b)
    return add


def prop_buckets(adapter, fixed, suite=()):
    """A bounded set of shape buckets for `prop` (dicts over BUCKET_DIMS): the golden groups
    the kernel takes, then buckets that put every value prop draws of each dimension into at
    least one bucket (13 head sizes for K and for V, GVA groups 1-3, both layouts, varlen or
    not, the three gates, the three beta modes, norm, initial state, A_log and dt_bias).
    Values `fixed` pins (prop.FIXED) are respected; buckets the kernel does not support are
    left out."""
    dims = _bucket_dims(fixed)
    out = []
    add = _bucket_adder(adapter, out)

    for case in suite:
        if case.op == "kda.recurrent" and adapter.case_unsupported(case) is None:
            s, p = case_shapes(case), case.params
            b = dict(H=s["H"], group=s["HV"] // s["H"], K=s["K"], V=s["V"], varlen=bool(p.get("cu_seqlens")),
                     state_layout=p.get("state_layout", "k_first"), gate=p.get("gate", "log_decay"),
                     beta=p.get("beta", "as_given"), qk_l2norm=bool(p.get("qk_l2norm")),
                     initial_state=bool(p.get("initial_state", True)), A_log=bool(p.get("A_log")),
                     dt_bias=bool(p.get("dt_bias")))
            if s["HV"] % s["H"] == 0 and all(b[k] in dims[k] for k in BUCKET_DIMS):
                add(b)
    n = max(len(v) for v in dims.values())
    for i in range(n):
        # Dimension d takes its values cyclically with a stride of its own (V backwards), so
        # that the buckets pair the values of different dimensions differently.
        b = {}
        for j, (name, values) in enumerate(dims.items()):
            k = (len(values) - 1 - i) if name == "V" else (i + j * (i // len(values)))
            b[name] = values[k % len(values)]
        add(b)
    return out


def seeded_buckets(adapter, fixed, buckets, n, seed):
    """n more buckets for prop beside the coverage `buckets`: each dimension drawn uniformly
    from the values prop draws (random.Random(seed): the run's seed gives the same ones
    again), unsupported and repeated ones drawn again (at most 50 n tries). The warm-up
    compiles them with the others: shapes no bucket had, at no compilation while drawing."""
    import random

    rng = random.Random(f"k3ref prop seeded shapes {seed}")
    dims = _bucket_dims(fixed)
    out = list(buckets)
    add = _bucket_adder(adapter, out)
    for _ in range(50 * n):
        if len(out) - len(buckets) >= n:
            break
        add({name: rng.choice(values) for name, values in dims.items()})
    return out[len(buckets):]


def bucket_cases(b, max_T, fixed=None):
    """prop cases (drawn_case.make_inputs's dicts) of one bucket that reach the integer classes its
    draws reach: T = 1, 16 and an odd T; B = 1 and 2; varlen with one sequence, with an empty
    sequence among three. For the warm-up."""
    fixed = fixed or {}
    T_odd = max(2, min(max_T, 37) | 1)
    base = dict(H=b["H"], HV=b["H"] * b["group"], K=b["K"], V=b["V"], gate=b["gate"], gate_base="e",
                g_range=(-1.0, 0.0) if b["gate"] == "log_decay" else (-4.0, 4.0),
                lower_bound=(fixed.get("lower_bound", [-5.0]) if isinstance(fixed.get("lower_bound"), list)
                             else [fixed.get("lower_bound", -5.0)])[0] if b["gate"] == "lower_bound" else None,
                A_log=b["A_log"], dt_bias=b["dt_bias"], beta=b["beta"],
                beta_range=(0.0, 1.0) if b["beta"] == "as_given" else (-4.0, 4.0), qk_l2norm=b["qk_l2norm"],
                scale=None, state_layout=b["state_layout"], initial_state=b["initial_state"], all_states=False, seed=0)
    if b["varlen"]:
        cus = [[0, 1], [0, 16], [0, 5, 5, T_odd]]
        return [dict(base, B=1, T=cu[-1], cu_seqlens=cu) for cu in cus]
    sizes = [(1, 1), (1, 16), (1, T_odd), (2, T_odd)]
    return [dict(base, B=B, T=T, cu_seqlens=None) for B, T in sizes if T <= max(max_T, 1) or T == 1]


def bucketed_strategy(st, case_strategy, fixed, max_T, buckets, outside_share):
    """prop's case strategy drawing from the buckets: a draw falls outside them (the full
    strategy, as without buckets) with probability `outside_share`, else its BUCKET_DIMS come
    from one bucket and everything else (T, B, the varlen lengths and empty sequences, value
    ranges, lower_bound, scale, seed) is drawn as usual. Shrinking moves toward drawing inside
    and toward the first bucket (the goldens' shapes)."""
    if not buckets:
        return case_strategy(st, fixed, max_T)
    cut = round(outside_share * 1000)

    @st.composite
    def case(draw):
        # Hypothesis shrinks toward 0, which is inside: draws at or above 1000 - cut fall outside.
        # It also favours the ends of a range (measured on an H200: 4.4 % of draws outside from
        # integers(0, 999) at a share of 0.02), so the permille is the remainder of a 32-bit draw,
        # whose favoured ends (0, 1, ..., 2^32 - 1 = 295 mod 1000) lie inside.
        if draw(st.integers(0, 2**32 - 1)) % 1000 >= 1000 - cut:
            c = draw(case_strategy(st, fixed, max_T))
            c["bucket"] = None
            return c
        i = draw(st.integers(0, len(buckets) - 1))
        pinned = dict(fixed)
        pinned.update({k: buckets[i][k] for k in BUCKET_DIMS})
        c = draw(case_strategy(st, pinned, max_T))
        c["bucket"] = i
        return c

    return case()
