#!/usr/bin/env bash
# Everything a GPU machine is for, in one call: versions, the GPU figures (benchmarks/gpu.py) and the
# GPU-marked tests with the sync census. Results go to $OUT (else benchmarks/results); extra arguments go
# to gpu.py (e.g. --runs 1 --arms hand,trainer). torchrig runs from this checkout (src/), uninstalled.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  "$PY" -c "import torch, torchvision; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn',
torch.backends.cudnn.version(), 'torchvision', torchvision.__version__, torch.cuda.get_device_name(0))"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
"$PY" benchmarks/gpu.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu.log"
