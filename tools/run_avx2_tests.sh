#!/usr/bin/env bash
# On a CPU with AVX-512 the CPU kernels run their AVX-512 copies, never the AVX2 ones, whose
# code differs: vectors of 8 floats where AVX-512's hold 16, and the loops that only such widths
# reach. This builds the CPU extension with the AVX2 and baseline copies only
# (DEFORMCONV_CPU_CLONES=avx2) in a scratch copy of the repository, checks through the branch
# trace that the AVX2 copies run, and runs the CPU kernels' tests against that build. On a CPU
# without AVX-512 the regular test run has run the AVX2 copies already: it says so and exits 0.
#   bash tools/run_avx2_tests.sh [pytest arguments]
# Needs the build and test dependencies of the current Python (requirements-dev.txt).
set -euo pipefail
if ! grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
  echo "run_avx2_tests: no AVX-512 on this CPU: the regular test run ran the AVX2 copies"
  exit 0
fi
repo=$(cd "$(dirname "$0")/.." && pwd)
. "$repo/tools/copy_tracked_files.sh"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
copy_tracked_files "$repo" "$scratch"

cd "$scratch"
export MAX_JOBS="${MAX_JOBS:-2}"
DEFORMCONV_WITH_CUDA=0 DEFORMCONV_CPU_CLONES=avx2 python setup.py build_ext --inplace \
  > build.log 2>&1 || { tail -40 build.log; exit 1; }
# The emulated CUDA library that some of these tests load, built apart from the regular one.
export TORCH_EXTENSIONS_DIR="$scratch/torch_extensions"
# From the scratch copy, `python` and `python -m pytest` import the in-place build.
python - <<'PY'
import sys
sys.path.insert(0, "tests")
import deformconv  # noqa: F401
from branching import vector_bytes
assert vector_bytes() == 32, f"the AVX2 build ran {vector_bytes()}-byte vectors"
print("run_avx2_tests: the CPU kernels run their AVX2 copies (32-byte vectors)")
PY
python -m pytest -q -p no:cacheprovider tests/test_branches.py tests/test_dcnv3_branches.py \
  tests/test_deform_conv2d.py tests/test_dcnv3.py tests/test_dcnv4.py tests/test_oracles.py "$@"
