#!/usr/bin/env bash
# The whole GPU matrix timed on one machine: cold (empty cache directory), warm (the same
# directory again), then `prop` against FLA chunk_kda for PROP_SECONDS (default 180) after its
# bucket warm-up, each timed; prints a short table last (of every step done so far in OUT_DIR).
#
#   [STEPS="build cold warm propwarm prop"] gpu_check/device_matrix.sh [OUT_DIR]
#   env: STEPS (the steps to run now, in order; steps of earlier calls stay in OUT_DIR, so one
#        call may do "build cold" and the next "warm propwarm prop"), TP (third-party root,
#        default .thirdparty), JOBS (warm-up workers, default nproc), CHECK_JOBS (adapters checked
#        side by side, default 8; 1 = the serial check phase), PROP_SECONDS (default 180),
#        RUN_ARGS (extra arguments for both runs), PROP_ARGS (extra arguments for prop),
#        PROP_KERNEL (default fla.chunk_kda),
#        PYTHON (default python3)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${1:-$ROOT/.scratch/gpu_check_matrix}
PY=${PYTHON:-python3}
TP=${TP:-$ROOT/.thirdparty}
JOBS=${JOBS:-$(nproc)}
PROP_SECONDS=${PROP_SECONDS:-180}
CHECK_JOBS=${CHECK_JOBS:-8}   # adapters whose checks run side by side (run --check-jobs)
STEPS=${STEPS:-build cold warm propwarm prop}
mkdir -p "$OUT"
CACHE=$OUT/cache   # emptied by the cold step; the warm run and prop reuse it
has() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }
elapsed() { awk -v a="$(date +%s.%N)" -v b="$1" 'BEGIN{print a-b}'; }

if has build; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
  echo "== meson build (libk3gc, k3ref._core)"
  t0=$(date +%s.%N)
  build_rc=0
  . gpu_check/device_build.sh
  device_build "$OUT/build" "$OUT" || build_rc=$?
  echo "$build_rc $(elapsed "$t0")" > "$OUT/build.rc_wall"
fi
export K3GC_LIB=$OUT/build/gpu_check/libk3gc.so K3REF_CORE_PATH=$OUT/build/python
export PYTHONPATH=$ROOT/python:${PYTHONPATH:-}
PATHS="--fla-path $TP/fla_pkg --flashkda-path $TP/FlashKDA --liger-path $TP/Liger-Kernel --torchtitan-path $TP/torchtitan"

run_matrix() {  # $1 = cold | warm
  local t0=$(date +%s.%N)
  $PY -m k3ref.gpu_check run --out "$OUT/$1" --cache-dir "$CACHE" --jobs "$JOBS" --check-jobs "$CHECK_JOBS" \
    $PATHS ${RUN_ARGS:-} \
    > "$OUT/$1.log" 2>&1
  echo "$? $(elapsed "$t0")" > "$OUT/$1.rc_wall"
  tail -4 "$OUT/$1.log"
}
PROP="$PY -m k3ref.gpu_check prop --kernel ${PROP_KERNEL:-fla.chunk_kda} --seed 1 --cache-dir $CACHE --jobs $JOBS --fla-path $TP/fla_pkg"
if has cold; then echo "== cold run (empty $CACHE)"; rm -rf "$CACHE"; run_matrix cold; fi
if has warm; then echo "== warm run"; run_matrix warm; fi
if has propwarm; then
  echo "== prop bucket warm-up (prop --examples 1)"
  t0=$(date +%s.%N)
  $PROP --examples 1 --out "$OUT/prop_failures" ${PROP_ARGS:-} > "$OUT/propwarm.log" 2>&1
  echo "$? $(elapsed "$t0")" > "$OUT/propwarm.rc_wall"
  grep -E "^warm-up:|^prop:|^PASS|^FAIL" "$OUT/propwarm.log" | head -5
fi
if has prop; then
  echo "== prop --kernel ${PROP_KERNEL:-fla.chunk_kda} for $PROP_SECONDS s (buckets warm from propwarm)"
  t0=$(date +%s.%N)
  timeout -s INT "$PROP_SECONDS" $PROP --examples 100000 --no-warmup --progress \
    --out "$OUT/prop_failures" ${PROP_ARGS:-} > "$OUT/prop.log" 2>&1
  echo "$? $(elapsed "$t0")" > "$OUT/prop.rc_wall"
  grep -v "^prop example" "$OUT/prop.log" | tail -5
