#!/usr/bin/env bash
# One fixed-length session on a lent GPU: everything mpx measures on a real device, in order of
# value, each stage under its own time limit, so that a lease of BUDGET seconds ends with results.
#
#   BUDGET=480 OUT=/tmp/gpu bash benchmarks/gpu_lease.sh
#
# Uses the machine's own jax, flax, optax and chex (flax 0.12.8, this repository's floor, does
# not import under jax 0.11), and jmp from a wheel in .whl/ if there. Writes, under $OUT:
# versions.txt, gpu_lease.json and gpu_lease.md (the table for docs/benchmarks.md), one JSON per
# study, and fp8_speed.json.
set -u
BUDGET=${BUDGET:-480}
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

# The studies of gpu_lease.py, in order of value (GPT-2 and ResNet-50 beside Flax and jmp by hand,
# the launch cost, the Llama block in bf16 and float8), each with the roofline model's prediction.
log "gpu_lease.py ($(left) s left)"
timeout $(($(left) - 20)) python3 benchmarks/gpu_lease.py --budget $(($(left) - 90)) --out "$OUT"

log "fp8_speed ($(left) s left)"
timeout $(($(left) - 5)) python3 benchmarks/fp8_speed.py \
  --sizes 8192x8192 8192x4096 --repeats 20 --out "$OUT/fp8_speed.json"
log "done"
