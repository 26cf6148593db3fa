#pragma once

// Note [Parallel regions through ATen]
// at::parallel_for is a template in ATen's headers: compiled into this library, its body is an
// OpenMP region only if this library is compiled with the OpenMP flags of torch's own build
// (and otherwise runs on one thread, silently). Those flags differ by compiler and platform
// (GCC's -fopenmp and libgomp; clang needs LLVM's libomp, which would then sit beside torch's
// libgomp; Apple clang has none), and torch's build helpers pass none. So this library compiles
// without them, and enters a parallel region that ATen itself compiled:
// TensorIteratorBase::for_each over one element per thread, which runs at::parallel_for inside
// libtorch, with torch's threads and thread count (torch.set_num_threads), whatever its
// backend. Nested inside a parallel region, or with one thread, the body runs once, inline.

#include <c10/util/FunctionRef.h>

namespace deformconv {

// Runs body() on each of at::get_num_threads() threads at once (on the calling thread alone
// where ATen would not start a region), and returns when every call has returned. The body
// typically takes work from a shared counter until none is left, so that how many threads
// run it does not change what is computed.
void run_on_every_thread(c10::function_ref<void()> body);

}  // namespace deformconv