fi

$PY - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = []
for name in ("build", "propwarm"):
    if (out / f"{name}.rc_wall").is_file():
        rc, wall = (out / f"{name}.rc_wall").read_text().split()
        rows.append(f"{name:8s} rc {rc} wall {float(wall):7.1f} s")
for name in ("cold", "warm"):
    if not (out / f"{name}.rc_wall").is_file():
        continue
    rc, wall = (out / f"{name}.rc_wall").read_text().split()
    try:
        d = json.loads((out / name / "report.json").read_text())
        s, n_results = d["summary"], len(d.get("results", []))
    except Exception as e:
        rows.append(f"{name:5s} rc {rc} wall {float(wall):7.1f} s  (no report.json: {type(e).__name__})")
        continue
    k = s.get("kernels", {})
    tsum = lambda key: sum((v.get("timing") or {}).get(key, 0) or 0 for v in k.values())
    w = (s.get("warmup") or {})
    wt = w.get("totals", {})
    plan = s.get("shape_plan", {})
    rows.append(f"{name:5s} rc {rc} wall {float(wall):7.1f} s | warm-up wall {w.get('wall_s', 0):6.1f} s "
                f"(compile {wt.get('compile_s', 0):7.1f}, autotune {wt.get('autotune_s', 0):6.1f} summed over "
                f"{len(w.get('groups', []))} groups) | checks' children: import {tsum('startup_and_import_s'):6.1f}, "
                f"compile {tsum('compile_s'):6.1f}, autotune {tsum('autotune_s'):6.1f}, check {tsum('check_s'):6.1f} s | "
                f"shapes {plan.get('distinct_compiled_shapes')} (before {plan.get('distinct_compiled_shapes_before')}) "
                f"in {plan.get('groups')} groups | tests {s.get('tests')}, results {n_results} (474 before), "
                f"executed {s.get('executed')} passed {s.get('passed')} failed {s.get('failed')} | verdict {s.get('verdict')}")
    t = s.get("timeline") or {}
    marks = t.get("marks_s") or {}
    if marks.get("session finish") is not None:  # where the wall went (report.json's summary.timeline)
        ends = sorted((w["last_end_s"], name) for name, w in (t.get("workers") or {}).items())
        rows.append(f"      timeline: plan at {t.get('plan_ready_s') or 0:.1f} s, first test at "
                    f"{min((w['first_start_s'] for w in (t.get('workers') or {}).values()), default=0):.1f} s, "
                    f"last worker {ends[-1][1] if ends else '-'} done at {ends[-1][0] if ends else 0:.1f} s, session end at "
                    f"{marks['session finish']:.1f} s, then {float(wall) - marks['session finish']:.1f} s to the run's end")
if not (out / "prop.rc_wall").is_file():
    print("\n".join(["", "== device_matrix summary"] + rows))
    sys.exit(0)
rc, wall = (out / "prop.rc_wall").read_text().split()
times = [float(l.split(" at ")[1].split(":")[0]) for l in (out / "prop.log").read_text().splitlines()
         if l.startswith("prop example ")]
outside = sum(" outside " in l for l in (out / "prop.log").read_text().splitlines() if l.startswith("prop example "))
if times:
    span = times[-1] - times[0]
    late = [t for t in times if t - times[0] >= 60]
    rate = 60 * len(times) / span if span > 0 else float("nan")
    late_rate = 60 * len(late) / (span - 60) if span > 60 else float("nan")
    rows.append(f"prop  rc {rc} wall {float(wall):7.1f} s | {len(times)} examples ({outside} outside the buckets) "
                f"in {span:.1f} s of drawing (after the bucket warm-up): {rate:.1f}/min overall, "
                f"{late_rate:.1f}/min after the first minute")
else:
    rows.append(f"prop  rc {rc} wall {float(wall):7.1f} s | no example finished (see prop.log)")
print("\n".join(["", "== device_matrix summary"] + rows))
PYEOF
