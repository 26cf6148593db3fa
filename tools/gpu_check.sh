#!/usr/bin/env bash
# For the first machine with a GPU: the whole test suite (the CUDA tests run there instead of
# skipping) and the CUDA benchmark in float32, float16 and bfloat16, written as JSON and PNG into
# one folder. Without a GPU it says so and exits 0, having measured nothing.
#   bash tools/gpu_check.sh [output folder, default gpu-check]
# Run from the repository root, with deformconv built with its CUDA kernels and the test
# dependencies installed (README, Quick start).
set -euo pipefail
out=${1:-gpu-check}
if ! python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: no CUDA device visible: nothing measured"
  exit 0
fi
if ! python -c 'import sys, deformconv; sys.exit(0 if deformconv.cuda_compiled() else 1)'; then
  echo "gpu_check: deformconv was built without its CUDA kernels; python -m deformconv info:"
  python -m deformconv info
  exit 1
fi
mkdir -p "$out"
python -m deformconv info | tee "$out/info.txt"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
python -m pytest -q tests 2>&1 | tee "$out/tests.txt"
for dtype in float32 float16 bfloat16; do
  python -m deformconv benchmark --device cuda --dtype "$dtype" \
    --output "$out/benchmark-cuda-$dtype.json" --plot "$out/benchmark-cuda-$dtype.png" \
    | tee "$out/benchmark-cuda-$dtype.txt"
done
echo "gpu_check: results in $out/"
