// The CUDA kernels of the ops, run on the CPU: csrc/cuda/*.cu themselves, compiled
// as C++ in this translation unit, registered as each of them registers its kernels (Note
// [Device kernels]), with the driver beside it (see tests/emulated_cuda.py for the build). They are
// declared again as torch.ops.deformconv_emulated.* at the CPU key, with the CUDA launchers,
// whose window budget the tests may shrink; plus ops to set the emulator and read its
// bookkeeping and its branch trace (Note [Branch trace]).

#include <torch/csrc/stable/library.h>
#include <torch/library.h>

#define DEFORMCONV_NARROW_INDEX_LIMIT (::cuda_emulation::settings().narrow_index_limit)
#define DEFORMCONV_GATHER_MAP_BYTES (::cuda_emulation::settings().gather_map_bytes)
#include "../../csrc/core/dcnv3.h"
#include "../../csrc/core/deform_conv2d.h"
#include "../../csrc/core/ms_deform_attn.h"
#include "../../csrc/cuda/cuda_device.h"
#include "../../csrc/cuda/dcnv3_cuda.cu"
#include "../../csrc/cuda/deform_conv2d_cuda.cu"
#include "../../csrc/cuda/ms_deform_attn_cuda.cu"
#include "../../csrc/infrastructure/branch_trace.h"

