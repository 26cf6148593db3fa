#!/usr/bin/env bash
# The compilers users build deformconv with, beyond the default one (README, Compatibility):
#   1. csrc/cpu/vector_shuffle.h's test (tests/cpp/test_vector_shuffle.cpp), built and run with
#      g++-11 (__builtin_shuffle), the default g++ and clang++ (__builtin_shufflevector);
#   2. 64-bit ARM: the sources of a CPU build but the Python module (csrc/cpu, csrc/core,
#      the schemas) cross-compiled with aarch64-linux-gnu-g++ and with clang for
#      aarch64-linux-gnu (compile only; the ARM vector code is what the compilers' vector
#      extensions make of it);
#   3. GCC 11: the whole extension, CUDA kernels included (nvcc with g++-11 as its host
#      compiler, one GPU architecture), then the DCN v1/v2 and DCNv3 branch tests on it;
#   4. clang: the extension with clang++ (CPU kernels: no OpenMP flags, no libomp), linked to
#      no OpenMP runtime of its own, then the whole test suite on it.
# Every build runs in a scratch copy of the tracked files, with no OpenMP flags anywhere.
#   bash tools/check_compilers.sh
# Needs Debian's g++-11, clang and g++-aarch64-linux-gnu, and the build and test dependencies
# of the current Python (requirements-dev.txt).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
. "$repo/tools/copy_tracked_files.sh"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
export MAX_JOBS="${MAX_JOBS:-2}"
seconds_since() { echo $(( $(date +%s) - $1 )); }

step_start=$(date +%s)
for cxx in g++-11 g++ clang++; do
  "$cxx" -std=c++17 -O2 -Wall -Wextra -Wno-psabi "$repo/tests/cpp/test_vector_shuffle.cpp" \
    -o "$scratch/test_vector_shuffle"
  echo -n "$cxx: "
  "$scratch/test_vector_shuffle"
done
echo "vector shuffles: $(seconds_since "$step_start") s"

# The torch headers are the same for every architecture but for the Python ones, which the CPU
# sources do not include.
step_start=$(date +%s)
includes=$(python -c 'from torch.utils import cpp_extension
print(" ".join("-I" + path for path in cpp_extension.include_paths()))')
export includes scratch
for compiler in "aarch64-linux-gnu-g++" "clang++ --target=aarch64-linux-gnu"; do
  # Two at a time; each object file apart, named after its source.
  printf '%s\0' "$repo"/csrc/cpu/*.cpp "$repo"/csrc/core/*.cpp "$repo/csrc/deformconv.cpp" \
      "$repo/tests/cpp/test_vector_shuffle.cpp" \
    | COMPILER="$compiler" xargs -0 -P "$MAX_JOBS" -I{} bash -c '
        # shellcheck disable=SC2086
        $COMPILER -std=c++20 -O2 -fPIC -fno-trapping-math -Wno-psabi $includes \
          -D_GLIBCXX_USE_CXX11_ABI=1 -c "$1" -o "$scratch/$(basename "$1").aarch64.o" \
          || { echo "aarch64 ($COMPILER): $1 does not compile"; exit 255; }' _ {}
  echo "aarch64 ($compiler): the CPU sources compile"
done
echo "aarch64 cross-compiles: $(seconds_since "$step_start") s"

# build_in NAME ENVIRONMENT...: a scratch copy of the tracked files, built in place.
build_in() {
  local name=$1
  shift
  mkdir -p "$scratch/$name"
  copy_tracked_files "$repo" "$scratch/$name"
  (cd "$scratch/$name" && env "$@" python setup.py build_ext --inplace > build.log 2>&1) \
    || { tail -40 "$scratch/$name/build.log"; exit 1; }
}

step_start=$(date +%s)
build_in gcc11 CC=gcc-11 CXX=g++-11 DEFORMCONV_WITH_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0
grep -rq --include=build.ninja -- "-ccbin gcc-11" "$scratch/gcc11/build" \
  || { echo "GCC 11: nvcc was not given gcc-11 as its host compiler"; exit 1; }
(cd "$scratch/gcc11" && TORCH_EXTENSIONS_DIR="$scratch/gcc11/torch_extensions" \
  python -m pytest -q -p no:cacheprovider tests/test_branches.py tests/test_dcnv3_branches.py)
echo "GCC 11 build (CUDA host compiler included) and branch tests: $(seconds_since "$step_start") s"

step_start=$(date +%s)
build_in clang CC=clang CXX=clang++ DEFORMCONV_WITH_CUDA=0
library=$(echo "$scratch"/clang/deformconv/_C*.so)
if readelf -d "$library" | grep -E "NEEDED.*(omp|gomp)"; then
  echo "clang: $library links an OpenMP runtime of its own"
  exit 1
fi
(cd "$scratch/clang" && TORCH_EXTENSIONS_DIR="$scratch/clang/torch_extensions" \
  python -m pytest -q -p no:cacheprovider tests -k "not two_to_the_31 and not distributed")
echo "clang build and tests: $(seconds_since "$step_start") s"
