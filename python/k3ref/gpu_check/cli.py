"""The command line: python3 -m k3ref.gpu_check run [--adapter MOD:NAME ...] --out report/

`run` is a front end of the pytest plugin (k3ref.pytest_plugin), the harness's only runner: it
calls pytest with the plugin and its options spelled `--k3ref-*`, `-n` for --check-jobs and
`--junitxml OUT/report.xml`, so the collection, isolation (pytest-xdist workers,
pytest-timeout), reports and verdict are the plugin's. It exits 0 when the kernels are
vouched for, 1 when not (a failed check, a known limitation that now passes, a mutant not
caught or not run, a kernel asked for that is not available, no check executed, a test
without a result, a report that could not be written), 2 on a usage error (one line).
`run --tier scale` is the same front end with `--k3ref-tier scale` (its record: OUT/scale.json).
`prop` and `warmup` are commands of their own; each runs in a child process (in_child), since
each runs adapter code.
"""
import argparse
import os
import sys
from pathlib import Path

from . import warmup
from .protocol import KERNEL_PATHS, UsageError
from .registry import AdapterSpecError

def kernel_path_options(p):
    """--fla-path ... --lib: each kernel's checkout (protocol.KERNEL_PATHS), for kernel_paths_of."""
    for dest, env, text in KERNEL_PATHS:
        p.add_argument("--" + dest.replace("_", "-"), dest=dest, help=f"{text} (default: ${env})")


def _kernel_options(p):
    kernel_path_options(p)
    p.add_argument("--cache-dir", metavar="DIR",
                   help="cache directory (default: $K3REF_CACHE_DIR, else ~/.cache/k3ref): Triton's compiled kernels "
                        "and autotune results in DIR/triton ($TRITON_CACHE_DIR for every child); save and restore DIR "
                        "between CI runs")
    p.add_argument("--adapter", action="append", default=[], metavar="MODULE:NAME",
                   help="an adapter of your own (a class, instance, or function returning adapters; repeatable); "
                        "MODULE may be a file.py")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="a setting of an adapter factory that takes `run_options` (the plugin's --k3ref-set); repeatable")


def parser():
    ap = argparse.ArgumentParser(prog="python3 -m k3ref.gpu_check", description="Real kernels against the k3ref references.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the checks and write the reports")
    r.add_argument("--goldens", help="golden directory (default: $K3REF_GOLDENS, else the checkout's goldens/)")
    r.add_argument("--out", default="gpu_check_report")
    # (the front end imports no torch: the run's processes pick the device, cuda when there is one)
    r.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    _kernel_options(r)
    run_options(r)
    r.add_argument("--no-builtin", action="store_true", help="leave out the built-in adapters and installed entry points")
    r.add_argument("--only", help="comma-separated adapter names to run (each must exist; each counts as asked for)")
    r.add_argument("--no-mutants", action="store_true", help="leave out mutants not named in --only or --adapter")
    r.add_argument("--checks", help="comma-separated check names (golden, causality, suffix, varlen, split, "
                   "determinism, poisoned_memory, inputs_unchanged, ...; default all)")
    r.add_argument("--cases", help="comma-separated golden case names (default all; checks that build their own "
                   "inputs are not filtered)")
    r.add_argument("--known-limitations", help="known-limitations file (default: the package's known_limitations.json)")
    r.add_argument("--policy", help="judge every KDA kernel under this policy instead of its adapter's (a policy of the "
                                    "table, floor:<m>, rel-rms:<r>)")
    r.add_argument("--budget", type=float, default=0, help="seconds per kernel; later checks are skipped (0: none)")
    r.add_argument("--check-timeout", type=float, default=900.0,
                   help="seconds one check may take before its child is killed (default 900)")
    r.add_argument("--load-timeout", type=float, default=900.0,
                   help="seconds starting a child and loading its kernel may take (default 900)")
    r.add_argument("--no-isolation", action="store_true", help="run every check in this process (a crash ends the run)")
    r.add_argument("--list", action="store_true", help="print the collected test node ids and exit")
    r.add_argument("--tier", choices=("default", "scale"), default="default",
                   help="scale: the built-in KDA kernels, the scale mutants and the KDA adapters given (--adapter) at "
                        "K3's production shapes and index limits, one pytest test per kernel x scale case (the "
                        "plugin's --k3ref-tier scale; --cases names scale cases; OUT/scale.json); default: the golden "
                        "and metamorphic checks")
    r.add_argument("--scale-limits", metavar="NAME=VALUE,...",
                   help="the scale tier at smaller limits (the plugin's --k3ref-scale-limits; default: "
                        "$K3REF_SCALE_LIMITS, else K3's full sizes)")
    r.add_argument("--backward", choices=("default", "all"), default="default",
                   help="the gradient goldens of the backward check: default, four that share two backward autotune "
                        "keys; all, every gradient golden (the plugin's --k3ref-backward)")
    r.add_argument("pytest_args", nargs="*", metavar="-- PYTEST_ARG",
                   help="after --: arguments passed to pytest as they are (-k EXPR, -x, -v, ...)")
    p = sub.add_parser("prop", help="property-based testing of one KDA kernel against the reference (Hypothesis)")
    p.add_argument("--kernel", required=True, help="adapter name, e.g. fla.chunk_kda, flashkda.fwd, k3gc.fp32")
    p.add_argument("--examples", type=int, default=100)
    p.add_argument("--seed", type=int, help="Hypothesis seed (printed; the same seed replays the whole run)")
    p.add_argument("--max-T", dest="max_T", type=int, default=48, help="longest sequence drawn")
    p.add_argument("--out", default="prop_failures", help="directory for the shrunk failing case")
    p.add_argument("--replay", help="run the kernel on one golden file (a written failure) and judge it")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    _kernel_options(p)
    prop_options(p)
    warmup_parser(sub, _kernel_options)
    return ap


