"""The `warmup` command: plan the shapes of a run's selection and compile them into the cache
directory, in parallel, as `run` warms up before its checks.

    python3 -m k3ref.gpu_check warmup [--cache-dir DIR] [--jobs N] [--plan] [the selection options of run]

The command runs here, in a child of `python3 -m k3ref.gpu_check` (cli.in_child), since
selecting the adapters imports their modules: adapter code. The child's output and exit code
are the command's; a child that ends without recording its exit code (adapter code that
calls os._exit, a crash) fails the command.
"""
import json
import sys


def main(args, opts):
    """`warmup`: exit 0 when every group warmed up (or was skipped: kernel not here), 1 when
    a worker erred (the cache may be incomplete; the run would report the checks' errors).
    `opts`: the command's RunOptions (cli.command_options), the selection added here."""
    from dataclasses import replace

    from .. import goldens
    from . import collection, shapes, warmup
    from .protocol import UsageError
    from .run import csv_list as csv, device_of, select_adapters

    for flag, value in (("--warmup-shards", args.warmup_shards), ("--jobs", args.jobs)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} {value}: must be at least 1")
    args.device = device_of(args.device)
    opts = replace(opts, builtin=not args.no_builtin, only=csv(args.only), no_mutants=args.no_mutants,
                   checks=csv(args.checks), cases=csv(args.cases), goldens=args.goldens, device=args.device)
    adapters, _, suite = select_adapters(opts, goldens_option="--goldens")  # as the run selects them
    tests = collection.collect(adapters, suite, checks=opts.checks, cases=opts.cases, backward=args.backward)
    plan = shapes.build(tests, suite, goldens.load_case)
    s = plan.summary()
    print(f"{shapes.plan_line(s)}; cache {opts.cache_dir}", flush=True)
    for a, b in s["by_adapter"].items():
        print(f"  {a}: {b['groups']} groups, {b['shapes']} shapes; metamorphic: {s['metamorphic_configs'].get(a, '-')}")
    if args.plan:
        print(json.dumps(s["shapes"]))
        return 0
    record = warmup.run_units(shapes.units(plan, adapters), args.device, jobs=args.jobs, timeout=args.warmup_timeout,
                              shards=args.warmup_shards,
                              progress=lambda line: print(line, flush=True),
                              warm=warmup.warm_keys(opts.cache_dir))
    record["shape_plan"] = s
    warmup.write_record(record, opts.cache_dir)
    print(warmup.table(record))
    print(json.dumps({"groups": len(record["groups"]), "wall_s": round(record["wall_s"], 1),
                      **{k: round(v, 1) for k, v in record["totals"].items()}, "errors": record["errors"]}))
    return 1 if record["errors"] else 0


if __name__ == "__main__":  # the child of the `warmup` command (cli.in_child)
    from . import cli

    sys.exit(cli.command_child(main))
