#!/usr/bin/env bash
# Layout variants of the fp64 reference's fast form (precision 2), timed and checked bit for bit
# against the plain kernel (precision 0, the definition): the same kda.cu built with another
# number of threads per column P (K3GC_FP64_THREADS_PER_COLUMN; the tree's build is P = 8) and
# any further definitions: K3GC_FP64_TOKENS_PER_TILE (8), K3GC_FP64_MIN_BLOCKS (the launch bound's
# blocks per SM, 3), or what an experiment adds. P changes who computes which element, not
# its IEEE operations or their order, so every variant must give the plain kernel's bits.
# Each row: sha256 of o and the final state on 8,192 tokens x 96 heads (K3's options) from the
# fast form and from the plain kernel of the same library, and the fast form's kernel time over
# 250,000 tokens (x 4: 10^6).
#
#   gpu_check/device_fp64_variants.sh [OUT_DIR] [P[:NAME=VALUE,...] ...]   (default: 4 16)
#   env: LIB (the tree's libk3gc.so, default build/gpu_check/libk3gc.so), K3REF_CORE_PATH as
#        the other device scripts, NVCC (default nvcc)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.cache_k3ref/fp64_variants}
shift || true
VARIANTS=${*:-4 16}
LIB=${LIB:-build/gpu_check/libk3gc.so}
mkdir -p "$OUT"
S=gpu_check/src
for v in $VARIANTS; do
  IFS=: read -r P DEFS <<< "$v"; N=p${P}${DEFS:+_${DEFS//[,=]/_}}
  ( ${NVCC:-nvcc} -O3 -std=c++17 --fmad=false -shared -Xcompiler -fPIC -gencode=arch=compute_90,code=sm_90 \
      -Igpu_check/include -I$S -DK3GC_FP64_THREADS_PER_COLUMN=$P ${DEFS:+$(printf -- ' -D%s' ${DEFS//,/ })} -Xptxas -v \
      -o "$OUT/lib_$N.so" $S/errors.cu $S/compare.cu $S/kda.cu $S/kda_backward.cu > "$OUT/build_$N.txt" 2>&1
    echo "nvcc rc $?" >> "$OUT/build_$N.txt" ) &
done
wait
export PYTHONPATH=$PWD/python:${PYTHONPATH:-}
LIBS="$LIB"
for v in $VARIANTS; do IFS=: read -r P DEFS <<< "$v"; LIBS="$LIBS $OUT/lib_p${P}${DEFS:+_${DEFS//[,=]/_}}.so"; done
for L in $LIBS; do
  [ -f "$L" ] || { echo "{\"lib\": \"$L\", \"error\": \"not built\"}" >> "$OUT/rows.jsonl"; continue; }
  K3GC_LIB=$L timeout 150 python3 - >> "$OUT/rows.jsonl" 2>> "$OUT/errors.txt" <<'PYEOF'
import hashlib, json, os
import torch
from k3ref.gpu_check import bench, lib
H, K, V = 96, 128, 128
params = bench.k3_params()
A_log, dt_bias = bench._k3_gate_inputs(H, K)
inputs = bench.k3_inputs(8192, H, K, V, 1000)
inputs.update(A_log=A_log, dt_bias=dt_bias, initial_state=torch.zeros(1, H, K, V, dtype=torch.float64, device="cuda"))
digest = {}
for precision in (2, 0):
    o, f = lib.kda_forward(inputs, params, precision=precision)
    digest[precision] = hashlib.sha256(o.cpu().numpy().tobytes() + f.cpu().numpy().tobytes()).hexdigest()[:16]
    del o, f
del inputs
r = bench.long_reference(250_000, 125_000)
print(json.dumps({"lib": os.environ["K3GC_LIB"], "sha256_8192_fast": digest[2], "sha256_8192_plain": digest[0],
                  "kernel_s_250k": r["kernel_seconds"], "per_1e6_tokens_s": 4 * r["kernel_seconds"]}))
PYEOF
done
python3 - "$OUT/rows.jsonl" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
for r in rows:
    same = "-" if "error" in r else ("equal" if r["sha256_8192_fast"] == r["sha256_8192_plain"] else "DIFFERENT")
    t = r.get("per_1e6_tokens_s")
    print(f"{r['lib']:48s} {('%.3f s per 10^6 tokens' % t) if t else r.get('error')}  bits {same}")
PYEOF
