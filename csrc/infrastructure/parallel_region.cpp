// Note [Parallel regions through ATen] (parallel_region.h).

#include "parallel_region.h"

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
  // A grain of one turn: at::parallel_for gives each thread a run of one turn.
  torch::stable::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    if (std::this_thread::get_id() != caller) {
      record_branch(other_threads_branch);
    }
    const InsideRegion inside;
    for (int64_t turn = begin; turn < end; ++turn) {
      body();
    }
  });
}

}  // namespace deformconv
