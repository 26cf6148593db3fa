#pragma once

// A CPU emulation of the little of CUDA that the project's launchers use, so that the real
// csrc/cuda/*.cu files, compiled as C++ with this header forced in first (-include) and the
// shims of include/ ahead of torch's headers, run their kernels on CPU tensors:
//   - __global__ and friends expand to nothing; blockIdx, threadIdx, blockDim and gridDim are
//     thread-local globals that launch() sets before it calls the kernel for each thread;
//   - launch() (what DEFORMCONV_LAUNCH expands to here) checks the launch against the CUDA
//     runtime's limits, records its bookkeeping, then runs every block and thread in turn, in
//     the order the settings ask for, on a grid that the settings may cap (grid-stride loops
//     must cover any remainder);
//   - an invalid launch leaves a pending error, as cudaGetLastError would, which the shim of
//     C10_CUDA_KERNEL_LAUNCH_CHECK raises.
// Running the threads one at a time makes a plain add in place of an atomic add correct; what
// emulation cannot see (timing, real concurrency, device atomics, shared memory, warp
// intrinsics) is left to a GPU.

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1)
      : x(x_), y(y_), z(z_) {}
};

inline thread_local dim3 blockIdx;
inline thread_local dim3 threadIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

namespace cuda_emulation {

// The CUDA runtime's limits (compute capability 7.5 and newer).
constexpr int64_t kMaxThreadsPerBlock = 1024;
constexpr int64_t kMaxBlockDim[3] = {1024, 1024, 64};
constexpr int64_t kMaxGridDim[3] = {(int64_t(1) << 31) - 1, 65535, 65535};

enum class Order : int64_t { kForward = 0, kReverse = 1, kShuffled = 2 };

struct Settings {
  Order block_order = Order::kForward;
  Order thread_order = Order::kForward;
  int64_t grid_cap = 0;  // 0: run the grid as launched; n: at most n blocks in x
  uint64_t seed = 0;     // of the shuffled orders
  int64_t current_stream = 0;
};

// What the launches did since the last reset: the test suite reads it after each op.
struct Bookkeeping {
  int64_t launches = 0;
  int64_t launch_checks = 0;
  int64_t launches_off_the_current_stream = 0;
  int64_t launches_outside_a_device_guard = 0;
  int64_t invalid_launches = 0;
  int64_t launches_not_checked = 0;  // a launch followed by another launch, not by its check
  std::string pending_error;
  bool check_due = false;
};

inline Settings& settings() {
  static Settings value;
  return value;
}

inline Bookkeeping& bookkeeping() {
  static Bookkeeping value;
  return value;
}

inline thread_local int device_guard_depth = 0;

// The shim of CUDAStream: an id, the current one being settings().current_stream.
class Stream {
 public:
  explicit Stream(int64_t id) : id_(id) {}
  int64_t id() const { return id_; }

 private:
  int64_t id_;
};

inline std::vector<int64_t> visiting_order(int64_t count, Order order, std::mt19937_64& random) {
  std::vector<int64_t> indices(static_cast<size_t>(count));
  std::iota(indices.begin(), indices.end(), int64_t(0));
  if (order == Order::kReverse) {
    std::reverse(indices.begin(), indices.end());
  } else if (order == Order::kShuffled) {
    std::shuffle(indices.begin(), indices.end(), random);
  }
  return indices;
}

inline dim3 as_dim3(const dim3& value) { return value; }

// A launch configuration given as an integer (as the launchers do) keeps its full value until
// it is checked: the runtime refuses 2^32 blocks rather than wrapping them.
template <typename Integer, typename = std::enable_if_t<std::is_integral_v<Integer>>>
int64_t x_extent(Integer value) {
  return static_cast<int64_t>(value);
}
inline int64_t x_extent(const dim3& value) { return value.x; }

template <typename Integer, typename = std::enable_if_t<std::is_integral_v<Integer>>>
dim3 as_dim3(Integer value) {
  return dim3(static_cast<unsigned int>(value));
}

inline std::string check_configuration(int64_t grid_x, const dim3& grid, int64_t block_x,
                                       const dim3& block) {
  const int64_t grid_sizes[3] = {grid_x, grid.y, grid.z};
  const int64_t block_sizes[3] = {block_x, block.y, block.z};
  for (int axis = 0; axis < 3; ++axis) {
    if (grid_sizes[axis] < 1 || grid_sizes[axis] > kMaxGridDim[axis] || block_sizes[axis] < 1 ||
        block_sizes[axis] > kMaxBlockDim[axis]) {
      return "invalid configuration argument";
    }
  }
  if (block_x * block.y * block.z > kMaxThreadsPerBlock) {
    return "invalid configuration argument";
  }
  return "";
}

template <typename... Parameters>
void run(void (*kernel)(Parameters...), const dim3& grid, const dim3& block,
         std::remove_cv_t<std::remove_reference_t<Parameters>>... arguments) {
  Settings& s = settings();
  std::mt19937_64 random(s.seed);
  const int64_t grid_x = s.grid_cap > 0 ? std::min<int64_t>(grid.x, s.grid_cap) : grid.x;
  gridDim = dim3(static_cast<unsigned int>(grid_x), grid.y, grid.z);
  blockDim = block;
  const int64_t blocks = grid_x * grid.y * grid.z;
  const int64_t threads = int64_t(block.x) * block.y * block.z;
  for (const int64_t b : visiting_order(blocks, s.block_order, random)) {
    blockIdx = dim3(static_cast<unsigned int>(b % grid_x),
                    static_cast<unsigned int>(b / grid_x % grid.y),
                    static_cast<unsigned int>(b / grid_x / grid.y));
    for (const int64_t t : visiting_order(threads, s.thread_order, random)) {
      threadIdx = dim3(static_cast<unsigned int>(t % block.x),
                       static_cast<unsigned int>(t / block.x % block.y),
                       static_cast<unsigned int>(t / block.x / block.y));
      kernel(arguments...);
    }
  }
}

// DEFORMCONV_LAUNCH(kernel, blocks, threads, stream)(arguments...) in an emulation build.
template <typename... Parameters, typename Grid, typename Block>
auto launch(void (*kernel)(Parameters...), Grid grid, Block block, const Stream& stream) {
  return [=](auto&&... arguments) {
    Bookkeeping& record = bookkeeping();
    if (record.check_due) {
      ++record.launches_not_checked;
    }
    ++record.launches;
    record.check_due = true;
    if (stream.id() != settings().current_stream) {
      ++record.launches_off_the_current_stream;
    }
    if (device_guard_depth == 0) {
      ++record.launches_outside_a_device_guard;
    }
    const std::string error =
        check_configuration(x_extent(grid), as_dim3(grid), x_extent(block), as_dim3(block));
    if (!error.empty()) {
      ++record.invalid_launches;
      record.pending_error = error;
      return;
    }
    run(kernel, as_dim3(grid), as_dim3(block), arguments...);
  };
}

// What C10_CUDA_KERNEL_LAUNCH_CHECK() does here: count the check, and return the pending error
// of the last launch (cleared, as cudaGetLastError clears it), empty if none.
inline std::string take_launch_error() {
  Bookkeeping& record = bookkeeping();
  ++record.launch_checks;
  record.check_due = false;
  std::string error;
  error.swap(record.pending_error);
  return error;
}

}  // namespace cuda_emulation
