#pragma once

// One spelling for every kernel launch of the project:
//
//   DEFORMCONV_LAUNCH(kernel, blocks, threads_per_block, current_cuda_stream())(arguments...);
//   DEFORMCONV_CHECK_LAUNCH();
//
// Under nvcc it is kernel<<<blocks, threads_per_block, 0, stream>>>(arguments...) on PyTorch's
// current stream, then a check of cudaGetLastError. The test
// suite compiles the same .cu files as C++ with DEFORMCONV_CUDA_EMULATION defined
// (tests/cuda_emulation), where it runs the kernel on the CPU, block by block and in each block
// thread by thread (threads meet at warp shuffles and barriers), after checking the launch
// against the CUDA runtime's limits: the launchers' indexing, shuffles, shared memory and
// bookkeeping are then tested without a GPU, with no rewriting of their text.

#include <cstdint>
#include <stdexcept>
#include <string>

#if defined(DEFORMCONV_CUDA_EMULATION)
#define DEFORMCONV_LAUNCH(kernel, blocks, threads_per_block, stream) \
  ::cuda_emulation::launch(kernel, blocks, threads_per_block, stream)
#define DEFORMCONV_CHECK_LAUNCH() ::deformconv::check_launch(::cuda_emulation::take_launch_error())
#else
#include <cuda_runtime.h>
// The C shim declares its CUDA functions where USE_CUDA is defined, which the builds define for
// the .cu sources, as PyTorch's own build does: every torch header that a source includes before
// this one has already read the shim.
#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#define DEFORMCONV_LAUNCH(kernel, blocks, threads_per_block, stream) \
  kernel<<<blocks, threads_per_block, 0, stream>>>
#define DEFORMCONV_CHECK_LAUNCH() ::deformconv::check_launch(cudaGetLastError())
#endif

#include <cstdint>

namespace deformconv {

// DEFORMCONV_CHECK_LAUNCH(), after every launch: throws std::runtime_error if the launch
// failed (an invalid configuration, or an error left by an earlier kernel).
#if defined(DEFORMCONV_CUDA_EMULATION)
using CudaStream = ::cuda_emulation::Stream;

inline void check_launch(const std::string& error) {
  if (!error.empty()) {
    throw std::runtime_error("CUDA error (emulated): " + error);
  }
}

inline CudaStream current_cuda_stream() {
  return CudaStream(::cuda_emulation::settings().current_stream);
}
#else
using CudaStream = cudaStream_t;

inline void check_launch(cudaError_t error) {
  if (error != cudaSuccess) {
    throw std::runtime_error(std::string("CUDA error: ") + cudaGetErrorString(error));
  }
}

// PyTorch's current stream on the current device (the device guard's), through the C shim of
// PyTorch's stable ABI.
inline CudaStream current_cuda_stream() {
  void* stream = nullptr;
  if (aoti_torch_get_current_cuda_stream(-1, &stream) != AOTI_TORCH_SUCCESS) {
    throw std::runtime_error("deformconv: could not get PyTorch's current CUDA stream");
  }
  return static_cast<CudaStream>(stream);
}
#endif

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
