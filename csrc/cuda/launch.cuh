#pragma once

// One spelling for every kernel launch of the project:
//
//   DEFORMCONV_LAUNCH(kernel, blocks, threads_per_block, stream)(arguments...);
//
// Under nvcc it is kernel<<<blocks, threads_per_block, 0, stream>>>(arguments...). The test
// suite compiles the same .cu files as C++ with DEFORMCONV_CUDA_EMULATION defined
// (tests/cuda_emulation), where it runs the kernel on the CPU, block by block and in each block
// thread by thread (threads meet at warp shuffles and barriers), after checking the launch
// against the CUDA runtime's limits: the launchers' indexing, shuffles, shared memory and
// bookkeeping are then tested without a GPU, with no rewriting of their text.

#if defined(DEFORMCONV_CUDA_EMULATION)
#define DEFORMCONV_LAUNCH(kernel, blocks, threads_per_block, stream) \
  ::cuda_emulation::launch(kernel, blocks, threads_per_block, stream)
#else
#define DEFORMCONV_LAUNCH(kernel, blocks, threads_per_block, stream) \
  kernel<<<blocks, threads_per_block, 0, stream>>>
#endif

#include <cstdint>

namespace deformconv {

inline constexpr int kWarpSize = 32;
inline constexpr int kThreadsPerBlock = 256;  // a multiple of the warp
// The kernels' loops over their work stride by the grid, so the grid need not grow past this.
inline constexpr int64_t kMaxBlocks = 65536;

}  // namespace deformconv

// The largest dividend that a kernel's 32-bit divisions (InvariantDivisor) take; a launcher
// with a larger one takes the kernel's 64-bit build. The emulated tests lower it to run the
// 64-bit builds as well.
#ifndef DEFORMCONV_NARROW_INDEX_LIMIT
#define DEFORMCONV_NARROW_INDEX_LIMIT int64_t(INT32_MAX)
#endif
