// Note [Parallel regions through ATen] (parallel_region.h).

#include "parallel_region.h"

#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>
#include <ATen/ops/empty.h>

#include <cstdint>
#include <thread>

#include "branch_trace.h"

namespace deformconv {

void run_on_every_thread(c10::function_ref<void()> body, const char* other_threads_branch) {
  const int64_t threads = at::get_num_threads();
  if (threads == 1 || at::in_parallel_region()) {
    body();
    return;
  }
  // One byte per thread, never read or written: the iterator's elements are only turns, and
  // at::parallel_for gives each thread a run of ceil(threads / threads) = 1 of them.
  const at::Tensor turns = at::empty({threads}, at::kByte);
  at::TensorIterator iterator = at::TensorIteratorConfig()
                                    .add_output(turns)
                                    .resize_outputs(false)
                                    .check_all_same_dtype(false)
                                    .set_check_mem_overlap(false)
                                    .build();
  const std::thread::id caller = std::this_thread::get_id();
  iterator.for_each(
      [&](char**, const int64_t*, int64_t size_0, int64_t size_1) {
        if (std::this_thread::get_id() != caller) {
          record_branch(other_threads_branch);
        }
        for (int64_t turn = 0; turn < size_0 * size_1; ++turn) {
          body();
        }
      },
      /*grain_size=*/1);
}

}  // namespace deformconv
