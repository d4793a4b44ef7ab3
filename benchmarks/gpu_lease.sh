#!/usr/bin/env bash
# One fixed-length session on a lent GPU: everything mpx measures on a real device, in order of
# value, each stage under its own time limit, so that a lease of BUDGET seconds ends with results.
#
#   BUDGET=540 OUT=/tmp/gpu bash benchmarks/gpu_lease.sh
#
# Uses the machine's own jax, flax, optax and chex (flax 0.12.8, this repository's floor, does
# not import under jax 0.11), and jmp from a wheel in .whl/ if there. Writes, under $OUT:
# versions.txt, fp8_speed.json, run_gpt2.json and run_resnet50.json.
set -u
BUDGET=${BUDGET:-540}
OUT=${OUT:?set OUT to a folder for the results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
start=$SECONDS
left() { echo $((BUDGET - (SECONDS - start))); }
log() { echo "[$((SECONDS - start)) s] $*"; }

if [ -d .whl ]; then  # jmp (run.py's reference), absent from the GPU image
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-jmp \
    .whl/jmp-*.whl
fi
export PYTHONPATH=$PWD:/tmp/site-jmp

versions() {
  python3 - <<'EOF'
import importlib.metadata as md, jax
for name in ("jax", "jaxlib", "flax", "optax", "chex", "jmp", "numpy", "ml_dtypes"):
  try:
    print(name, md.version(name))
  except md.PackageNotFoundError:
    print(name, "missing")
import flax, optax, chex
print("flax from", flax.__file__)
print("devices", jax.devices(), [d.device_kind for d in jax.devices()])
import mpx
print("mpx", mpx.__version__)
EOF
}
{ nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total \
  --format=csv; } >"$OUT/versions.txt" 2>&1
versions >>"$OUT/versions.txt" 2>&1 || { cat "$OUT/versions.txt"; exit 3; }
cat "$OUT/versions.txt"

# GPT-2 first: its workers compile for longest (an H200 worker passed 150 s on 2026-11-26).
log "run.py GPT-2 ($(left) s left)"
timeout $(($(left) - 20)) python3 benchmarks/run.py --models gpt2_linen --steps 30 --timeout 400 \
  --configs mpx_bf16 bf16_flax mpx_f16 jmp_f16 f32 mpx_fp8 mpx_bf16_flax_norms \
  --deadline $(($(left) / 2 - 40)) --out "$OUT/run_gpt2.json"

log "run.py ResNet-50 ($(left) s left)"
timeout $(($(left) - 10)) python3 benchmarks/run.py --models resnet50 --steps 30 --timeout 150 \
  --configs mpx_bf16_flax_norms mpx_bf16 bf16_flax mpx_fp8 mpx_f16 jmp_f16 f32 mpx_f16_masters \
  --deadline $(($(left) - 200)) --out "$OUT/run_resnet50.json"

log "fp8_speed ($(left) s left)"
timeout $(($(left) - 5)) python3 benchmarks/fp8_speed.py \
  --sizes 8192x8192 8192x4096 --repeats 20 --out "$OUT/fp8_speed.json"
log "done"
