// Which copies of the CPU kernels this build holds (cpu_loops.h, DEFORMCONV_VECTOR_CLONES), as
// the compiler saw it: what `python -m deformconv info` and the benchmark report, rather than
// what the build asked for.

#include <torch/library.h>

#include <string>

#include "cpu_loops.h"

namespace deformconv {
namespace {

std::string cpu_kernel_copies() {
#if defined(DEFORMCONV_AVX512_CLONES)
  return "avx512 avx2 baseline";
#elif defined(DEFORMCONV_AVX2_CLONES)
  return "avx2 baseline";
#else
  return "default target";
#endif
}

}  // namespace

TORCH_LIBRARY_IMPL(deformconv, CompositeExplicitAutograd, m) {
  m.impl("_cpu_kernel_copies", TORCH_FN(cpu_kernel_copies));
}

}  // namespace deformconv
