#pragma once

// Note [Parallel regions through ATen]
// at::parallel_for is a template in ATen's headers: compiled into this library, its body is an
// OpenMP region only if this library is compiled with the OpenMP flags of torch's own build
// (and otherwise runs on one thread, silently). Those flags differ by compiler and platform
// (GCC's -fopenmp and libgomp; clang needs LLVM's libomp, which would then sit beside torch's
// libgomp; Apple clang has none), and torch's build helpers pass none. So this library compiles
// without them, and enters a parallel region that ATen itself compiled: the stable ABI's
// torch::stable::parallel_for, which runs at::parallel_for inside libtorch, with torch's threads
// and thread count (torch.set_num_threads), whatever its backend. Nested inside one of this
// library's regions, or with one thread, the body runs once, inline. A worker thread carries
// none of the caller's thread-local state (inference mode, the profiler, the dispatcher's "below
// autograd"): every thread of a region runs with grad mode off, and ATen calls there write into
// the ops' tensors only as they would below autograd (run_on_every_thread says why).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>

namespace deformconv {

// The branch that a region records (Note [Branch trace]) when its body runs on a thread besides
// the caller's: the sign that ATen's region, not a serial fallback, ran it. A region that the
// tests must see split on its own names its own branch.
inline constexpr const char* kOtherThreadsBranch = "parallel.other_threads";

// torch's thread count (torch.set_num_threads).
int64_t thread_count();

// Whether this thread is running the body of one of this library's parallel regions.
bool in_parallel_region();

// Runs body() on each of thread_count() threads at once (on the calling thread alone inside a
// region), and returns when every call has returned; records other_threads_branch where a
// thread besides the caller's runs it. The body typically takes work from a shared counter
// until none is left, so that how many threads run it does not change what is computed (inside
// a region of ATen's that is not this library's, ATen runs the threads' calls one after the
// other on the calling thread).
void run_on_every_thread(const std::function<void()>& body,
                         const char* other_threads_branch = kOtherThreadsBranch);

// The runs of tasks that one thread takes in turn, [begin, end) at a time, from a counter that
// all the threads share.
class TaskRuns {
 public:
  TaskRuns(std::atomic<int64_t>& next, int64_t chunk, int64_t tasks)
      : next_(next), chunk_(chunk), tasks_(tasks) {}

  // Takes the next run, false when none is left.
  bool take(int64_t& begin, int64_t& end) {
    begin = next_.fetch_add(chunk_);
    end = std::min(tasks_, begin + chunk_);
    return begin < tasks_;
  }

 private:
  std::atomic<int64_t>& next_;
  int64_t chunk_, tasks_;
};

// Runs the tasks [0, tasks) in parallel: run(runs) once on each thread, which takes runs of
// tasks from `runs` (TaskRuns::take) until none is left, so that what it sets up for the
// problem's size (its buffers) is made once per thread, not once per run. The CPU launchers and
// the driver's forward cut their work into tasks that each write outputs of their own, mostly
// far more tasks than threads, and the threads take them in turn from a shared counter, a chunk
// at a time, rather than a fixed share each as at::parallel_for hands out: when another process
// takes part of a core, the thread on it runs fewer tasks instead of keeping the others waiting
// at the end of every stage. Which thread runs a task does not change its result. The threads
// are ATen's (Note [Parallel regions through ATen]).
//
// task_run_count(tasks) is how many times parallel_task_runs(tasks, ...) calls run: once where
// it runs inline, else once for each of thread_count() turns of the region.
inline int64_t task_run_count(int64_t tasks) {
  return tasks <= 1 || in_parallel_region() ? 1 : thread_count();
}

template <typename Function>
void parallel_task_runs(int64_t tasks, const Function& run,
                        const char* other_threads_branch = kOtherThreadsBranch) {
  std::atomic<int64_t> next{0};
  const int64_t threads = thread_count();
  if (task_run_count(tasks) == 1) {
    TaskRuns runs(next, std::max<int64_t>(tasks, 1), tasks);
    run(runs);
    return;
  }
  // About a sixteenth of a thread's share: small enough to rebalance, large enough that the
  // counter is seldom contended.
  const int64_t chunk = std::max<int64_t>(1, tasks / (16 * threads));
  run_on_every_thread(
      [&] {
        TaskRuns runs(next, chunk, tasks);
        run(runs);
      },
      other_threads_branch);
}

// parallel_task_runs with nothing to set up per thread: run(begin, end) for each run of tasks.
template <typename Function>
void parallel_tasks(int64_t tasks, const Function& run,
                    const char* other_threads_branch = kOtherThreadsBranch) {
  parallel_task_runs(
      tasks,
      [&](TaskRuns& runs) {
        int64_t begin, end;
        while (runs.take(begin, end)) {
          run(begin, end);
        }
      },
      other_threads_branch);
}

}  // namespace deformconv