namespace deformconv {
namespace {

// The CUDA launchers, with the window budget that `configure` sets (0: theirs).
DeformConv2dLaunchers& emulated_launchers() {
  static DeformConv2dLaunchers launchers = deform_conv2d_cuda_launchers();
  return launchers;
}

void configure(int64_t block_order, int64_t thread_order, int64_t grid_cap, int64_t seed,
               int64_t current_stream, int64_t columns_tile_bytes, bool wide_indices) {
  TORCH_CHECK(block_order >= 0 && block_order <= 2 && thread_order >= 0 && thread_order <= 2,
              "orders are 0 (forward), 1 (reverse) or 2 (shuffled)");
  cuda_emulation::Settings& s = cuda_emulation::settings();
  s.block_order = static_cast<cuda_emulation::Order>(block_order);
  s.thread_order = static_cast<cuda_emulation::Order>(thread_order);
  s.grid_cap = grid_cap;
  s.seed = static_cast<uint64_t>(seed);
  s.current_stream = current_stream;
  s.narrow_index_limit = wide_indices ? -1 : INT32_MAX;
  s.gather_map_bytes = cuda_emulation::Settings().gather_map_bytes;
  emulated_launchers().columns_tile_bytes =
      columns_tile_bytes > 0 ? columns_tile_bytes
                             : deform_conv2d_cuda_launchers().columns_tile_bytes;
}

// DEFORMCONV_NARROW_INDEX_LIMIT of the launchers, until the next configure().
void set_narrow_index_limit(int64_t limit) { cuda_emulation::settings().narrow_index_limit = limit; }

// DEFORMCONV_GATHER_MAP_BYTES of the launchers, until the next configure().
void set_gather_map_bytes(int64_t bytes) { cuda_emulation::settings().gather_map_bytes = bytes; }

// [launches, launch checks, launches off the current stream, launches outside a device guard,
// invalid launches, launches not followed by their check], then cleared.
std::vector<int64_t> take_bookkeeping() {
  cuda_emulation::Bookkeeping& record = cuda_emulation::bookkeeping();
  std::vector<int64_t> counts = {record.launches,
                                 record.launch_checks,
                                 record.launches_off_the_current_stream,
                                 record.launches_outside_a_device_guard,
                                 record.invalid_launches,
                                 record.launches_not_checked + (record.check_due ? 1 : 0)};
  record = cuda_emulation::Bookkeeping();
  return counts;
}

__global__ void count_threads_kernel(int64_t* count) { ++*count; }

// A launch of `blocks` x `threads_per_block` threads, checked as the launchers check theirs:
// how many threads ran, or the launch error. For the tests of the emulator's limits.
int64_t probe_launch(int64_t blocks, int64_t threads_per_block) {
  int64_t count = 0;
  DEFORMCONV_LAUNCH(count_threads_kernel, blocks, threads_per_block,
                    deformconv::current_cuda_stream())(&count);
  DEFORMCONV_CHECK_LAUNCH();
  return count;
}

__global__ void shuffle_xor_kernel(int64_t* received, unsigned member_mask, int lane_mask,
                                   int width, int64_t exiting_thread) {
  const int64_t thread = threadIdx.x;
  if (thread == exiting_thread || (member_mask >> (thread % 32) & 1u) == 0) {
    return;
  }
  received[thread] = __shfl_xor_sync(member_mask, thread, lane_mask, width);
}

// One block of `threads` threads, each but `exiting_thread` and those outside `member_mask`
// offering its index to __shfl_xor_sync: what each received (-1: took no part), or the launch
// error. For the tests of the emulator's warps.
std::vector<int64_t> probe_shuffle_xor(int64_t threads, int64_t member_mask, int64_t lane_mask,
                                       int64_t width, int64_t exiting_thread) {
  std::vector<int64_t> received(static_cast<size_t>(threads), -1);
  DEFORMCONV_LAUNCH(shuffle_xor_kernel, 1, threads, deformconv::current_cuda_stream())(
      received.data(), static_cast<unsigned>(member_mask), static_cast<int>(lane_mask),
      static_cast<int>(width), exiting_thread);
  DEFORMCONV_CHECK_LAUNCH();
  return received;
}

__global__ void barrier_kernel(int64_t* received, int64_t exiting_thread) {
  constexpr int kMostThreads = 1024;
  __shared__ int64_t offered[kMostThreads];
  const int64_t thread = threadIdx.x;
  if (thread == exiting_thread) {
    return;
  }
  offered[thread] = 10 * thread;
  __syncthreads();
  received[thread] = offered[(thread + 1) % blockDim.x];
  // What a next launch finds before its threads write: a read the barrier did not hold back
  // sees -1.
  __syncthreads();
  offered[thread] = -1;
}

// One block of `threads` threads, each but `exiting_thread` offering 10 times its index in
// shared memory and, past a barrier, reading its right neighbour's (-1: took no part), or the
// launch error. For the tests of the emulator's barriers and shared memory.
std::vector<int64_t> probe_barrier(int64_t threads, int64_t exiting_thread) {
  std::vector<int64_t> received(static_cast<size_t>(threads), -1);
  DEFORMCONV_LAUNCH(barrier_kernel, 1, threads, deformconv::current_cuda_stream())(
      received.data(), exiting_thread);
  DEFORMCONV_CHECK_LAUNCH();
  return received;
}

__global__ void warp_barrier_kernel(int64_t* received, int64_t exiting_thread,
                                    int64_t shuffling_thread) {
  constexpr int kMostThreads = 1024;
  __shared__ int64_t offered[kMostThreads];
  const int64_t thread = threadIdx.x;
  if (thread == exiting_thread) {
    return;
  }
  const int64_t warp_start = thread / 32 * 32;
  offered[thread] = 10 * thread;
  if (thread == shuffling_thread) {
    __shfl_xor_sync(0xffffffffu, thread, 0);
  } else {
    __syncwarp();
  }
  received[thread] = offered[warp_start + (thread + 1) % 32];
  __syncwarp();
  offered[thread] = -1;
}

// One block of `threads` threads (whole warps), each but `exiting_thread` offering 10 times its
// index in shared memory and, past a __syncwarp (a shuffle in `shuffling_thread`), reading that
// of the next lane of its warp (-1: took no part), or the launch error. For the tests of the
// emulator's warp barriers.
std::vector<int64_t> probe_warp_barrier(int64_t threads, int64_t exiting_thread,
                                        int64_t shuffling_thread) {
  std::vector<int64_t> received(static_cast<size_t>(threads), -1);
  DEFORMCONV_LAUNCH(warp_barrier_kernel, 1, threads, deformconv::current_cuda_stream())(
      received.data(), exiting_thread, shuffling_thread);
  DEFORMCONV_CHECK_LAUNCH();
  return received;
}

}  // namespace

TORCH_LIBRARY(deformconv_emulated, m) {
  m.def(DeformConv2dOp::kSchema);
  m.def(DeformConv2dOp::kBackwardSchema);
  m.def(Dcnv3Op::kSchema);
  m.def(Dcnv3Op::kBackwardSchema);
  m.def(Dcnv4Op::kSchema);
  m.def(Dcnv4Op::kBackwardSchema);
  m.def(MsDeformAttnOp::kSchema);
  m.def(MsDeformAttnOp::kBackwardSchema);
  m.def("configure(int block_order, int thread_order, int grid_cap, int seed, "
        "int current_stream, int columns_tile_bytes, bool wide_indices) -> ()");
  m.def("take_bookkeeping() -> int[]");
  m.def(kStartBranchTraceSchema);
  m.def(kTakeBranchTraceSchema);
  m.def("probe_launch(int blocks, int threads_per_block) -> int");
  m.def("probe_shuffle_xor(int threads, int member_mask, int lane_mask, int width, "
        "int exiting_thread) -> int[]");
  m.def("probe_barrier(int threads, int exiting_thread) -> int[]");
  m.def("set_narrow_index_limit(int limit) -> ()");
  m.def("set_gather_map_bytes(int bytes) -> ()");
  m.def("probe_warp_barrier(int threads, int exiting_thread, int shuffling_thread) -> int[]");
}

STABLE_TORCH_LIBRARY_IMPL(deformconv_emulated, CPU, m) {
  register_device_kernels<DeformConv2dOp, CudaDevice, deform_conv2d_forward,
                          deform_conv2d_backward, emulated_launchers>(m);
  register_device_kernels<Dcnv3Op, CudaDevice, dcnv3_forward, dcnv3_backward,
                          dcnv3_cuda_launchers>(m);
  register_device_kernels<Dcnv4Op, CudaDevice, dcnv4_forward, dcnv4_backward,
                          dcnv3_cuda_launchers>(m);
  register_device_kernels<MsDeformAttnOp, CudaDevice, ms_deform_attn_forward,
                          ms_deform_attn_backward, ms_deform_attn_cuda_launchers>(m);
}

TORCH_LIBRARY_IMPL(deformconv_emulated, CompositeExplicitAutograd, m) {
  m.impl("configure", TORCH_FN(configure));
  m.impl("take_bookkeeping", TORCH_FN(take_bookkeeping));
  m.impl("_start_branch_trace", TORCH_FN(start_branch_trace));
  m.impl("_take_branch_trace", TORCH_FN(take_branch_trace));
  m.impl("probe_launch", TORCH_FN(probe_launch));
  m.impl("probe_shuffle_xor", TORCH_FN(probe_shuffle_xor));
  m.impl("probe_barrier", TORCH_FN(probe_barrier));
  m.impl("probe_warp_barrier", TORCH_FN(probe_warp_barrier));
  m.impl("set_narrow_index_limit", TORCH_FN(set_narrow_index_limit));
  m.impl("set_gather_map_bytes", TORCH_FN(set_gather_map_bytes));
}

}  // namespace deformconv
