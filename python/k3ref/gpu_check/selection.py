"""What a harness run selects, for every front end (the `run` and `prop` commands, the warm-up,
the pytest plugin): the adapters after --only / --no-mutants / --no-builtin, the golden
directory and suite, and the usage error that names a bad selection in one line."""
from pathlib import Path

from . import collection
from .registry import AdapterSpecError, discover


class UsageError(Exception):
    pass


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


def select(args):
    """(adapters, requested names) after --only / --no-mutants / --no-builtin; raises UsageError."""
    try:
        adapters, requested = discover(specs=args.adapter, entry_points=not args.no_builtin)
    except AdapterSpecError as e:
        raise UsageError(str(e)) from e
    only = csv_list(args.only)
    if only:
        collection.validate(adapters, [], only=only)
        adapters = [a for a in adapters if a.name in only]
        requested |= set(only)
    if args.no_mutants:
        adapters = [a for a in adapters if a.kind != "mutant" or a.name in requested]
    return adapters, requested


def load_suite(goldens, adapters):
    ops = sorted({op for a in adapters for op in a.golden_ops})
    if not Path(goldens).is_dir():
        raise UsageError(f"--goldens {goldens}: not a directory")
    return collection.load_suite(goldens, ops) if ops else []
