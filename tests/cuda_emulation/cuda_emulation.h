#pragma once

// A CPU emulation of the little of CUDA that the project's launchers use, so that the real
// csrc/cuda/*.cu files, compiled as C++ with this header forced in first (-include) and the
// shims of include/ ahead of torch's headers, run their kernels on CPU tensors:
//   - __global__ and friends expand to nothing; blockIdx, threadIdx, blockDim and gridDim are
//     thread-local globals that launch() sets before it calls the kernel for each thread;
//   - launch() (what DEFORMCONV_LAUNCH expands to here) checks the launch against the CUDA
//     runtime's limits, records its bookkeeping, then runs every block and thread in turn, in
//     the order the settings ask for, on a grid that the settings may cap (grid-stride loops
//     must cover any remainder); shuffled orders are seeded, the blocks' drawn once a launch and
//     the threads' drawn again at every synchronisation point, so that the warps of a block
//     interleave differently from one barrier or shuffle to the next, as a GPU's schedule may;
//   - an invalid launch leaves a pending error, as cudaGetLastError would, which
//     DEFORMCONV_CHECK_LAUNCH (csrc/cuda/launch.cuh) raises;
//   - the threads of a block run as coroutines (ucontext) that meet at each __shfl_xor_sync,
//     where the values of a warp's lanes are exchanged once every lane named in the mask has
//     arrived, at each __syncwarp likewise (exchanging nothing), and at each __syncthreads,
//     passed once every thread of the block has arrived; a lane that names an exited lane,
//     reads from a lane outside the mask, or a barrier that a thread has exited before, fails
//     the launch, as it would hang or read garbage on a GPU;
//   - __shared__ is thread_local storage: the threads of a block run on one CPU thread, and a
//     block finds there what the previous one left, as uninitialised shared memory may hold.
// Running the threads one at a time makes a plain add in place of an atomic add correct; what
// emulation cannot see (timing, real concurrency, device atomics, bank conflicts) is left to a
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
#define __launch_bounds__(...)
#define __shared__ static thread_local

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
  // DEFORMCONV_GATHER_MAP_BYTES of the launchers: below a launch's map, it gathers in chunks.
  int64_t gather_map_bytes = int64_t(64) << 20;
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

// The ops' device guard (csrc/cuda/cuda_device.h): it only counts how deep launches sit in
// guards.
class DeviceGuard {
 public:
  explicit DeviceGuard(int32_t /*device_index*/) { ++device_guard_depth; }
  ~DeviceGuard() { --device_guard_depth; }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
};

// A CUDA stream: an id, the current one being settings().current_stream.
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

// One block of a launch: its threads run as coroutines, each until it exits or reaches a warp
// shuffle or __syncthreads. When no thread can go further, the shuffles of each warp are
// resolved; when no thread waits at a shuffle, the barrier is.
class Block {
 public:
  // Runs `body` once per thread, thread t with threadIdx `thread_indices[t]`, visiting the
  // threads in `order` at each step, `order` shuffled again after each step by `reshuffle`
  // where it is not null. Returns the error that makes the block invalid, empty if none.
  std::string run(const std::vector<dim3>& thread_indices, std::vector<int64_t> order,
                  const std::function<void()>& body, std::mt19937_64* reshuffle) {
    thread_count_ = static_cast<int>(thread_indices.size());
    if (threads_.size() < thread_indices.size()) {
      threads_.resize(thread_indices.size());
    }
    body_ = &body;
    error_.clear();
    for (int t = 0; t < thread_count_; ++t) {
      Thread& thread = threads_[t];
      thread.thread_index = thread_indices[t];
      thread.state = State::kRunning;
      if (!thread.stack) {
        thread.stack.reset(new char[kStackBytes]);
      }
      getcontext(&thread.context);
      thread.context.uc_stack.ss_sp = thread.stack.get();
      thread.context.uc_stack.ss_size = kStackBytes;
      thread.context.uc_link = nullptr;
      makecontext(&thread.context, &Block::thread_entry, 0);
    }
    Block* const outer = current_block();
    current_block() = this;
    while (error_.empty()) {
      for (const int64_t t : order) {
        if (threads_[t].state == State::kRunning) {
          resume(static_cast<int>(t));
        }
        if (!error_.empty()) {
          break;
        }
      }
      if (!error_.empty() || !resolve_waits()) {
        break;
      }
      if (reshuffle != nullptr) {
        std::shuffle(order.begin(), order.end(), *reshuffle);
      }
    }
    current_block() = outer;
    return error_;
  }

