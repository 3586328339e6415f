#!/usr/bin/env bash
# Launch variants of the fp64 reference's plain kernel (precision 0), timed and checked bit for
# bit against the tree's own build: the same kda.cu with one launch parameter changed, so each
# element keeps its IEEE operations and their order (the slices per column, SL = 16, fix the
# summation tree; the columns per block, the tile of tokens and the register budget do not).
#   b3    3 blocks of 512 threads per SM (ptxas: 40 registers, 272 B spilled) where the tree's
#         build has 2 (62 registers): K3's 196,608 threads in one wave of 132 SMs, not 1.45
#   c16   16 columns per block, 6 blocks of 256 threads per SM: the same one wave, in smaller
#         blocks (each stages its own tile, so twice the gate's exps of b3)
# (A tile of 16 tokens needs 64 KB of shared memory, past the 48 KB a static array may take.)
# Each: sha256 of o and the final state on 8,192 tokens x 96 heads (K3's options; equal to the
# tree's build or the variant is wrong), and the kernel time over 250,000 tokens (x 4: 10^6).
#
#   gpu_check/device_fp64_variants.sh [OUT_DIR]
#   env: LIB (the tree's libk3gc.so, default build/gpu_check/libk3gc.so), K3REF_CORE_PATH as
#        the other device scripts, NVCC (default nvcc)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.cache_k3ref/fp64_variants}
LIB=${LIB:-build/gpu_check/libk3gc.so}
mkdir -p "$OUT"
S=gpu_check/src
variant() {  # $1 name, $2 sed expression on kda.cu
  sed "$2" $S/kda.cu > "$OUT/kda_$1.cu"
  if cmp -s $S/kda.cu "$OUT/kda_$1.cu"; then echo "$1: the expression changed nothing" > "$OUT/build_$1.txt"; return 1; fi
  ${NVCC:-nvcc} -O3 -std=c++17 --fmad=false -shared -Xcompiler -fPIC -gencode=arch=compute_90,code=sm_90 \
    -Igpu_check/include -I$S -Xptxas -v -o "$OUT/lib_$1.so" $S/errors.cu $S/compare.cu "$OUT/kda_$1.cu" \
    > "$OUT/build_$1.txt" 2>&1
  echo "nvcc rc $?" >> "$OUT/build_$1.txt"
}
ONE_WAVE='s/(SL \* CB >= 1024 ? 1 : 2))/(1536 \/ (SL * CB)))/'   # blocks per SM: 1536 threads
COLUMNS16='s/launch<double, 8, 16, 32, 0>(a, n_seq, s)/launch<double, 8, 16, 16, 0>(a, n_seq, s)/'
variant b3 "$ONE_WAVE" & variant c16 "$ONE_WAVE; $COLUMNS16" & wait
export PYTHONPATH=$PWD/python:${PYTHONPATH:-}
for L in "$LIB" "$OUT/lib_b3.so" "$OUT/lib_c16.so"; do
  [ -f "$L" ] || { echo "{\"lib\": \"$L\", \"error\": \"not built\"}" >> "$OUT/rows.jsonl"; continue; }
  K3GC_LIB=$L timeout 120 python3 - >> "$OUT/rows.jsonl" 2>> "$OUT/errors.txt" <<'PYEOF'
import hashlib, json, os
import torch
from k3ref.gpu_check import bench, lib
H, K, V = 96, 128, 128
params = bench.k3_params()
A_log, dt_bias = bench._k3_gate_inputs(H, K)
inputs = bench.k3_inputs(8192, H, K, V, 1000)
inputs.update(A_log=A_log, dt_bias=dt_bias, initial_state=torch.zeros(1, H, K, V, dtype=torch.float64, device="cuda"))
o, f = lib.kda_forward(inputs, params, precision=0)
digest = hashlib.sha256(o.cpu().numpy().tobytes() + f.cpu().numpy().tobytes()).hexdigest()[:16]
del o, f, inputs
r = bench.long_reference(250_000, 125_000)
print(json.dumps({"lib": os.environ["K3GC_LIB"], "sha256_8192": digest, "kernel_s_250k": r["kernel_seconds"],
                  "per_1e6_tokens_s": 4 * r["kernel_seconds"]}))
PYEOF
done
python3 - "$OUT/rows.jsonl" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
base = rows[0].get("sha256_8192") if rows else None
for r in rows:
    same = "-" if "error" in r else ("equal" if r["sha256_8192"] == base else "DIFFERENT")
    t = r.get("per_1e6_tokens_s")
    print(f"{r['lib']:48s} {('%.2f s per 10^6 tokens' % t) if t else r.get('error')}  bits {same}")
PYEOF
