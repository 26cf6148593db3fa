#!/usr/bin/env bash
# The compilers users build deformconv with, beyond those of the builds that CI tests (GCC 12:
# the newcomer; GCC 11, nvcc's host compiler too: the wheel; clang: the sanitized build):
#   1. csrc/cpu/vector_shuffle.h's test (tests/cpp/test_vector_shuffle.cpp), built and run with
#      g++-11 (__builtin_shuffle), the default g++ and clang++ (__builtin_shufflevector);
#   2. 64-bit ARM: the op library's sources (csrc/sources.txt's library lines), cross-compiled
#      with aarch64-linux-gnu-g++ and with clang for aarch64-linux-gnu (compile only; the ARM
#      vector code is what the compilers' vector extensions make of it).
#   bash tools/check_compilers.sh
# Needs Debian's g++-11, clang and g++-aarch64-linux-gnu, and torch (requirements-dev.txt).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
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
flags=$(grep "^-" "$repo/csrc/compile_flags.txt" | tr '\n' ' ')
export includes flags scratch
for compiler in "aarch64-linux-gnu-g++" "clang++ --target=aarch64-linux-gnu"; do
  # Two at a time; each object file apart, named after its source.
  { awk '/^csrc\// && / library/ {print repo "/" $1}' repo="$repo" "$repo/csrc/sources.txt"
    echo "$repo/tests/cpp/test_vector_shuffle.cpp"; } | tr '\n' '\0' \
    | COMPILER="$compiler" xargs -0 -P "$MAX_JOBS" -I{} bash -c '
        # shellcheck disable=SC2086
        $COMPILER -std=c++20 -O2 -fPIC $flags $includes \
          -D_GLIBCXX_USE_CXX11_ABI=1 -c "$1" -o "$scratch/$(basename "$1").aarch64.o" \
          || { echo "aarch64 ($COMPILER): $1 does not compile"; exit 255; }' _ {}
  echo "aarch64 ($compiler): the CPU sources compile"
done
echo "aarch64 cross-compiles: $(seconds_since "$step_start") s"
