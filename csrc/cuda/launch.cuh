#pragma once

// One spelling for every kernel launch of the project:
//
//   DEFORMCONV_LAUNCH(kernel, blocks, threads_per_block, stream)(arguments...);
//
// Under nvcc it is kernel<<<blocks, threads_per_block, 0, stream>>>(arguments...). The test
// suite compiles the same .cu files as C++ with DEFORMCONV_CUDA_EMULATION defined
// (tests/cuda_emulation), where it runs the kernel on the CPU, block by block and in each warp
// lane by lane (lanes meet at warp shuffles), after checking the launch against the CUDA
// runtime's limits: the launchers' indexing, shuffles and bookkeeping are then tested without a
// GPU, with no rewriting of their text.

#if defined(DEFORMCONV_CUDA_EMULATION)
#define DEFORMCONV_LAUNCH(kernel, blocks, threads_per_block, stream) \
  ::cuda_emulation::launch(kernel, blocks, threads_per_block, stream)
#else
#define DEFORMCONV_LAUNCH(kernel, blocks, threads_per_block, stream) \
  kernel<<<blocks, threads_per_block, 0, stream>>>
#endif
