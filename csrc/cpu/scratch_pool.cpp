// The CPU's scratch memory: a pool of large blocks kept from call to call.

#include <ATen/core/ivalue.h>
#include <ATen/ops/from_blob.h>
#include <ATen/record_function.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "deform_conv2d_single_copy_cpu.h"

namespace deformconv {
namespace {

// The driver's scratch memory, kept from call to call. A call needs the same few large buffers
// as the last one (columns, channels-last copies, plans, the weight in columns order), and a
// fresh buffer from the system costs a page fault per page and the kernel's zeroing of each
// page: about a tenth of c3-stride2's forward. A scratch tensor, when freed, returns its block
// here, and a later request takes the smallest kept block that fits it and is at most twice
// its size. The pool keeps at most kKeptScratchBytes and gives the rest back to the system;
// every thread shares it.
class ScratchPool {
 public:
  static ScratchPool& instance() {
    // Never destroyed: a scratch tensor may still be freed during static destruction.
    static ScratchPool* pool = new ScratchPool();
    return *pool;
  }

  at::Tensor take(c10::IntArrayRef sizes, const at::TensorOptions& options) {
    // An event of its own, as aten::empty has, which the block counts as allocated by.
    RECORD_FUNCTION("deformconv::scratch", std::vector<c10::IValue>());
    const size_t bytes = std::max<size_t>(
        1, static_cast<size_t>(c10::multiply_integers(sizes)) * options.dtype().itemsize());
    void* block = nullptr;
    size_t block_bytes = bytes;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto kept = free_blocks_.lower_bound(bytes);
      if (kept != free_blocks_.end() && kept->first <= 2 * bytes) {
        block = kept->second;
        block_bytes = kept->first;
        kept_bytes_ -= block_bytes;
        free_blocks_.erase(kept);
      }
    }
    if (block == nullptr) {
      block = allocate(bytes);
    }
    report_to_profiler(block, static_cast<int64_t>(block_bytes));
    return at::from_blob(
        block, sizes, [this, block_bytes](void* data) { give_back(data, block_bytes); },
        options);
  }

 private:
  static constexpr size_t kKeptScratchBytes = size_t(128) << 20;

  // Fresh memory from the system; on Linux, asking for transparent huge pages over the part
  // that covers whole ones (madvise, advisory: the kernel may decline), as PyTorch's
  // THP_MEM_ALLOC_ENABLE does for every allocation.
  static void* allocate(size_t bytes) {
    void* block = c10::alloc_cpu(bytes);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    constexpr uintptr_t kHugePage = uintptr_t(1) << 21;
    const auto begin = reinterpret_cast<uintptr_t>(block);
    const uintptr_t first = (begin + kHugePage - 1) & ~(kHugePage - 1);
    const uintptr_t last = (begin + bytes) & ~(kHugePage - 1);
    if (last > first) {
      madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
    }
#endif
    return block;
  }

  // A block in use counts as allocated for PyTorch's memory profiler, as a fresh buffer from
  // PyTorch's allocator would, whether it was kept or new.
  static void report_to_profiler(void* block, int64_t bytes) {
    c10::reportMemoryUsageToProfiler(block, bytes, 0, 0, c10::Device(c10::DeviceType::CPU));
  }

  void give_back(void* block, size_t bytes) {
    report_to_profiler(block, -static_cast<int64_t>(bytes));
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (kept_bytes_ + bytes <= kKeptScratchBytes) {
        free_blocks_.emplace(bytes, block);
        kept_bytes_ += bytes;
        return;
      }
    }
    c10::free_cpu(block);
  }

  std::mutex mutex_;
  std::multimap<size_t, void*> free_blocks_;  // by size
  size_t kept_bytes_ = 0;
};

}  // namespace

at::Tensor scratch_cpu(c10::IntArrayRef sizes, const at::TensorOptions& options) {
  return ScratchPool::instance().take(sizes, options);
}

}  // namespace deformconv
