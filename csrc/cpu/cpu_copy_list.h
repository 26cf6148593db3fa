#pragma once

// The copies of the CPU kernels that this compiler builds (Note [CPU copies], cpu_copies.h):
// DEFORMCONV_FOR_EACH_CPU_COPY(X, argument) calls X(namespace, name, argument) for each, best
// first. GCC 11 is the first that knows the x86-64-v3 and v4 levels; clang has no target pragma
// that sets the instruction set of a region of a file.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define DEFORMCONV_X86_CPU_COPIES
#define DEFORMCONV_FOR_EACH_CPU_COPY(X, argument) \
  X(cpu_avx512, "avx512", argument)               \
  X(cpu_avx2, "avx2", argument)                   \
  X(cpu_default, "default", argument)
#else
#define DEFORMCONV_FOR_EACH_CPU_COPY(X, argument) X(cpu_default, "default", argument)
#endif
