#!/usr/bin/env bash
# The layer-level checks on a GPU machine (docs/kda-layer.md, docs/latent-moe.md,
# docs/benchmarks.md "Roofline"): FLA's and torchtitan's KimiDeltaAttention against the kda_layer
# goldens and themselves (k3ref.layer_check, with torchtitan's KCP on 2 ranks), torchtitan's
# latent MoE layer (k3ref.moe_check --device cuda), and the roofline table of FLA chunk_kda,
# fused_recurrent_kda and FlashKDA (k3ref.gpu_check.bench --roofline). Each part runs under its
# own time limit and a failing part does not stop the others; every part writes its JSON rows
# and a measurements/ file under OUT, and the last lines printed are a short table.
#
#   gpu_check/device_layers.sh [OUT_DIR]        (default $OUT, else ./device_layers_out)
#   env: TP (third-party root; default .thirdparty): fla_pkg (the fla package), torchtitan,
#        FlashKDA (its extension built in place), pydeps (torchtitan's Python dependencies
#        absent from the image: spmd_types, tyro, typeguard, docstring_parser; appended to the
#        path, so installed packages come first);
#        K3REF_CORE_PATH (a built k3ref._core; else built here into BUILD_DIR, default
#        /tmp/k3ref_layers_build, ~1-2 min);
#        LIMIT_LAYERS, LIMIT_MOE, LIMIT_ROOFLINE, LIMIT_KCP (seconds; defaults 150, 60, 200, 150); HEADS (96);
#        LAYER (fla, torchtitan or both, default both: the layers step);
#        STEPS (the parts to run, default "layers moe roofline kcp"; "moe_cpu" runs the latent
#        MoE check on the machine's CPU as well: KCP alone, which autotunes chunk_kda on each
#        rank, can take a device call of its own).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${1:-${OUT:-$ROOT/device_layers_out}}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
TP=${TP:-$ROOT/.thirdparty}
# FLA's Triton kernels, not a backend it dispatches to (as the harness pins them).
export FLA_FLASH_KDA=0 FLA_TILELANG=0 FLA_DISABLE_BACKEND_DISPATCH=1
export PYTHONPATH=$ROOT/python:$TP/fla_pkg:$TP/torchtitan:$TP/FlashKDA:${PYTHONPATH:-}:$TP/pydeps
# tyro needs typing_extensions >= 4.13: pydeps/_override holds one, put first only where the
# installed one is older.
$PY -c "import typing_extensions as t; t.Union" 2>/dev/null || export PYTHONPATH=$TP/pydeps/_override:$PYTHONPATH
export K3REF_FLA_PATH=$TP/fla_pkg K3REF_FLASHKDA_PATH=$TP/FlashKDA K3REF_TORCHTITAN_PATH=$TP/torchtitan
export K3REF_COMMIT=${K3REF_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
STEPS=${STEPS:-layers moe roofline kcp}
has() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }
step() { echo "== $* ($(date +%T))" | tee -a "$OUT/steps.log"; }
status=0

step "k3ref._core (the judge)"
if [ -z "${K3REF_CORE_PATH:-}" ]; then
  B=${BUILD_DIR:-/tmp/k3ref_layers_build}  # outside OUT: OUT comes back to the caller
  . gpu_check/device_build.sh
  device_build "$B" "$OUT" && export K3REF_CORE_PATH=$B/python || { echo "k3ref._core not built (see $OUT/ninja.txt)"; status=1; }
fi
$PY -c "import flash_kda" 2>/dev/null || echo "flash_kda not importable from $TP/FlashKDA: the roofline reports FlashKDA as not loaded"

if has layers; then
step "FLA's and torchtitan's KimiDeltaAttention (k3ref.layer_check: goldens, self-consistency)"
timeout -k 10 "${LIMIT_LAYERS:-150}" $PY -m k3ref.layer_check --layer "${LAYER:-both}" --device cuda --checks golden,self \
  --fla-path "$TP/fla_pkg" --torchtitan-path "$TP/torchtitan" --json "$OUT/layers.json" \
  --measurement "$OUT/h200_kda_layers.json" > "$OUT/layers.txt" 2>&1
rc=$?; [ $rc = 0 ] || { status=1; echo "layer_check exit $rc$([ $rc = 124 ] && echo ': over its limit')"; }
fi

moe_step() {  # $1 = cuda | cpu, $2 = the name of its files, $3 = its measurement's id
  step "torchtitan's latent MoE layer (k3ref.moe_check --device $1)"
  timeout -k 10 "${LIMIT_MOE:-60}" $PY -m k3ref.moe_check --torchtitan-path "$TP/torchtitan" --device "$1" \
    --json "$OUT/$2.json" --measurement "$OUT/$3.json" > "$OUT/$2.txt" 2>&1
  local rc=$?; [ $rc = 0 ] || { status=1; echo "moe_check --device $1 exit $rc"; }
}
if has moe; then moe_step cuda moe h200_torchtitan_latent_moe; fi
if has moe_cpu; then moe_step cpu moe_cpu cpu_torchtitan_latent_moe; fi

if has roofline; then
step "roofline (k3ref.gpu_check.bench --roofline)"
timeout -k 10 "${LIMIT_ROOFLINE:-200}" $PY -m k3ref.gpu_check.bench --roofline --heads "${HEADS:-96}" \
  --json "$OUT/roofline.json" --measurement "$OUT/h200_roofline_kda.json" > "$OUT/roofline.txt" 2>&1
rc=$?; [ $rc = 0 ] || { status=1; echo "roofline exit $rc (its rows so far are in $OUT/roofline.json)"; }
fi

# Last: each rank autotunes FLA's chunk_kda (its only mode under KCP), up to minutes.
if has kcp; then
step "torchtitan's KCP path on 2 ranks (NCCL with 2 GPUs, else gloo on one)"
timeout -k 10 "${LIMIT_KCP:-150}" $PY -m k3ref.layer_check --layer torchtitan --device cuda --checks kcp \
  --torchtitan-path "$TP/torchtitan" --json "$OUT/kcp.json" --measurement "$OUT/h200_torchtitan_kcp.json" > "$OUT/kcp.txt" 2>&1
rc=$?; [ $rc = 0 ] || { status=1; echo "KCP exit $rc$([ $rc = 124 ] && echo ': over its limit')"; }
fi

step "summary"
has layers && { echo "--- layers (last lines of $OUT/layers.txt)"; grep -v '^{' "$OUT/layers.txt" | tail -40; }
has kcp && { echo "--- KCP"; grep -v '^{' "$OUT/kcp.txt" | tail -4; }
has moe && { echo "--- moe"; $PY - "$OUT/moe.json" <<'EOF' || tail -5 "$OUT/moe.txt"
import json, sys
for r in json.load(open(sys.argv[1])):
    print(r["case"][:44].ljust(44), r.get("batch", ""), "out %.2e" % r["output_rel_rms"] if "output_rel_rms" in r else "",
          "bias %.1e" % r["carried_bias_error"] if "carried_bias_error" in r else "", (r.get("error") or r.get("skipped") or "")[:70])
EOF
}
has roofline && { echo "--- roofline"; tail -14 "$OUT/roofline.txt"; }
echo "exit $status; outputs in $OUT"
exit $status
