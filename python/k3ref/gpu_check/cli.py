"""The CI command: python3 -m k3ref.gpu_check run --goldens goldens --out report/

Runs every available adapter on every golden case it supports and the metamorphic checks,
runs the mutant zoo (each mutant must be caught by at least one check), writes
report.xml (JUnit), report.json and report.html, prints the kernels x checks table, and
exits 1 on any failure of a real kernel or any mutant not caught."""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

from . import adapters as A
from . import checks, golden, lib, report


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m k3ref.gpu_check")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the checks and write the reports")
    r.add_argument("--goldens", default=str(Path(__file__).resolve().parents[3] / "goldens"))
    r.add_argument("--out", default="gpu_check_report")
    r.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    r.add_argument("--lib", help="path of libk3gc.so (default: $K3GC_LIB or build*/gpu_check/)")
    r.add_argument("--fla-path", help="directory holding the fla package")
    r.add_argument("--flashkda-path", help="directory holding the flash_kda package and its extension")
    r.add_argument("--liger-path", help="Liger-Kernel checkout (holding src/liger_kernel) for its AttnRes kernel")
    r.add_argument("--torchtitan-path", help="torchtitan checkout (holding torchtitan/) for its Quantile Balancing")
    r.add_argument("--only", help="comma-separated adapter names to run")
    r.add_argument("--no-mutants", action="store_true")
    r.add_argument("--checks", help="comma-separated checks to run (golden, causality, suffix, varlen, split, "
                   "determinism, poisoned_memory, inputs_unchanged; default all)")
    r.add_argument("--cases", help="comma-separated golden case names (default all)")
    r.add_argument("--budget", type=float, default=0, help="seconds per kernel; later checks are skipped (0: none)")
    p = sub.add_parser("prop", help="property-based testing of one KDA kernel against the reference (Hypothesis)")
    p.add_argument("--kernel", required=True, help="adapter name, e.g. fla.chunk_kda, flashkda.fwd, k3gc.fp32")
    p.add_argument("--examples", type=int, default=100)
    p.add_argument("--seed", type=int, help="Hypothesis seed (printed; the same seed replays the whole run)")
    p.add_argument("--max-T", dest="max_T", type=int, default=48, help="longest sequence drawn")
    p.add_argument("--out", default="prop_failures", help="directory for the shrunk failing case")
    p.add_argument("--replay", help="run the kernel on one golden file (a written failure) and judge it")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--lib", help="path of libk3gc.so")
    p.add_argument("--fla-path", help="directory holding the fla package")
    p.add_argument("--flashkda-path", help="directory holding the flash_kda package and its extension")
    args = ap.parse_args(argv)

    if args.cmd == "prop":
        from . import prop

        return prop.main(args)
    if args.lib:
        lib.load(args.lib)
    A.FlaAdapter.fla_path = args.fla_path
    A.FlashKdaAdapter.flashkda_path = args.flashkda_path
    adapters = A.all_adapters(include_mutants=not args.no_mutants)
    # AttnRes and QB implementations: golden checks on their own operators' cases.
    from . import attnres_check, qb_check

    attnres_check.LigerAttnResAdapter.liger_path = args.liger_path
    qb_check.TorchtitanQbAdapter.torchtitan_path = args.torchtitan_path
    op_adapters = [attnres_check.LigerAttnResAdapter(), qb_check.TorchtitanQbAdapter(),
                   qb_check.TorchtitanQbAdapter(histogram=True)]
    if args.only:
        names = set(args.only.split(","))
        adapters = [a for a in adapters if a.name in names]
        op_adapters = [a for a in op_adapters if a.name in names]
    cases = golden.load_suite(args.goldens)
    if args.cases:
        wanted = set(args.cases.split(","))
        cases = [c for c in cases if c.name in wanted]
    if args.checks:
        wanted = set(args.checks.split(","))
        checks.METAMORPHIC[:] = [c for c in checks.METAMORPHIC if c.__name__.replace("check_", "").replace(
            "poison", "poisoned_memory") in wanted]
        if "golden" not in wanted:
            cases = []
    t0 = time.time()
    results = checks.run_all(adapters, cases, args.device, budget_s=args.budget,
                             progress=lambda line: print(line, flush=True))
    if not args.checks or "golden" in args.checks.split(","):
        op_cases = golden.load_suite(args.goldens, ops=("attnres.full", "attnres.block", "attnres.phase1",
                                                        "qb.solver", "qb.online"))
        if args.cases:
            op_cases = [c for c in op_cases if c.name in set(args.cases.split(","))]
        results += checks.run_op_adapters(op_adapters, op_cases, args.device,
                                          progress=lambda line: print(line, flush=True))
    kills = checks.mutant_kills(results)
    real_failures = [r for r in results if not r.adapter.startswith("mutant.") and r.status in ("fail", "error")]
    survivors = [m for m, caught in kills.items() if not caught]
    summary = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "goldens": len(cases),
        "seconds": round(time.time() - t0, 2),
        "results": len(results),
        "passed": sum(r.status == "pass" for r in results if not r.adapter.startswith("mutant.")),
        "failed": len(real_failures),
        "skipped": sum(r.status == "skip" for r in results),
        "unavailable": {r.adapter: r.reason for r in results if r.check == "all"},
        "mutants": len(kills),
        "mutants_caught": len(kills) - len(survivors),
        "mutant_kill_rate": (len(kills) - len(survivors)) / len(kills) if kills else None,
        "mutant_kills": kills,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report.write_junit(out / "report.xml", results)
    report.write_json(out / "report.json", results, summary)
    report.write_html(out / "report.html", results, summary)
    print(report.markdown_table(results))
    for m, caught in kills.items():
        print(f"{m}: {'caught by ' + ', '.join(caught) if caught else 'NOT CAUGHT'}")
    for r in real_failures:
        print(f"FAIL {r.adapter} {r.check}[{r.case}]: {r.reason}")
    print(json.dumps({k: v for k, v in summary.items() if k != "mutant_kills"}))
    return 1 if real_failures or survivors else 0


if __name__ == "__main__":
    sys.exit(main())
