#!/usr/bin/env bash
# Builds the CPU extension and the CUDA emulation (tests/emulated_cuda.py) with AddressSanitizer
# and UndefinedBehaviorSanitizer in a scratch copy of the repository and runs the CPU test suite
# against them, with the sanitizer runtime loaded into Python. Any out-of-bounds access or
# undefined behaviour in the C++ aborts the run.
#   bash tools/run_sanitized_tests.sh [pytest arguments]
# Needs the build and test dependencies of the current Python (requirements-dev.txt).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
. "$repo/tools/copy_tracked_files.sh"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
copy_tracked_files "$repo" "$scratch"

cd "$scratch"
export DEFORMCONV_SANITIZE=1 MAX_JOBS="${MAX_JOBS:-2}"
DEFORMCONV_WITH_CUDA=0 python setup.py build_ext --inplace > build.log 2>&1 \
  || { tail -40 build.log; exit 1; }

# Python itself is not built with ASan: preload the runtime. Leak checking is off (the
# interpreter keeps memory until exit by design); UBSan findings abort with a stack trace.
export LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
# The reports go to files, printed below if the run fails: pytest captures the output of a
# test at the level of file descriptors, and an abort would take a report written there with it.
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:allocator_may_return_null=1:log_path=$scratch/asan"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$scratch/ubsan"
# The CUDA launchers under emulation (tests/test_cuda_emulation.py), sanitized as well. Built
# here, with the runtime preloaded: loading the library without it aborts.
python tests/emulated_cuda.py >> build.log 2>&1 || { tail -40 build.log; exit 1; }
# From the scratch copy, `python -m pytest` imports the sanitized in-place build.
python -m pytest -q -p no:cacheprovider tests "$@" || {
  status=$?
  for report in "$scratch"/asan.* "$scratch"/ubsan.*; do
    [ -e "$report" ] && { echo "=== $report"; cat "$report"; }
  done
  exit "$status"
}