  // What __shfl_xor_sync does in a thread of this block.
  template <typename T>
  T shuffle_xor(unsigned member_mask, T value, int lane_mask, int width) {
    static_assert(sizeof(T) <= sizeof(uint64_t) && std::is_trivially_copyable_v<T>);
    uint64_t offered = 0;
    std::memcpy(&offered, &value, sizeof(T));
    const uint64_t received = meet_lanes(member_mask, offered, lane_mask, width, false);
    T result;
    std::memcpy(&result, &received, sizeof(T));
    return result;
  }

  // What __syncwarp does in a thread of this block: the lanes of the mask meet as at a shuffle
  // that exchanges nothing, each of them at a __syncwarp.
  void warp_barrier(unsigned member_mask) { meet_lanes(member_mask, 0, 0, kWarpSize, true); }

  // What __syncthreads does in a thread of this block.
  void barrier() {
    threads_[running_].state = State::kAtBarrier;
    yield_to_scheduler();
  }

  // One per thread, its threads' stacks kept from launch to launch.
  static Block& of_this_thread() {
    static thread_local Block block;
    return block;
  }

  // The block whose thread is running on this thread, null outside a block's run.
  static Block*& current_block() {
    static thread_local Block* block = nullptr;
    return block;
  }

 private:
  enum class State { kRunning, kAtShuffle, kAtBarrier, kExited };
  static constexpr size_t kStackBytes = size_t(1) << 18;

  struct Thread {
    ucontext_t context;
    std::unique_ptr<char[]> stack;
    dim3 thread_index;
    State state = State::kExited;
    unsigned member_mask = 0;
    int lane_mask = 0;
    int width = kWarpSize;
    uint64_t value = 0;  // the value offered at a shuffle, then the value received
    bool warp_barrier = false;  // waits at a __syncwarp rather than at a shuffle
  };

  // Waits until the lanes of the mask have arrived (resolve_shuffles), offering `value`;
  // returns the value received.
  uint64_t meet_lanes(unsigned member_mask, uint64_t value, int lane_mask, int width,
                      bool warp_barrier) {
    Thread& thread = threads_[running_];
    thread.state = State::kAtShuffle;
    thread.member_mask = member_mask;
    thread.lane_mask = lane_mask;
    thread.width = width;
    thread.value = value;
    thread.warp_barrier = warp_barrier;
    yield_to_scheduler();
    return threads_[running_].value;
  }

  static void thread_entry() {
    Block& block = *current_block();
    after_stack_switch(nullptr, &block.scheduler_stack_bottom_, &block.scheduler_stack_size_);
    try {
      (*block.body_)();
    } catch (const std::exception& e) {
      block.error_ = std::string("exception in a thread: ") + e.what();
    }
    block.threads_[block.running_].state = State::kExited;
    // Leaving this stack for good: no fake stack to keep.
    before_stack_switch(nullptr, block.scheduler_stack_bottom_, block.scheduler_stack_size_);
    setcontext(&block.scheduler_);
  }

  void resume(int t) {
    running_ = t;
    threadIdx = threads_[t].thread_index;
    void* fake_stack = nullptr;
    before_stack_switch(&fake_stack, threads_[t].stack.get(), kStackBytes);
    swapcontext(&scheduler_, &threads_[t].context);
    after_stack_switch(fake_stack, nullptr, nullptr);
  }

  void yield_to_scheduler() {
    Thread& thread = threads_[running_];
    void* fake_stack = nullptr;
    before_stack_switch(&fake_stack, scheduler_stack_bottom_, scheduler_stack_size_);
    swapcontext(&thread.context, &scheduler_);
    after_stack_switch(fake_stack, &scheduler_stack_bottom_, &scheduler_stack_size_);
  }

