#!/usr/bin/env bash
# Builds the CPU extension and the CUDA emulation (tests/emulated_cuda.py) with clang,
# AddressSanitizer and UndefinedBehaviorSanitizer in a scratch copy of the repository and runs
# the tests of the kernels (pytest -m "not workflows") against them, with the sanitizer runtime
# loaded into Python. Any out-of-bounds access or undefined behaviour in the C++ aborts the run.
# The one build serves three checks:
#   - the sanitizers;
#   - clang, beside the GCC builds elsewhere: the library must link no OpenMP runtime of its own
#     (the kernels run in ATen's parallel regions);
#   - AVX2 code on any CPU that has it, AVX-512 ones included, where the GCC build runs its
#     AVX-512 copies: clang compiles one copy of the kernels, here for x86-64-v3 (AVX2, FMA),
#     whose vectors are the 32 bytes of the AVX2 copies, and the script checks that they run.
#   bash tools/run_sanitized_tests.sh [pytest arguments]
# Needs Debian's clang and libclang-rt-14-dev, and the build and test dependencies of the current
# Python (requirements-dev.txt).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
. "$repo/tools/copy_tracked_files.sh"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
copy_tracked_files "$repo" "$scratch"

cd "$scratch"
export DEFORMCONV_SANITIZE=1 MAX_JOBS="${MAX_JOBS:-2}" CC=clang CXX=clang++
vector_bytes=16
if grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo; then
  # Python's compile flags, which torch's build helper passes on, take CFLAGS from here.
  export CFLAGS="-march=x86-64-v3"
  vector_bytes=32
fi
DEFORMCONV_WITH_CUDA=0 python setup.py build_ext --inplace > build.log 2>&1 \
  || { tail -40 build.log; exit 1; }
library=$(echo "$scratch"/deformconv/_C*.so)
if readelf -d "$library" | grep -E "NEEDED.*(omp|gomp)"; then
  echo "clang: $library links an OpenMP runtime of its own"
  exit 1
fi

# Python itself is not built with ASan: preload the runtime (clang's holds UBSan's too). Leak
# checking is off (the interpreter keeps memory until exit by design); UBSan findings abort with
# a stack trace.
export LD_PRELOAD="$(clang++ -print-file-name=libclang_rt.asan-x86_64.so)"
[ -f "$LD_PRELOAD" ] || { echo "no clang ASan runtime (Debian: libclang-rt-14-dev)"; exit 1; }
# The reports go to files, printed below if the run fails: pytest captures the output of a
# test at the level of file descriptors, and an abort would take a report written there with it.
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:allocator_may_return_null=1:log_path=$scratch/asan"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$scratch/ubsan"
# The CUDA launchers under emulation, sanitized as well, in an extension folder of this run's
# own. Built here, with the runtime preloaded: loading the library without it aborts.
export TORCH_EXTENSIONS_DIR="$scratch/torch_extensions"
python tests/emulated_cuda.py >> build.log 2>&1 || { tail -40 build.log; exit 1; }
# From the scratch copy, `python` and `python -m pytest` import the sanitized in-place build.
VECTOR_BYTES=$vector_bytes python - <<'PY'
import os
import sys
sys.path.insert(0, "tests")
import deformconv  # noqa: F401
from branching import vector_bytes
expected = int(os.environ["VECTOR_BYTES"])
assert vector_bytes() == expected, f"the sanitized build ran {vector_bytes()}-byte vectors"
print(f"run_sanitized_tests: clang's copy of the CPU kernels runs {expected}-byte vectors"
      + (" (x86-64-v3: AVX2, FMA)" if expected == 32 else ""))
PY
python -m pytest -q -p no:cacheprovider -m "not workflows" tests "$@" || {
  status=$?
  for report in "$scratch"/asan.* "$scratch"/ubsan.*; do
    [ -e "$report" ] && { echo "=== $report"; cat "$report"; }
  done
  exit "$status"
}
