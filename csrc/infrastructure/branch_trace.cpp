#include "branch_trace.h"

#include <atomic>
#include <mutex>
#include <set>

namespace deformconv {

namespace {

struct BranchTrace {
  std::atomic<bool> on{false};
  std::mutex mutex;
  std::set<std::string> names;
};

BranchTrace& trace() {
  // Never destroyed: a kernel may still run on another thread during static destruction.
  static BranchTrace* instance = new BranchTrace();
  return *instance;
}

}  // namespace

void record_branch(const char* name) {
  if (!branch_trace_on()) {
    return;
  }
  BranchTrace& t = trace();
  std::lock_guard<std::mutex> lock(t.mutex);
  t.names.insert(name);
}

bool branch_trace_on() { return trace().on.load(std::memory_order_relaxed); }

void record_channel_loops(const char* stage, int64_t count,
                          std::initializer_list<int64_t> widths) {
  if (!branch_trace_on()) {
    return;
  }
  int64_t left = count;
  for (const int64_t width : widths) {
    if (left >= width) {
      record_branch((std::string(stage) + "." + std::to_string(width) + "x").c_str());
      left %= width;
    }
  }
  if (left > 0) {
    record_branch((std::string(stage) + ".1x").c_str());
  }
}

void start_branch_trace() {
  BranchTrace& t = trace();
  std::lock_guard<std::mutex> lock(t.mutex);
  t.names.clear();
  t.on.store(true, std::memory_order_relaxed);
}

std::vector<std::string> take_branch_trace() {
  BranchTrace& t = trace();
  std::lock_guard<std::mutex> lock(t.mutex);
  t.on.store(false, std::memory_order_relaxed);
  std::vector<std::string> names(t.names.begin(), t.names.end());
  t.names.clear();
  return names;
}

}  // namespace deformconv
