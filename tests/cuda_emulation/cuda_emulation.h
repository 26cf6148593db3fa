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
//     C10_CUDA_KERNEL_LAUNCH_CHECK raises;
//   - the lanes of a warp run as coroutines (ucontext) that meet at each __shfl_xor_sync, where
//     the values are exchanged once every lane named in the mask has arrived; a lane that
//     names an exited lane, or reads from a lane outside the mask, fails the launch, as it
//     would hang or read garbage on a GPU.
// Running the threads one at a time makes a plain add in place of an atomic add correct; what
// emulation cannot see (timing, real concurrency, device atomics, shared memory) is left to a
// GPU.

#include <ucontext.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#endif

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
  // DEFORMCONV_NARROW_INDEX_LIMIT of the launchers: below the sizes of a launch, it takes the
  // 64-bit index arithmetic.
  int64_t narrow_index_limit = INT32_MAX;
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

// AddressSanitizer must be told of every switch between stacks, or it takes the lanes' stacks
// for overflows of the scheduler's.
#if defined(__SANITIZE_ADDRESS__)
inline void before_stack_switch(void** fake_stack, const void* bottom, size_t size) {
  __sanitizer_start_switch_fiber(fake_stack, bottom, size);
}
inline void after_stack_switch(void* fake_stack, const void** old_bottom, size_t* old_size) {
  __sanitizer_finish_switch_fiber(fake_stack, old_bottom, old_size);
}
#else
inline void before_stack_switch(void**, const void*, size_t) {}
inline void after_stack_switch(void*, const void**, size_t*) {}
#endif

constexpr int kWarpSize = 32;

// One warp of a launch: its lanes run as coroutines, each until it exits or reaches a shuffle,
// and the shuffles are resolved when no lane can go further.
class Warp {
 public:
  // Runs `body` once per lane, lane l with threadIdx `thread_indices[l]`, visiting the lanes in
  // `order` at each step. Returns the error that makes the warp invalid, empty if none.
  std::string run(const std::vector<dim3>& thread_indices, const std::vector<int64_t>& order,
                  const std::function<void()>& body) {
    lane_count_ = static_cast<int>(thread_indices.size());
    body_ = &body;
    error_.clear();
    for (int l = 0; l < lane_count_; ++l) {
      Lane& lane = lanes_[l];
      lane.thread_index = thread_indices[l];
      lane.state = State::kRunning;
      if (!lane.stack) {
        lane.stack.reset(new char[kStackBytes]);
      }
      getcontext(&lane.context);
      lane.context.uc_stack.ss_sp = lane.stack.get();
      lane.context.uc_stack.ss_size = kStackBytes;
      lane.context.uc_link = nullptr;
      makecontext(&lane.context, &Warp::lane_entry, 0);
    }
    Warp* const outer = current_warp();
    current_warp() = this;
    while (error_.empty()) {
      for (const int64_t l : order) {
        if (lanes_[l].state == State::kRunning) {
          resume(static_cast<int>(l));
        }
        if (!error_.empty()) {
          break;
        }
      }
      if (!error_.empty() || !resolve_shuffles()) {
        break;
      }
    }
    current_warp() = outer;
    return error_;
  }

  // What __shfl_xor_sync does in a lane of this warp.
  template <typename T>
  T shuffle_xor(unsigned member_mask, T value, int lane_mask, int width) {
    static_assert(sizeof(T) <= sizeof(uint64_t) && std::is_trivially_copyable_v<T>);
    Lane& lane = lanes_[running_];
    lane.state = State::kAtShuffle;
    lane.member_mask = member_mask;
    lane.lane_mask = lane_mask;
    lane.width = width;
    lane.value = 0;
    std::memcpy(&lane.value, &value, sizeof(T));
    yield_to_scheduler();
    T result;
    std::memcpy(&result, &lanes_[running_].value, sizeof(T));
    return result;
  }

  // One per thread, its lanes' stacks kept from launch to launch.
  static Warp& of_this_thread() {
    static thread_local Warp warp;
    return warp;
  }

  // The warp whose lane is running on this thread, null outside a warp's run.
  static Warp*& current_warp() {
    static thread_local Warp* warp = nullptr;
    return warp;
  }

 private:
  enum class State { kRunning, kAtShuffle, kExited };
  static constexpr size_t kStackBytes = size_t(1) << 18;

  struct Lane {
    ucontext_t context;
    std::unique_ptr<char[]> stack;
    dim3 thread_index;
    State state = State::kExited;
    unsigned member_mask = 0;
    int lane_mask = 0;
    int width = kWarpSize;
    uint64_t value = 0;  // the value offered at a shuffle, then the value received
  };

  static void lane_entry() {
    Warp& warp = *current_warp();
    after_stack_switch(nullptr, &warp.scheduler_stack_bottom_, &warp.scheduler_stack_size_);
    try {
      (*warp.body_)();
    } catch (const std::exception& e) {
      warp.error_ = std::string("exception in a lane: ") + e.what();
    }
    warp.lanes_[warp.running_].state = State::kExited;
    // Leaving this stack for good: no fake stack to keep.
    before_stack_switch(nullptr, warp.scheduler_stack_bottom_, warp.scheduler_stack_size_);
    setcontext(&warp.scheduler_);
  }

