#!/usr/bin/env bash
# The scale tier on one GPU (docs/gpu_check.md, "The scale tier"): builds libk3gc and
# k3ref._core, runs `run --tier scale` once per kernel, each in its own process (a crash or a
# CUDA error of one kernel cannot stop the others): FLA chunk_kda and fused_recurrent_kda,
# FlashKDA, libk3gc's fp32 kernel and its four scale mutants; cold (empty cache directory)
# and, when the time allows, warm; then the default tier on the four mutants, which must miss
# them. Writes JSON under OUT_DIR (scale_summary.json: kernel x case, figure, bound, verdict,
# wall times; each kernel's scale.json; the default run's report) and prints a short table last.
#
#   [STEPS="build cold default warm"] gpu_check/device_scale.sh [OUT_DIR]   # default $OUT, else .cache_k3ref/scale
#   env: TP (third-party root, default .thirdparty), BUILD (build directory, default
#        .cache_k3ref/scale_build, reused when it is there), CACHE (Triton's cache, default
#        .cache_k3ref/scale_cache: emptied by the cold step, kept for the warm one, also across
#        calls on one machine: STEPS="build cold" then STEPS="default warm"), KERNEL_TIMEOUT
#        (seconds per kernel and pass, default 240), BUDGET (seconds for the whole script, default
#        540, for one 10-minute call: a kernel's limit is cut to what is left less 40 s for the
#        summary, a kernel with under 30 s left is not started, the default step needs 120 s),
#        WARM_IF_UNDER (the warm pass runs only when the script has taken fewer seconds than
#        this, default 200), KERNELS (the kernels, in order; default every built-in and mutant: the
#        first one run also checks the reference against the goldens), PYTHON (default python3)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT_DIR=${1:-${OUT:-$ROOT/.cache_k3ref/scale}}
PY=${PYTHON:-python3}
TP=${TP:-$ROOT/.thirdparty}
BUILD=${BUILD:-$ROOT/.cache_k3ref/scale_build}
STEPS=${STEPS:-build cold default warm}
KERNEL_TIMEOUT=${KERNEL_TIMEOUT:-240}
WARM_IF_UNDER=${WARM_IF_UNDER:-200}
BUDGET=${BUDGET:-540}
mkdir -p "$OUT_DIR"
CACHE=${CACHE:-$ROOT/.cache_k3ref/scale_cache}
START=$(date +%s.%N)
has() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }
elapsed() { awk -v a="$(date +%s.%N)" -v b="$1" 'BEGIN{printf "%.1f", a-b}'; }
left() { awk -v e="$(elapsed "$START")" -v b="$BUDGET" 'BEGIN{printf "%d", b-e}'; }

if has build; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT_DIR/gpu.txt"
  t0=$(date +%s.%N)
  build_rc=0
  . gpu_check/device_build.sh
  device_build "$BUILD" "$OUT_DIR" || build_rc=$?
  echo "{\"rc\": $build_rc, \"wall_s\": $(elapsed "$t0")}" > "$OUT_DIR/build.json"
fi
export K3GC_LIB=$BUILD/gpu_check/libk3gc.so K3REF_CORE_PATH=$BUILD/python
export PYTHONPATH=$ROOT/python:${PYTHONPATH:-}
export FLA_FLASH_KDA=0 FLA_TILELANG=0 FLA_DISABLE_BACKEND_DISPATCH=1  # the harness pins the same (upstream.FLA_DISPATCH)
PATHS="--fla-path $TP/fla_pkg --flashkda-path $TP/FlashKDA"
KERNELS=${KERNELS:-fla.chunk_kda fla.fused_recurrent_kda flashkda.fwd k3gc.fp32 mutant.int32_offset_wrap mutant.grid_drops_sequences mutant.last_chunk_read_past_end mutant.bf16_state_long_t}

# as the adapter imports it: $TP/FlashKDA first on sys.path
if ! $PY -c "import sys; sys.path.insert(0, sys.argv[1]); import flash_kda" "$TP/FlashKDA" > "$OUT_DIR/flashkda_import.txt" 2>&1; then
  echo "FlashKDA skipped: not importable ($(tail -1 "$OUT_DIR/flashkda_import.txt"))"
  KERNELS=$(echo " $KERNELS " | sed "s/ flashkda.fwd / /")
fi

