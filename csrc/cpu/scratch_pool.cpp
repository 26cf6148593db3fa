// The CPU's scratch memory: a pool of large blocks kept from call to call.

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "../common/scalar_types.h"
#include "deform_conv2d_single_copy_cpu.h"

namespace deformconv {
namespace {

// The driver's scratch memory, kept from call to call. A call needs the same few large buffers
// as the last one (columns, channels-last copies, plans, the weight in columns order), and a
// fresh buffer from the system costs a page fault per page and the kernel's zeroing of each
// page: about a tenth of c3-stride2's forward. A scratch tensor, when freed, returns its block
// here, and a later request takes the smallest kept block that fits it and is at most twice
// its size. The pool keeps at most 128 MiB (DEFORMCONV_KEPT_SCRATCH_MIB in the environment sets
// another bound, 0 for none kept) and gives the rest back; every thread shares it. Its blocks are
// tensors of bytes from torch's allocator, so that PyTorch's memory profiler counts them from
// when the pool takes them to when it lets them go, kept ones included; release_scratch lets
// every kept block go.
class ScratchPool {
 public:
  static ScratchPool& instance() {
    // Never destroyed: a scratch tensor may still be freed during static destruction.
    static ScratchPool* pool = new ScratchPool();
    return *pool;
  }

  Tensor take(const Tensor& like, Sizes sizes, ScalarType dtype) {
    int64_t elements = 1;
    for (const int64_t size : sizes) {
      elements *= size;
    }
    const int64_t bytes = std::max<int64_t>(1, elements * element_size(dtype));
    Tensor block;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto kept = free_blocks_.lower_bound(bytes);
      if (kept != free_blocks_.end() && kept->first <= 2 * bytes) {
        block = std::move(kept->second);
        kept_bytes_ -= kept->first;
        free_blocks_.erase(kept);
      }
    }
    if (!block.defined()) {
      block = allocate(like, bytes);
    }
    return torch::stable::from_blob(block.mutable_data_ptr(), sizes, contiguous_strides(sizes),
                                    like.device(), dtype,
                                    [this, block](void*) { give_back(block); });
  }

  // Lets every kept block go.
  void release() {
    std::multimap<int64_t, Tensor> released;
    std::lock_guard<std::mutex> lock(mutex_);
    std::swap(released, free_blocks_);
    kept_bytes_ = 0;
  }

 private:
  // Read once, when the pool is first used.
  const int64_t kept_scratch_bytes_ = [] {
    const char* setting = std::getenv("DEFORMCONV_KEPT_SCRATCH_MIB");
    return (setting != nullptr ? std::max<int64_t>(0, std::atoll(setting)) : 128) << 20;
  }();

  // A block from torch's allocator; on Linux, asking for transparent huge pages over the part
  // that covers whole ones (madvise, advisory: the kernel may decline), as PyTorch's
  // THP_MEM_ALLOC_ENABLE does for every allocation.
  static Tensor allocate(const Tensor& like, int64_t bytes) {
    Tensor block = new_contiguous(like, {bytes}, ScalarType::Byte);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    constexpr uintptr_t kHugePage = uintptr_t(1) << 21;
    const auto begin = reinterpret_cast<uintptr_t>(block.mutable_data_ptr());
    const uintptr_t first = (begin + kHugePage - 1) & ~(kHugePage - 1);
    const uintptr_t last = (begin + static_cast<uintptr_t>(bytes)) & ~(kHugePage - 1);
    if (last > first) {
      madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
    }
#endif
    return block;
  }

  void give_back(const Tensor& block) {
    const int64_t bytes = block.numel();
    std::lock_guard<std::mutex> lock(mutex_);
    if (kept_bytes_ + bytes <= kept_scratch_bytes_) {
      free_blocks_.emplace(bytes, block);
      kept_bytes_ += bytes;
    }
  }

  std::mutex mutex_;
  std::multimap<int64_t, Tensor> free_blocks_;  // by size
  int64_t kept_bytes_ = 0;
};

void release_scratch() { ScratchPool::instance().release(); }

}  // namespace

Tensor scratch_cpu(const Tensor& like, Sizes sizes, ScalarType dtype) {
  return ScratchPool::instance().take(like, sizes, dtype);
}

// An op of its own, for the benchmark's peak memory (deformconv/benchmarks/timing.py), which
// lets the kept blocks go before it measures, so that a call's scratch counts as its own.
STABLE_TORCH_LIBRARY_FRAGMENT(deformconv, m) { m.def("_release_scratch() -> ()"); }

// No tensor to dispatch on: the kernel for every key.
STABLE_TORCH_LIBRARY_IMPL(deformconv, CompositeImplicitAutograd, m) {
  m.impl("_release_scratch", TORCH_BOX(&release_scratch));
}

}  // namespace deformconv