  void resume(int l) {
    running_ = l;
    threadIdx = lanes_[l].thread_index;
    void* fake_stack = nullptr;
    before_stack_switch(&fake_stack, lanes_[l].stack.get(), kStackBytes);
    swapcontext(&scheduler_, &lanes_[l].context);
    after_stack_switch(fake_stack, nullptr, nullptr);
  }

  void yield_to_scheduler() {
    Lane& lane = lanes_[running_];
    void* fake_stack = nullptr;
    before_stack_switch(&fake_stack, scheduler_stack_bottom_, scheduler_stack_size_);
    swapcontext(&lane.context, &scheduler_);
    after_stack_switch(fake_stack, &scheduler_stack_bottom_, &scheduler_stack_size_);
  }

  // Every lane has exited or waits at a shuffle: exchanges the values of the waiting lanes.
  // False when none waits (the warp is done) or the shuffles are invalid (error_ says why).
  bool resolve_shuffles() {
    bool any_waiting = false;
    uint64_t received[kWarpSize];
    for (int l = 0; l < lane_count_; ++l) {
      const Lane& lane = lanes_[l];
      if (lane.state != State::kAtShuffle) {
        continue;
      }
      any_waiting = true;
      if ((lane.member_mask >> l & 1u) == 0) {
        return fail("__shfl_xor_sync: lane " + std::to_string(l) + " is not in its own mask");
      }
      for (int other = 0; other < kWarpSize; ++other) {
        if ((lane.member_mask >> other & 1u) == 0) {
          continue;
        }
        if (other >= lane_count_ || lanes_[other].state != State::kAtShuffle ||
            lanes_[other].member_mask != lane.member_mask) {
          return fail("__shfl_xor_sync: lane " + std::to_string(l) + " waits for lane " +
                      std::to_string(other) + ", which has exited or waits at another shuffle");
        }
      }
      // A source past the lane's own group of `width` lanes gives the lane its own value.
      const int source = l ^ lane.lane_mask;
      const bool in_group = source < (l / lane.width + 1) * lane.width;
      if (in_group && (lane.member_mask >> source & 1u) == 0) {
        return fail("__shfl_xor_sync: lane " + std::to_string(l) + " reads lane " +
                    std::to_string(source) + ", outside the mask");
      }
      received[l] = in_group ? lanes_[source].value : lane.value;
    }
    for (int l = 0; l < lane_count_; ++l) {
      if (lanes_[l].state == State::kAtShuffle) {
        lanes_[l].value = received[l];
        lanes_[l].state = State::kRunning;
      }
    }
    return any_waiting;
  }

  bool fail(std::string message) {
    error_ = std::move(message);
    return false;
  }

  Lane lanes_[kWarpSize];
  int lane_count_ = 0;
  int running_ = 0;
  const std::function<void()>* body_ = nullptr;
  ucontext_t scheduler_;
  const void* scheduler_stack_bottom_ = nullptr;
  size_t scheduler_stack_size_ = 0;
  std::string error_;
};

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

// Runs every block of the launch, and in each block every warp, lane by lane (Warp).
template <typename... Parameters>
std::string run(void (*kernel)(Parameters...), const dim3& grid, const dim3& block,
                std::remove_cv_t<std::remove_reference_t<Parameters>>... arguments) {
  Settings& s = settings();
  std::mt19937_64 random(s.seed);
  const int64_t grid_x = s.grid_cap > 0 ? std::min<int64_t>(grid.x, s.grid_cap) : grid.x;
  gridDim = dim3(static_cast<unsigned int>(grid_x), grid.y, grid.z);
  blockDim = block;
  const int64_t blocks = grid_x * grid.y * grid.z;
  const int64_t threads = int64_t(block.x) * block.y * block.z;
  const int64_t warps = (threads + kWarpSize - 1) / kWarpSize;
  const std::function<void()> body = [&] { kernel(arguments...); };
  Warp& warp = Warp::of_this_thread();
  std::vector<dim3> thread_indices;
  for (const int64_t b : visiting_order(blocks, s.block_order, random)) {
    blockIdx = dim3(static_cast<unsigned int>(b % grid_x),
                    static_cast<unsigned int>(b / grid_x % grid.y),
                    static_cast<unsigned int>(b / grid_x / grid.y));
    for (const int64_t w : visiting_order(warps, s.thread_order, random)) {
      thread_indices.clear();
      for (int64_t t = w * kWarpSize; t < std::min(threads, (w + 1) * kWarpSize); ++t) {
        thread_indices.push_back(dim3(static_cast<unsigned int>(t % block.x),
                                      static_cast<unsigned int>(t / block.x % block.y),
                                      static_cast<unsigned int>(t / block.x / block.y)));
      }
      const int64_t lanes = static_cast<int64_t>(thread_indices.size());
      std::string error = warp.run(thread_indices, visiting_order(lanes, s.thread_order, random),
                                   body);
      if (!error.empty()) {
        return error;
      }
    }
  }
  return "";
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
    record.pending_error = run(kernel, as_dim3(grid), as_dim3(block), arguments...);
    if (!record.pending_error.empty()) {
      ++record.invalid_launches;
    }
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

// The warp shuffle of CUDA's sm_30_intrinsics, for 32- and 64-bit values.
template <typename T>
T __shfl_xor_sync(unsigned member_mask, T value, int lane_mask,
                  int width = ::cuda_emulation::kWarpSize) {
  ::cuda_emulation::Warp* warp = ::cuda_emulation::Warp::current_warp();
  return warp->shuffle_xor(member_mask, value, lane_mask, width);
}