scale_pass() {  # $1 = cold | warm: every kernel in its own process; the goldens check rides with the first
  local first=1
  for k in $KERNELS; do
    local cases=""
    [ $first = 1 ] || cases="--cases ragged_tail,long_sequence,packed_documents,many_sequences,index_limit,gradients"
    first=0
    local limit=$(( $(left) - 40 ))
    [ "$limit" -gt "$KERNEL_TIMEOUT" ] && limit=$KERNEL_TIMEOUT
    if [ "$limit" -lt 30 ]; then echo "$1 $k: not started, $(left) s of BUDGET left"; continue; fi
    local t0=$(date +%s.%N)
    timeout -k 10 "$limit" $PY -m k3ref.gpu_check run --tier scale --only "$k" $cases --out "$OUT_DIR/$1/$k" \
      --cache-dir "$CACHE" $PATHS > "$OUT_DIR/$1/$k.log" 2>&1
    local rc=$?
    echo "{\"rc\": $rc, \"wall_s\": $(elapsed "$t0")}" > "$OUT_DIR/$1/$k.rc.json"
    echo "$1 $k: rc $rc in $(elapsed "$t0") s; $(tail -1 "$OUT_DIR/$1/$k.log")"
  done
}

if has cold; then rm -rf "$CACHE" "$OUT_DIR/cold"; mkdir -p "$OUT_DIR/cold"; echo "== scale tier, cold"; scale_pass cold; fi
if has default && [ "$(left)" -lt 120 ]; then echo "default step left out: $(left) s of BUDGET left"; fi
if has default && [ "$(left)" -ge 120 ]; then
  echo "== default tier on the scale mutants (each must be missed there)"
  t0=$(date +%s.%N)
  timeout -k 10 $(( $(left) - 40 )) $PY -m k3ref.gpu_check run --no-builtin --adapter k3ref.gpu_check.adapters:scale_mutants \
    --out "$OUT_DIR/default_mutants" --cache-dir "$CACHE" > "$OUT_DIR/default_mutants.log" 2>&1
  echo "{\"rc\": $?, \"wall_s\": $(elapsed "$t0")}" > "$OUT_DIR/default_mutants.rc.json"
  tail -3 "$OUT_DIR/default_mutants.log"
fi
if has warm; then
  if awk -v e="$(elapsed "$START")" -v m="$WARM_IF_UNDER" 'BEGIN{exit !(e < m)}'; then
    rm -rf "$OUT_DIR/warm"; mkdir -p "$OUT_DIR/warm"; echo "== scale tier, warm"; scale_pass warm
  else
    echo "warm pass left out: $(elapsed "$START") s taken (WARM_IF_UNDER=$WARM_IF_UNDER)"
  fi
fi

$PY - "$OUT_DIR" "$(elapsed "$START")" <<'EOF'
import json, sys
from pathlib import Path
from k3ref.gpu_check import scale
out, total = Path(sys.argv[1]), float(sys.argv[2])
summary = {"wall_s": total, "passes": {}, "default_tier_on_scale_mutants": None}
def load(p):
    try:
        return json.loads(Path(p).read_text())
    except (OSError, ValueError):
        return None
for p in ("cold", "warm"):
    if not (out / p).is_dir():
        continue
    rows, walls, mutants = [], {}, {}
    for rc in sorted((out / p).glob("*.rc.json")):
        k = rc.name[: -len(".rc.json")]
        walls[k] = load(rc)
        res = load(out / p / k / "scale.json")  # written after each case: a process ended from outside keeps its rows
        if res is None:
            rows.append({"kernel": k, "case": "(all)", "verdict": "error", "reason": f"no scale.json (rc {walls[k]})"})
            continue
        rows += res["results"]
        done = {r["case"] for r in res["results"] if r["kernel"] == k}
        if walls[k] and walls[k]["rc"] not in (0, 1):
            rows.append({"kernel": k, "case": "(rest)", "verdict": "error",
                         "reason": f"the process ended with rc {walls[k]['rc']} after {sorted(done)}"})
        mutants.update(res["summary"]["mutants"])
    summary["passes"][p] = {"rows": rows, "kernel_wall": walls, "mutants": mutants,
                            "wall_s": round(sum(w["wall_s"] for w in walls.values() if w), 1)}
rep = load(out / "default_mutants" / "report.json")
if rep is not None:
    summary["default_tier_on_scale_mutants"] = {n: ("caught" if m["verdict"] == "pass" else "missed") + ": " + m["reason"][:200]
                                                for n, m in rep["summary"]["mutants"].items()}
(out / "scale_summary.json").write_text(json.dumps(summary, indent=1, default=str))
for p, d in summary["passes"].items():
    print(f"\n== {p} pass: {d['wall_s']} s over {len(d['kernel_wall'])} kernel processes")
    print(scale.table(d["rows"]))
cold = summary["passes"].get("cold", {})
for n, v in cold.get("mutants", {}).items():
    dflt = (summary["default_tier_on_scale_mutants"] or {}).get(n, "not run")
    print(f"mutant {n}: scale tier {v}; default tier {dflt.split(':')[0]}")
walls = {p: d["wall_s"] for p, d in summary["passes"].items()}
print(f"scale tier wall: {walls}; script {total:.0f} s; {out / 'scale_summary.json'}")
EOF
