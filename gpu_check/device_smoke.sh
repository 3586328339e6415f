#!/usr/bin/env bash
# gpu_check on a GPU machine: builds libk3gc (sm_90) and the k3ref Python module, runs the
# comparator / fp64-reference benchmark (k3ref.gpu_check.bench), the property run against libk3gc's
# fp32 kernel, and the CI harness. Third-party kernels are found through the paths given
# (nothing is fetched or vendored here).
#
#   gpu_check/device_smoke.sh [OUT_DIR]
#   env: FLA_PATH, FLASHKDA_PATH, LIGER_PATH, TORCHTITAN_PATH (checkouts; default .thirdparty/*),
#        BUILD_FLASHKDA=1 (build its extension in place first),
#        PROP_KERNELS (real kernels for `prop`; default "fla.fused_recurrent_kda fla.chunk_kda flashkda.fwd",
#        empty to skip), SKIP_RUN=1 (no CI harness run),
#        BENCH_ELEMENTS (default 2^31), BENCH_TOKENS (default 10^6), PROP_EXAMPLES (default 200),
#        RUN_ARGS (extra arguments for `k3ref.gpu_check run`, e.g. "--budget 240 --only k3gc.fp32,fla.chunk_kda"),
#        CACHE_DIR (Triton's cache for the run; default OUT_DIR/cache), GPU_CHECK_ARCH (default 90)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${1:-${OUT:-$ROOT/gpu_check_smoke}}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
TP=$ROOT/.thirdparty
FLA_PATH=${FLA_PATH:-$TP}                      # directory holding the fla package
FLASHKDA_PATH=${FLASHKDA_PATH:-$TP/FlashKDA}   # directory holding flash_kda (built extension)
LIGER_PATH=${LIGER_PATH:-$TP/Liger-Kernel}     # checkout root (src/liger_kernel)
TORCHTITAN_PATH=${TORCHTITAN_PATH:-$TP/torchtitan}
status=0
step() { echo "== $*" | tee -a "$OUT/steps.log"; }

step "nvidia-smi"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"

ARCH=${GPU_CHECK_ARCH:-90}
step "build libk3gc.so (sm_$ARCH, --fmad=false, as gpu_check/meson.build does)"
mkdir -p "$OUT/lib"
"$NVCC" -O3 -std=c++17 --fmad=false -shared -Xcompiler -fPIC -gencode="arch=compute_$ARCH,code=[sm_$ARCH,compute_$ARCH]" \
  -Xptxas -v -Igpu_check/include -o "$OUT/lib/libk3gc.so" gpu_check/src/*.cu 2> "$OUT/ptxas.txt" || { cat "$OUT/ptxas.txt"; exit 1; }
grep -E "spill stores" "$OUT/ptxas.txt" | sort | uniq -c
export K3GC_LIB=$OUT/lib/libk3gc.so

step "k3ref's extension k3ref._core (pybind11 from PyTorch when pybind11-dev is absent; MPFR optional)"
if command -v meson >/dev/null && command -v ninja >/dev/null; then
  MPFR_OPT=-Dmpfr=auto
  rm -rf "$OUT/build"
  meson setup "$OUT/build" -Dtests=disabled -Dbenchmarks=disabled -Dgpu_check=disabled -Dpython=enabled \
    $MPFR_OPT > "$OUT/meson.txt" 2>&1 || { rm -rf "$OUT/build"; meson setup "$OUT/build" -Dtests=disabled -Dbenchmarks=disabled \
    -Dgpu_check=disabled -Dpython=enabled -Dmpfr=disabled > "$OUT/meson.txt" 2>&1; }
  ninja -C "$OUT/build" > "$OUT/ninja.txt" 2>&1 && export K3REF_CORE_PATH=$OUT/build/python \
    || { echo "module not built (see $OUT/ninja.txt): prop falls back to the fp64 references"; tail -5 "$OUT/ninja.txt"; }
else
  echo "meson/ninja missing: no k3ref._core; prop uses libk3gc's and PyTorch's fp64 references"
fi
export PYTHONPATH=$ROOT/python:${PYTHONPATH:-}

if [ "${BUILD_FLASHKDA:-0}" = 1 ] && [ -f "$FLASHKDA_PATH/setup.py" ]; then
  step "build FlashKDA's extension in place (BUILD_FLASHKDA=1; several minutes)"
  (cd "$FLASHKDA_PATH" && $PY setup.py build_ext --inplace > "$OUT/flashkda_build.txt" 2>&1) \
    || echo "FlashKDA build failed (see $OUT/flashkda_build.txt): reported as skipped"
fi

step "benchmark: comparator vs device copy, fp64 reference over 10^6 tokens"
$PY -m k3ref.gpu_check.bench --elements "${BENCH_ELEMENTS:-2147483648}" --tokens "${BENCH_TOKENS:-1000000}" \
  2>&1 | tee "$OUT/bench.json" || status=1

step "property run: libk3gc's fp32 kernel (must pass) and one mutant (must be caught and shrunk)"
$PY -m k3ref.gpu_check prop --kernel k3gc.fp32 --examples "${PROP_EXAMPLES:-200}" --max-T 300 --seed 1 --out "$OUT/prop" \
  2>&1 | tail -20 | tee "$OUT/prop_fp32.txt" || status=1
$PY -m k3ref.gpu_check prop --kernel mutant.read_ahead --examples 100 --seed 1 --out "$OUT/prop" 2>&1 | tail -8 \
  | tee "$OUT/prop_mutant.txt"
for k in ${PROP_KERNELS-fla.fused_recurrent_kda fla.chunk_kda flashkda.fwd}; do
  $PY -m k3ref.gpu_check prop --kernel "$k" --examples "${PROP_EXAMPLES:-200}" --max-T 300 --seed 1 --out "$OUT/prop" \
    --fla-path "$FLA_PATH" --flashkda-path "$FLASHKDA_PATH" 2>&1 | tail -12 | tee "$OUT/prop_$k.txt"
done

if [ "${SKIP_RUN:-0}" != 1 ]; then
step "CI harness (JUnit, JSON, HTML in $OUT/report)"
$PY -m k3ref.gpu_check run --out "$OUT/report" --fla-path "$FLA_PATH" --flashkda-path "$FLASHKDA_PATH" \
  --liger-path "$LIGER_PATH" --torchtitan-path "$TORCHTITAN_PATH" --cache-dir "${CACHE_DIR:-$OUT/cache}" \
  ${RUN_ARGS:-} 2>&1 | tail -80 | tee "$OUT/run.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
echo "exit $status; outputs in $OUT"
exit $status
