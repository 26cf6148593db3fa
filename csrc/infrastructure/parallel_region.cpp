// Note [Parallel regions through ATen] (parallel_region.h).

#include "parallel_region.h"

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/ops.h>

#include <cstdint>
#include <thread>

#include "branch_trace.h"

namespace deformconv {
namespace {

thread_local bool inside_region = false;

// Marks the thread as inside one of the library's regions while it lives, and puts back what
// was there when it goes, an exception from the region's body included: a flag left set would
// run every later region of that thread serially.
class InsideRegion {
 public:
  InsideRegion() : outer_(inside_region) { inside_region = true; }
  ~InsideRegion() { inside_region = outer_; }
  InsideRegion(const InsideRegion&) = delete;
  InsideRegion& operator=(const InsideRegion&) = delete;

 private:
  bool outer_;
};

// Turns the thread's grad mode off while it lives, and puts back what was there when it goes.
class GradModeOff {
 public:
  GradModeOff() : outer_(aoti_torch_grad_mode_is_enabled()) {
    aoti_torch_grad_mode_set_enabled(false);
  }
  ~GradModeOff() { aoti_torch_grad_mode_set_enabled(outer_); }
  GradModeOff(const GradModeOff&) = delete;
  GradModeOff& operator=(const GradModeOff&) = delete;

 private:
  bool outer_;
};

}  // namespace

int64_t thread_count() { return static_cast<int64_t>(torch::stable::get_num_threads()); }

bool in_parallel_region() { return inside_region; }

void run_on_every_thread(const std::function<void()>& body, const char* other_threads_branch) {
  const int64_t threads = thread_count();
  if (threads == 1 || inside_region) {
    body();
    return;
  }
  const std::thread::id caller = std::this_thread::get_id();
  // A worker thread has a thread-local state of its own, not the caller's (the stable ABI can
  // pass none on), and runs outside the dispatcher's "below autograd" where the caller's kernel
  // runs: an ATen op there with an operand that requires grad (the bias of a module) would record
  // autograd history, and under inference mode save an inference tensor for it, which raises. So
  // every thread of a region runs with grad mode off.
  // A grain of one turn: at::parallel_for gives each thread a run of one turn.
  torch::stable::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    if (std::this_thread::get_id() != caller) {
      record_branch(other_threads_branch);
    }
    const InsideRegion inside;
    const GradModeOff grad_mode_off;
    for (int64_t turn = begin; turn < end; ++turn) {
      body();
    }
  });
}

}  // namespace deformconv
