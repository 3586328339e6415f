# Sourced by the device scripts: device_build BUILD LOGDIR builds k3ref._core and libk3gc with
# meson in BUILD (set up once), only those two targets (not the golden generators or the
# command), logs in LOGDIR/meson.txt and ninja.txt; when meson fails, libk3gc alone with nvcc
# as gpu_check/meson.build builds it (without k3ref._core the verdicts that need it fail
# closed; libk3gc still gives the reference, the fp32 kernel and the mutants). Returns the
# meson build's status (0: both built).
device_build() {
  local build=$1 logs=$2 rc=0 targets
  { [ -f "$build/build.ninja" ] || { rm -rf "$build"; meson setup "$build" -Dgpu_check=enabled \
      -Dpython=enabled -Dtests=disabled -Dbenchmarks=disabled > "$logs/meson.txt" 2>&1; }; } &&
    targets=$(ninja -C "$build" -t targets all | sed -n 's/^\(python\/_core[^:]*\.so\|gpu_check\/libk3gc\.so\): .*/\1/p') &&
    ninja -C "$build" $targets > "$logs/ninja.txt" 2>&1 || rc=$?
  if [ "$rc" != 0 ]; then
    echo "meson build failed (rc $rc):"; tail -5 "$logs/meson.txt" "$logs/ninja.txt" 2>/dev/null
    mkdir -p "$build/gpu_check"
    ${NVCC:-nvcc} -O3 -std=c++17 --fmad=false -shared -Xcompiler -fPIC \
      -gencode="arch=compute_${GPU_CHECK_ARCH:-90},code=[sm_${GPU_CHECK_ARCH:-90},compute_${GPU_CHECK_ARCH:-90}]" \
      -Igpu_check/include -o "$build/gpu_check/libk3gc.so" gpu_check/src/*.cu || rc=1
  fi
  return $rc
}