def run_options(p):
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up before the checks")
    p.add_argument("--jobs", type=int, default=None,
                   help="warm-up worker processes at a time (default: the CPU count)")
    p.add_argument("--warmup-timeout", type=float, default=1800.0, help="seconds one warm-up worker may take")
    p.add_argument("--warmup-shards", type=int, default=None, help=warmup.SHARDS_HELP)
    p.add_argument("--check-jobs", type=int, default=1,
                   help="isolation groups (adapters) whose checks run at the same time, each in its own child "
                        "(default 1: one after the other)")
    p.add_argument("--autotune-configs", choices=("winner", "all"), default="winner",
                   help="all: run every golden check once per autotune configuration of each autotuned kernel "
                        "(deep mode, slow); winner: only the configuration the autotuner picks (default)")


def warmup_parser(sub, kernel_options):
    w = sub.add_parser("warmup", help="compile the planned shapes into the cache directory, in parallel")
    w.add_argument("--goldens", help="golden directory (default: $K3REF_GOLDENS, else the checkout's goldens/)")
    w.add_argument("--device", default=None)
    kernel_options(w)
    w.add_argument("--no-builtin", action="store_true")
    w.add_argument("--only", help="comma-separated adapter names")
    w.add_argument("--no-mutants", action="store_true")
    w.add_argument("--checks", help="comma-separated check names")
    w.add_argument("--cases", help="comma-separated golden case names")
    w.add_argument("--backward", choices=("default", "all"), default="default",
                   help="the backward check's gradient goldens, as run --backward")
    w.add_argument("--jobs", type=int, default=None, help="worker processes at a time (default: the CPU count)")
    w.add_argument("--warmup-timeout", type=float, default=1800.0)
    w.add_argument("--warmup-shards", type=int, default=None, help=warmup.SHARDS_HELP)
    w.add_argument("--plan", action="store_true", help="print the shape plan and exit without compiling")
    return w


