"""The CI command: python3 -m k3ref.gpu_check run [--adapter MOD:NAME ...] --out report/

Collects every adapter (built-in, entry points, --adapter) x golden case x check (the same
collection as the pytest plugin, collection.py), runs each adapter's checks in its own child
process (isolation.py), runs the mutant zoo (each mutant must be caught by a check), writes
report.html (verdict first), report.json, report.xml (JUnit) and plots, prints the kernels x
checks table, and exits 1 when it cannot vouch for the kernels: a failed check, a known
limitation that now passes, a mutant not caught or not run, a kernel asked for that is not
available, or no check executed at all. Usage errors (an unknown name in any selector, an
adapter spec that does not load) exit 2 with one line.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from . import collection, report
from .registry import AdapterSpecError
from .selection import UsageError, csv_list, default_goldens, load_suite, select

PATH_OPTIONS = (("fla_path", "K3REF_FLA_PATH", "directory holding the fla package"),
                ("flashkda_path", "K3REF_FLASHKDA_PATH", "directory holding the flash_kda package and its extension"),
                ("liger_path", "K3REF_LIGER_PATH", "Liger-Kernel checkout (holding src/liger_kernel) for its AttnRes kernel"),
                ("torchtitan_path", "K3REF_TORCHTITAN_PATH", "torchtitan checkout (holding torchtitan/) for its Quantile Balancing"))


def _kernel_options(p):
    p.add_argument("--lib", help="path of libk3gc.so (default: $K3GC_LIB or build*/gpu_check/)")
    for dest, env, text in PATH_OPTIONS:
        p.add_argument("--" + dest.replace("_", "-"), dest=dest, help=f"{text} (sets ${env})")
    p.add_argument("--cache-dir", metavar="DIR",
                   help="cache directory (default: $K3REF_CACHE_DIR, else ~/.cache/k3ref): Triton's compiled kernels "
                        "and autotune results in DIR/triton ($TRITON_CACHE_DIR for every child); save and restore DIR "
                        "between CI runs")
    p.add_argument("--adapter", action="append", default=[], metavar="MODULE:NAME",
                   help="an adapter of your own (a class, instance, or function returning adapters; repeatable); "
                        "MODULE may be a file.py")


def parser():
    ap = argparse.ArgumentParser(prog="python3 -m k3ref.gpu_check", description="Real kernels against the k3ref references.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the checks and write the reports")
    r.add_argument("--goldens", help="golden directory (default: $K3REF_GOLDENS, else the checkout's goldens/)")
    r.add_argument("--out", default="gpu_check_report")
    r.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    _kernel_options(r)
    from . import warmup  # the shape plan, the warm-up and the deep mode (warmup.py)

    warmup.add_run_options(r)
    r.add_argument("--no-builtin", action="store_true", help="leave out the built-in adapters and installed entry points")
    r.add_argument("--only", help="comma-separated adapter names to run (each must exist; each counts as asked for)")
    r.add_argument("--no-mutants", action="store_true", help="leave out mutants not named in --only or --adapter")
    r.add_argument("--checks", help="comma-separated check names (golden, causality, suffix, varlen, split, "
                   "determinism, poisoned_memory, inputs_unchanged, ...; default all)")
    r.add_argument("--cases", help="comma-separated golden case names (default all; checks that build their own "
                   "inputs are not filtered)")
    r.add_argument("--known-limitations", help="known-limitations file (default: the package's known_limitations.json)")
    r.add_argument("--budget", type=float, default=0, help="seconds per kernel; later checks are skipped (0: none)")
    r.add_argument("--check-timeout", type=float, default=900.0,
                   help="seconds one check may take before its child is killed (default 900)")
    r.add_argument("--load-timeout", type=float, default=900.0,
                   help="seconds starting a child and loading its kernel may take (default 900)")
    r.add_argument("--no-isolation", action="store_true", help="run every check in this process (a crash ends the run)")
    r.add_argument("--list", action="store_true", help="print the collected test ids and exit")
    p = sub.add_parser("prop", help="property-based testing of one KDA kernel against the reference (Hypothesis)")
    p.add_argument("--kernel", required=True, help="adapter name, e.g. fla.chunk_kda, flashkda.fwd, k3gc.fp32")
    p.add_argument("--examples", type=int, default=100)
    p.add_argument("--seed", type=int, help="Hypothesis seed (printed; the same seed replays the whole run)")
    p.add_argument("--max-T", dest="max_T", type=int, default=48, help="longest sequence drawn")
    p.add_argument("--out", default="prop_failures", help="directory for the shrunk failing case")
    p.add_argument("--replay", help="run the kernel on one golden file (a written failure) and judge it")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    _kernel_options(p)
    warmup.add_prop_options(p)
    warmup.add_subparser(sub, _kernel_options)
    return ap


def apply_kernel_options(args):
    """--lib and the checkout paths, as environment variables the adapters (and children) read."""
    if getattr(args, "lib", None):
        os.environ["K3GC_LIB"] = str(Path(args.lib).resolve())
    for dest, env, _ in PATH_OPTIONS:
        value = getattr(args, dest, None)
        if value:
            os.environ[env] = str(Path(value).resolve())
    from . import warmup

    warmup.configure_cache(getattr(args, "cache_dir", None))  # before any kernel is imported


def execute(tests, runner, requested):
    """Runs the tests; returns (rows, results): rows are (test, verdict, reason, results)."""
    rows, results = [], []
    for t in tests:
        if isinstance(t, collection.MutantTest):
            rs = [runner.run(x) for x in t.tests]
            verdict, reason = collection.mutant_outcome(t, rs, requested)
            results += rs
        else:
            rs = [runner.run(t)]
            verdict, reason = collection.outcome(t, rs[0], requested)
            results += rs
        for r in rs:
            r.extra["test_id"] = t.id
        rows.append((t, verdict, reason, rs))
    return rows, results


def verdict_of(rows, results):
    """(passed, failure lines) of a whole run."""
    failures = [f"FAIL {t.id}: {reason}" for t, v, reason, _ in rows if v == "fail"]
    executed = sum(r.status != "skip" for r in results)
    if executed == 0:
        failures.append("FAIL: no check was executed (every test was skipped or nothing was collected)")
    return not failures, failures


def run_command(args):
    apply_kernel_options(args)
    adapters, requested = select(args)
    suite = load_suite(args.goldens or default_goldens(), adapters)
    checks, cases = csv_list(args.checks), csv_list(args.cases)
    collection.validate(adapters, suite, checks=checks, cases=cases)
    try:
        limitations = collection.load_limitations(args.known_limitations)
    except ValueError as e:
        raise UsageError(str(e)) from e
    from . import shapes

    shapes.choose_all(adapters, suite)  # metamorphic configs on shapes the goldens compile (shapes.py)
    try:
        tests = collection.collect(adapters, suite, checks=checks, cases=cases, limitations=limitations)
    except ValueError as e:  # a known-limitation entry that would waive a whole check
        raise UsageError(str(e)) from e
    if args.list:
        for t in tests:
            print(t.id)
        return 0
    from .isolation import Runner
    from . import warmup

    t0 = time.time()
    side_by_side = args.check_jobs > 1 and not args.no_isolation
    # Side by side, the warm-up runs beside the checks: an adapter's checks start once its own
    # units are compiled (at once for kernels built ahead of time).
    tests, speed, background = warmup.prepare(args, tests, suite, adapters, background=side_by_side)

    def make_runner():
        return Runner(args.device, check_timeout=args.check_timeout, load_timeout=args.load_timeout,
                      isolate=not args.no_isolation, budget_s=args.budget,
                      progress=lambda line: print(line, flush=True))

    if side_by_side:  # isolation groups side by side (parallel.py)
        from . import parallel

        try:
            rows, results, runner = parallel.execute(tests, make_runner, requested, args.check_jobs, execute,
                                                     ready=background)
        finally:
            if background is not None:
                warmup.finish_warmup(speed, background.finish())
    else:
        with make_runner() as runner:
            rows, results = execute(tests, runner, requested)
    passed, failures = verdict_of(rows, results)
    summary = report.summary(rows, results, runner, adapters, requested, args.device, time.time() - t0, passed,
                             failures, len(suite), golden_dir=args.goldens or default_goldens())
    summary.update(speed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report.write_all(out, rows, results, summary)
    print(report.markdown_table(results))
    for t, v, reason, _ in rows:
        if isinstance(t, collection.MutantTest):
            print(f"{t.adapter.name}: {v}: {reason}")
    for name, k in summary["kernels"].items():
        t = k.get("timing")
        if t and t["checks_run"]:
            print(f"time {name}: {t['children_started']} child(ren), start-up+import {t['startup_and_import_s']:.1f} s, "
                  f"Triton compile {t['compile_s']:.1f} s ({t['compiles']}), autotune {t['autotune_s']:.1f} s "
                  f"({t['configs_benchmarked']} configs), checks {t['check_s']:.1f} s, wall {t['wall_s']:.1f} s")
    for line in failures:
        print(line)
    print(json.dumps({k: summary[k] for k in ("verdict", "tests", "executed", "passed", "failed", "skipped", "xfailed",
                                              "seconds")}))
    print(f"reports: {out / 'report.html'}, {out / 'report.json'}, {out / 'report.xml'}")
    return 0 if passed else 1


def main(argv=None):
    ap = parser()
    args = ap.parse_args(argv)
    try:
        if args.cmd == "warmup":
            from . import warmup

            apply_kernel_options(args)
            return warmup.command(args)
        if args.cmd == "prop":
            from . import prop

            apply_kernel_options(args)
            return prop.main(args)
        return run_command(args)
    except (UsageError, collection.SelectorError, AdapterSpecError) as e:
        print(f"{ap.prog} {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
