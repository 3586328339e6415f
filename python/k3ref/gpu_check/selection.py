"""What a harness run selects, for every front end (the `run` and `prop` commands, the warm-up,
the pytest plugin): the adapters after --only / --no-mutants / --no-builtin, the golden
directory and suite, and the usage error that names a bad selection in one line."""
from pathlib import Path

from . import collection
from .protocol import UsageError
from .registry import AdapterSpecError, discover


def default_goldens(option="--goldens"):
    """The golden directory when none is given: $K3REF_GOLDENS, else the checkout's goldens/,
    else the suite installed with the package (k3ref.goldens.directory). `option`: how the
    front end in use spells the option that names one (pytest: --k3ref-goldens)."""
    from .. import goldens

    try:
        return str(goldens.directory())
    except FileNotFoundError as e:
        raise UsageError(f"{e} (or pass {option} DIR)") from None


def csv_list(text):
    return [s for s in text.split(",") if s] if text else None


def load_suite(directory, ops):
    """The golden cases of `directory` whose operator is in `ops`, read by k3ref.goldens: the
    cases its MANIFEST.json lists, or every *.safetensors file of a directory without one."""
    from .. import goldens

    directory = Path(directory)
    if (directory / "MANIFEST.json").is_file():
        return goldens.load_suite(directory, ops=tuple(ops))
    cases = [goldens.load_case(p) for p in sorted(directory.glob("*.safetensors"))]
    return [c for c in cases if c.op in ops]


def suite_of(goldens, adapters):
    """The cases of directory `goldens` that the adapters' checks read."""
    ops = sorted({op for a in adapters for op in a.suite_ops()})
    if not Path(goldens).is_dir():
        raise UsageError(f"--goldens {goldens}: not a directory")
    return load_suite(goldens, ops) if ops else []


def device_of(opts):
    if opts.device:
        return opts.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def select_adapters(opts, conftest_objects=(), goldens_option="--k3ref-goldens"):
    """(adapters, requested names, golden suite) of a run; raises UsageError (one
    line) for a selector that names nothing or an adapter spec that does not load. The
    metamorphic configurations are chosen on the suite's shapes (shapes.choose_all), the
    same in every process that calls this."""
    from . import shapes

    try:
        adapters, requested = discover(specs=opts.adapters, conftest_specs=conftest_objects,
                                       entry_points=opts.builtin)
    except AdapterSpecError as e:
        raise UsageError(str(e)) from e
    try:
        if opts.only:
            collection.validate(adapters, [], only=opts.only)
            adapters = [a for a in adapters if a.name in opts.only]
            requested |= set(opts.only)
        if opts.no_mutants:
            adapters = [a for a in adapters if a.kind != "mutant" or a.name in requested]
        suite = suite_of(opts.goldens or default_goldens(goldens_option), adapters)
        collection.validate(adapters, suite, checks=opts.checks, cases=opts.cases)
    except collection.SelectorError as e:
        raise UsageError(str(e)) from e
    if opts.policy:  # --policy: the user's choice of bound for every KDA kernel, validated below
        for a in adapters:
            if a.family == "kda":
                a.policy, a.policy_reason = opts.policy, "given on the command line (--policy / --k3ref-policy)"
        try:
            collection.validate(adapters, suite)
        except collection.SelectorError as e:
            raise UsageError(str(e)) from e
    shapes.choose_all(adapters, suite)
    return adapters, requested, suite