def prop_options(p):
    p.add_argument("--outside-share", type=float, default=0.0,
                   help="share of draws in any shape, outside the compiled buckets: each new shape compiles as it "
                        "comes, 3-7 s for FLA on an H200 (default 0; 1: no buckets; kernels built ahead of time draw "
                        "without buckets)")
    p.add_argument("--seeded-shapes", type=int, default=12,
                   help="buckets drawn from every shape prop draws with the run's seed, compiled by the warm-up beside "
                        "the coverage buckets (default 12: with FLA chunk_kda's 20 coverage buckets, two rounds of 16 warm-up "
                        "workers)")
    p.add_argument("--no-warmup", action="store_true", help="do not compile the buckets before drawing")
    p.add_argument("--progress", action="store_true", help="one line per example (a run cut off by a time limit "
                                                           "still tells its rate)")
    p.add_argument("--jobs", type=int, default=None, help="warm-up worker processes at a time (default: CPU count)")
    p.add_argument("--warmup-timeout", type=float, default=1800.0)


def command_options(args):
    """The RunOptions of a `prop` or `warmup` command (its adapters, device, kernel paths, else
    their environment variables, and cache directory), with Triton pointed at the cache before
    any kernel is imported."""
    from .protocol import RunOptions, kernel_paths_of, settings_of

    opts = RunOptions(adapters=tuple(args.adapter), device=args.device, cache_dir=str(warmup.cache_dir(args.cache_dir)),
                      kernel_paths=kernel_paths_of(vars(args)), settings=settings_of(args.set))
    warmup.configure_cache(opts.cache_dir)
    return opts


def pytest_args(args):
    """The pytest command line of a `run`: the plugin, its options, the workers, the JUnit file."""
    out = Path(args.out)
    # Hypothesis's pytest plugin serves no test of a run and its end-of-run summary cost 1.6 s.
    a = ["-p", "k3ref.pytest_plugin", "-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-o", "addopts=", "-q",
         "--rootdir", os.getcwd(), str(Path(__file__).resolve().parent)]
    for spec in args.adapter:
        a += ["--k3ref-adapter", spec]
    if not args.no_builtin:
        a.append("--k3ref-builtin")
    flags = {"no_mutants": "--k3ref-no-mutants", "no_isolation": "--k3ref-no-isolation", "no_warmup": "--k3ref-no-warmup"}
    a += [flag for dest, flag in flags.items() if getattr(args, dest)]
    if args.tier != "default":
        a += ["--k3ref-tier", args.tier]
    if args.backward != "default":
        a += ["--k3ref-backward", args.backward]
    values = {"only": "--k3ref-only", "checks": "--k3ref-checks", "cases": "--k3ref-cases", "goldens": "--k3ref-goldens",
              "device": "--k3ref-device", "known_limitations": "--k3ref-known-limitations", "policy": "--k3ref-policy",
              "check_timeout": "--k3ref-check-timeout", "load_timeout": "--k3ref-load-timeout", "budget": "--k3ref-budget",
              "jobs": "--k3ref-warmup-jobs", "warmup_timeout": "--k3ref-warmup-timeout",
              "warmup_shards": "--k3ref-warmup-shards",
              "autotune_configs": "--k3ref-autotune-configs", "cache_dir": "--k3ref-cache-dir",
              "scale_limits": "--k3ref-scale-limits",
              **{dest: "--k3ref-" + dest.replace("_", "-") for dest, _, _ in KERNEL_PATHS}}
    for dest, flag in values.items():
        value = getattr(args, dest, None)
        if value is not None:
            a += [flag, str(value)]
    for item in args.set:
        a += ["--k3ref-set", item]
    if args.list:
        return a + ["--collect-only"] + list(args.pytest_args)
    if not args.no_isolation:
        a += ["-n", str(max(1, args.check_jobs))]
    return a + ["--k3ref-report", str(out), "--junitxml", str(out / "report.xml")] + list(args.pytest_args)


# pytest's exit codes -> run's: 0 vouched for, 1 not, 2 usage error
EXIT_CODES = {0: 0, 1: 1, 2: 1, 3: 1, 4: 2, 5: 1}


def run_command(args):
    import pytest

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a directory")
    if not args.no_isolation or args.list:
        return EXIT_CODES.get(int(pytest.main(pytest_args(args))), 1)
    # --no-isolation: the adapters run in the pytest process, where an exit of theirs would end
    # this one too. That process is a child here, and its verdict stands only with the report
    # it wrote: an exit 0 without one (os._exit in adapter code) is a failure.
    import subprocess
    import time

    started = time.time()
    rc = subprocess.run([sys.executable, "-m", "pytest", *pytest_args(args)]).returncode
    report = out / ("scale.json" if args.tier == "scale" else "report.json")
    if rc == 0 and not (report.is_file() and report.stat().st_mtime >= started):
        print(f"{sys.argv[0]} run: FAIL: the run ended with exit 0 but wrote no report {report} (adapter code ended "
              f"the process?): nothing is vouched for", file=sys.stderr)
        return 1
    return EXIT_CODES.get(rc, 1)