  // Every thread has exited or waits: the shuffles first, warp by warp, and the barrier once no
  // thread waits at a shuffle. False when every thread has exited (the block is done) or the
  // waits cannot complete (error_ says why).
  bool resolve_waits() {
    bool at_shuffle = false, at_barrier = false;
    int exited = -1;
    for (int t = 0; t < thread_count_; ++t) {
      at_shuffle |= threads_[t].state == State::kAtShuffle;
      at_barrier |= threads_[t].state == State::kAtBarrier;
      if (threads_[t].state == State::kExited && exited < 0) {
        exited = t;
      }
    }
    if (at_shuffle) {
      for (int first = 0; first < thread_count_; first += kWarpSize) {
        if (!resolve_shuffles(first)) {
          return false;
        }
      }
      return true;
    }
    if (!at_barrier) {
      return false;
    }
    // A GPU counts exited threads out of a barrier on some architectures and hangs on others;
    // CUDA allows __syncthreads only where every thread of the block reaches it.
    if (exited >= 0) {
      return fail("__syncthreads: thread " + std::to_string(exited) +
                  " has exited while others wait at the barrier");
    }
    for (int t = 0; t < thread_count_; ++t) {
      threads_[t].state = State::kRunning;
    }
    return true;
  }

  // Exchanges the values of the threads of the warp that starts at thread `first` that wait at
  // a shuffle. False when the shuffles are invalid.
  bool resolve_shuffles(int first) {
    const int lane_count = std::min(kWarpSize, thread_count_ - first);
    Thread* const lanes = &threads_[first];
    uint64_t received[kWarpSize];
    for (int l = 0; l < lane_count; ++l) {
      const Thread& lane = lanes[l];
      if (lane.state != State::kAtShuffle) {
        continue;
      }
      if ((lane.member_mask >> l & 1u) == 0) {
        return fail("__shfl_xor_sync: lane " + std::to_string(l) + " is not in its own mask");
      }
      for (int other = 0; other < kWarpSize; ++other) {
        if ((lane.member_mask >> other & 1u) == 0) {
          continue;
        }
        if (other >= lane_count || lanes[other].state != State::kAtShuffle ||
            lanes[other].member_mask != lane.member_mask ||
            lanes[other].warp_barrier != lane.warp_barrier) {
          return fail("__shfl_xor_sync: lane " + std::to_string(l) + " waits for lane " +
                      std::to_string(other) +
                      ", which has exited or waits at another shuffle or barrier");
        }
      }
      // A source past the lane's own group of `width` lanes gives the lane its own value.
      const int source = l ^ lane.lane_mask;
      const bool in_group = source < (l / lane.width + 1) * lane.width;
      if (in_group && (lane.member_mask >> source & 1u) == 0) {
        return fail("__shfl_xor_sync: lane " + std::to_string(l) + " reads lane " +
                    std::to_string(source) + ", outside the mask");
      }
      received[l] = in_group ? lanes[source].value : lane.value;
    }
    for (int l = 0; l < lane_count; ++l) {
      if (lanes[l].state == State::kAtShuffle) {
        lanes[l].value = received[l];
        lanes[l].state = State::kRunning;
      }
    }
    return true;
  }

  bool fail(std::string message) {
    error_ = std::move(message);
    return false;
  }

  std::vector<Thread> threads_;
  int thread_count_ = 0;
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

// Runs every block of the launch, each as coroutine threads (Block).
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
  const std::function<void()> body = [&] { kernel(arguments...); };
  Block& emulated_block = Block::of_this_thread();
  std::vector<dim3> thread_indices;
  for (int64_t t = 0; t < threads; ++t) {
    thread_indices.push_back(dim3(static_cast<unsigned int>(t % block.x),
                                  static_cast<unsigned int>(t / block.x % block.y),
                                  static_cast<unsigned int>(t / block.x / block.y)));
  }
  for (const int64_t b : visiting_order(blocks, s.block_order, random)) {
    blockIdx = dim3(static_cast<unsigned int>(b % grid_x),
                    static_cast<unsigned int>(b / grid_x % grid.y),
                    static_cast<unsigned int>(b / grid_x / grid.y));
    std::string error =
        emulated_block.run(thread_indices, visiting_order(threads, s.thread_order, random), body,
                           s.thread_order == Order::kShuffled ? &random : nullptr);
    if (!error.empty()) {
      return error;
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
  return ::cuda_emulation::Block::current_block()->shuffle_xor(member_mask, value, lane_mask,
                                                               width);
}

// The block-wide barrier.
inline void __syncthreads() { ::cuda_emulation::Block::current_block()->barrier(); }

// The barrier of a warp's lanes named in the mask.
inline void __syncwarp(unsigned member_mask = 0xffffffffu) {
  ::cuda_emulation::Block::current_block()->warp_barrier(member_mask);
}
