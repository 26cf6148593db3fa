// The branch trace's ops (Note [Branch trace]), declared and registered apart from the trace
// itself so that a test build can link the trace without registering anything
// (tests/cuda_emulation).

#include <torch/csrc/stable/library.h>

#include "../infrastructure/branch_trace.h"

namespace deformconv {

STABLE_TORCH_LIBRARY_FRAGMENT(deformconv, m) {
  m.def(kStartBranchTraceSchema);
  m.def(kTakeBranchTraceSchema);
}

STABLE_TORCH_LIBRARY_IMPL(deformconv, CompositeExplicitAutograd, m) {
  m.impl("_start_branch_trace", TORCH_BOX(&start_branch_trace));
  m.impl("_take_branch_trace", TORCH_BOX(&take_branch_trace));
}

}  // namespace deformconv