# The commands that run adapter code (`prop`: the kernel; `warmup`: the adapters' modules, loaded
# to plan the warm-up) run it in a child, python3 -m MODULE: the module's main(args), through
# command_child.
CHILDREN = {"prop": "k3ref.gpu_check.prop", "warmup": "k3ref.gpu_check.warmup_command"}
VERDICT_VARIABLE = "K3REF_COMMAND_VERDICT"


def in_child(cmd, argv):
    """Runs command `cmd` (argv: its whole command line) in its child (CHILDREN): its output is
    passed through line by line and its exit code is returned as it is, but it stands only with
    the verdict the child writes as the command returns (command_child). A child that ends
    without one (adapter code that calls os._exit, a crash) fails the command with one line:
    an exit 0 of adapter code is no pass."""
    import signal
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix=f"k3ref_{cmd}_") as d:
        verdict = Path(d) / "verdict"
        env = dict(os.environ, **{VERDICT_VARIABLE: str(verdict)})
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([package_root] + [p for p in sys.path if p and os.path.isdir(p)]))
        proc = subprocess.Popen([sys.executable, "-m", CHILDREN[cmd], *argv], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, errors="replace")
        def drain():
            for line in proc.stderr:
                sys.stderr.write(line)

        import threading

        t = threading.Thread(target=drain, daemon=True)
        t.start()

        def copy_out():
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()

        try:
            copy_out()
        except KeyboardInterrupt:
            # Ctrl-C reaches the child as well (one process group) and it prints where it stopped:
            # its last lines are kept. A child that was not sent the signal is sent it after 10 s.
            nudge = threading.Timer(10, lambda: proc.poll() is None and proc.send_signal(signal.SIGINT))
            nudge.start()
            copy_out()
            nudge.cancel()
        proc.wait()
        t.join()
        written = verdict.read_text().strip() if verdict.is_file() else None
    rc = proc.returncode
    if rc == 0 and written != "0":
        print(f"python3 -m k3ref.gpu_check {cmd}: FAIL: the run ended with exit 0 but recorded no verdict (adapter code "
              f"ended the process?): nothing is vouched for", file=sys.stderr)
        return 1
    if written is None:
        how = f"exit {rc}" if rc > 0 else f"signal {signal.Signals(-rc).name}"
        print(f"python3 -m k3ref.gpu_check {cmd}: FAIL: the run ended with {how} and recorded no verdict (a crash?)",
              file=sys.stderr)
        return rc if rc > 0 else 1
    return rc


def main(argv=None):
    ap = parser()
    args = ap.parse_args(argv)
    try:
        if args.cmd in CHILDREN:
            return in_child(args.cmd, argv if argv is not None else sys.argv[1:])
        return run_command(args)
    except (UsageError, AdapterSpecError) as e:
        print(f"{ap.prog} {args.cmd}: error: {e}", file=sys.stderr)
        return 2


def command_child(run, argv=None):
    """The child that `prop` or `warmup` starts (`python3 -m MODULE CMD ...`, in_child): `run`
    (MODULE's main) on the arguments parsed here and their RunOptions, its exit code written where the parent reads
    the verdict."""
    ap = parser()
    args = ap.parse_args(argv)
    try:
        rc = run(args, command_options(args))
    except (UsageError, AdapterSpecError) as e:
        print(f"{ap.prog} {args.cmd}: error: {e}", file=sys.stderr)
        rc = 2
    except KeyboardInterrupt:
        print(f"{ap.prog} {args.cmd}: interrupted", file=sys.stderr)
        rc = 130
    Path(os.environ[VERDICT_VARIABLE]).write_text(str(rc))  # reached only by returning
    return rc


if __name__ == "__main__":
    sys.exit(main())
