// Note [CPU copies]
// The CPU kernels are compiled once per instruction set ("capability"), each copy in a
// namespace of its own, and cpu_capability.cpp chooses the copy that runs when the library
// loads: the best that the CPU runs, or the one DEFORMCONV_CPU_CAPABILITY names (avx512, avx2,
// default), as ATen's ATEN_CPU_CAPABILITY does for its kernels. With GCC on x86-64 there are
// three copies: AVX-512 (x86-64-v4), AVX2 (x86-64-v3) and the build's default target; other
// compilers and CPUs build the default copy alone, with what their compiler's vector
// extensions give (NEON on 64-bit ARM).
//
// A kernel file has a head, compiled once, and a body, compiled once per copy:
//
//   #if !defined(DEFORMCONV_CPU_COPY)
//   ... every #include the body needs ...
//   #define DEFORMCONV_CPU_COPY_BODY "this_file_cpu.cpp"
//   #include "cpu_copies.h"
//   #else
//   #include "this_file's_stages.h"   // declarations only, into the copy's namespace
//   namespace deformconv::DEFORMCONV_CPU_COPY { ... }
//   #endif
//
// This header includes the file again once per copy, with DEFORMCONV_CPU_COPY naming the
// copy's namespace and GCC's target pragma giving its instruction set. Everything the head
// includes is compiled for the default target, once: the inline functions and templates of
// torch, the standard library and the shared headers are the same code in every copy and in
// every file, as the one-definition rule wants, and none built for AVX-512 can stand in for
// another copy's. A helper of the body runs with the copy's instruction set only if it is
// inlined into it (DEFORMCONV_INLINE); lambdas written in the body are compiled for the copy.
// Hence the body includes no header but the declarations of its own stages, which include
// nothing (tests/test_sources.py checks both).
//
// Each copy's namespace holds kRegisterBytes, the width of its vector registers: 64 for
// AVX-512, 32 for the others (which the compiler splits for CPUs whose registers are
// narrower).

#if !defined(DEFORMCONV_CPU_COPY_BODY)
#error "cpu_copies.h: define DEFORMCONV_CPU_COPY_BODY, the file to compile once per copy"
#endif

#include "cpu_copy_list.h"

#if defined(DEFORMCONV_X86_CPU_COPIES)

#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4")
#define DEFORMCONV_CPU_COPY cpu_avx512
namespace deformconv::DEFORMCONV_CPU_COPY {
inline constexpr int kRegisterBytes = 64;
}
#include DEFORMCONV_CPU_COPY_BODY
#undef DEFORMCONV_CPU_COPY
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("arch=x86-64-v3")
#define DEFORMCONV_CPU_COPY cpu_avx2
namespace deformconv::DEFORMCONV_CPU_COPY {
inline constexpr int kRegisterBytes = 32;
}
#include DEFORMCONV_CPU_COPY_BODY
#undef DEFORMCONV_CPU_COPY
#pragma GCC pop_options

#endif

#define DEFORMCONV_CPU_COPY cpu_default
namespace deformconv::DEFORMCONV_CPU_COPY {
inline constexpr int kRegisterBytes = 32;
}
#include DEFORMCONV_CPU_COPY_BODY
#undef DEFORMCONV_CPU_COPY

#undef DEFORMCONV_CPU_COPY_BODY
