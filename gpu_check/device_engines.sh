#!/usr/bin/env bash
# The serving engines' own KDA/GDN kernels (vLLM, SGLang, TokenSpeed) under every serving check, on one
# GPU: builds k3ref._core (the judge; with libk3gc, through device_build.sh), runs `python3 -m k3ref.gpu_check.serving_check --engines`
# and writes its rows (kernel x check x case: verdict, figure = worst error / bound, bound,
# reason, engine source and commit) to OUT/engines.json and as a measurements/ file
# (OUT/h200_engine_serving.json, known limitations applied); prints the kernel x check table last.
# A kernel that does not load is one row with its reason; the others still run.
#
#   gpu_check/device_engines.sh [OUT_DIR]
#   env: TP (third-party root, default .thirdparty: vllm/ and sglang/ laid out with COMMITS.txt,
#        vllm/kda/ the KDA ops of one commit, tokenspeed/, fla_pkg/), PYTHON (default python3),
#        ONLY (comma-separated kernel names), KERNEL_TIMEOUT (seconds for one kernel's checks,
#        default 300), PAR (kernels run at once, default 4), SPLIT (comma-separated kernels whose
#        golden check runs in a process of its own beside their other checks: a kernel whose
#        goldens autotune many shapes), K3REF_CORE_PATH (a built k3ref._core: the build step is
#        skipped)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${1:-${OUT:-$ROOT/.scratch/engines}}
PY=${PYTHON:-python3}
TP=${TP:-$ROOT/.thirdparty}
mkdir -p "$OUT"
t0=$(date +%s)

export PYTHONPATH=$ROOT/python:${PYTHONPATH:-}
if [ -n "${K3REF_CORE_PATH:-}" ] && $PY -c "import k3ref; k3ref._compiled()" 2>/dev/null; then
  echo "== k3ref._core from K3REF_CORE_PATH=$K3REF_CORE_PATH"
else
  echo "== k3ref._core (the judge)"
  . gpu_check/device_build.sh
  device_build "$OUT/build" "$OUT" || echo "k3ref._core not built (see $OUT/ninja.txt)"
  echo "built in $(( $(date +%s) - t0 )) s"
  export K3REF_CORE_PATH=$OUT/build/python
fi
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$OUT/triton}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee "$OUT/versions.txt"
for f in "$TP/vllm/COMMITS.txt" "$TP/sglang/COMMITS.txt" "$TP/tokenspeed/COMMITS.txt"; do [ -f "$f" ] && grep -v '^#' "$f"; done | tee "$OUT/commits.txt"

echo "== serving checks on the engines' kernels, one process each (a crash or a poisoned CUDA context stays in it)"
SC="$PY -m k3ref.gpu_check.serving_check --engines --device cuda --vllm-path $TP/vllm --sglang-path $TP/sglang --tokenspeed-path $TP/tokenspeed --fla-path $TP/fla_pkg"
mkdir -p "$OUT/rows"
kernels=$($SC ${ONLY:+--only "$ONLY"} --list)
set -f  # kernel names hold brackets: no globbing
stem() { printf '%s' "$1" | tr '[]' '__'; }  # plain file names
checks_of() { [ "${1%%|*}" != "$1" ] && printf '%s' "${1#*|}"; return 0; }  # a job's checks part
part() {  # the row file of a job: kernel, kernel|golden or kernel|-golden
  local k=${1%%|*} c
  c=$(checks_of "$1")
  printf '%s' "$OUT/rows/$(stem "$k")${c:+.${c/-/not_}}.json"
}
run_one() {  # $1 = kernel, kernel|golden (its golden check alone) or kernel|-golden (the others)
  local k=${1%%|*} c f s0 sel=()
  c=$(checks_of "$1")
  case "$c" in -*) sel=(--skip-checks "${c#-}");; ?*) sel=(--checks "$c");; esac
  f=$(part "$1"); rm -f "$f"; s0=$(date +%s)
  timeout "${KERNEL_TIMEOUT:-300}" $SC --only "$k" "${sel[@]}" --out "$f" > "${f%.json}.log" 2>&1
  echo "$1: rc $?, $(( $(date +%s) - s0 )) s"
}
export -f stem checks_of part run_one; export SC OUT KERNEL_TIMEOUT
jobs=()
for k in $kernels; do
  case ",${SPLIT:-}," in
    *",$k,"*) jobs+=("$k|golden" "$k|-golden");;
    *) jobs+=("$k");;
  esac
done
# PAR processes at once (default 4): they share the GPU; Triton's compiles run side by side
printf '%s\n' "${jobs[@]}" | xargs -P "${PAR:-4}" -I{} bash -c 'run_one "$1"' _ {}
files=()
for j in "${jobs[@]}"; do files+=("$(part "$j")"); done
echo "== findings/vllm-gdn-spec-verify-edges/repro.py (predicted from the source; exit 1: reproduced)"
timeout 120 $PY findings/vllm-gdn-spec-verify-edges/repro.py "$TP/vllm" > "$OUT/vllm_repro.txt" 2>&1
echo "rc $?" >> "$OUT/vllm_repro.txt"; tail -4 "$OUT/vllm_repro.txt"
$SC --merge "${files[@]}" --out "$OUT/engines.json" --measurement "$OUT/h200_engine_serving.json" > "$OUT/table.txt" 2>&1
rc=$?
echo "rc $rc, $(( $(date +%s) - t0 )) s in all" >> "$OUT/table.txt"
cat "$OUT/table.txt"
