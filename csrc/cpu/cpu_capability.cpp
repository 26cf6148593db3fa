// The choice of the copy of the CPU kernels that runs (Note [CPU copies], cpu_copies.h): on
// first use, the best copy that the CPU runs, or the one DEFORMCONV_CPU_CAPABILITY names. For a
// name that is no copy, a copy this build lacks or one the CPU cannot run, the best copy runs
// instead, and _cpu_capability_fallback says why, which the Python package warns of when it
// loads (the stable ABI has no warnings). The private ops report the choice (python -m
// deformconv info, the benchmark) and let the tests run each copy in one process.

#include <torch/csrc/stable/library.h>

#include <atomic>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "../infrastructure/argument_checks.h"
#include "../infrastructure/branch_trace.h"
#include "cpu_copy_list.h"
#include "cpu_launchers.h"

namespace deformconv {
namespace {

// One copy: its name (avx512, avx2, default) and the branch recorded when it runs.
struct CpuCopy {
  const char* name;
  const char* branch;
};

#define DEFORMCONV_COPY_ENTRY(copy, name, unused) CpuCopy{name, "cpu.capability." name},
// Best first, as DEFORMCONV_FOR_EACH_CPU_COPY lists them, which cpu_copy_in_use's place is in.
constexpr CpuCopy kCopies[] = {DEFORMCONV_FOR_EACH_CPU_COPY(DEFORMCONV_COPY_ENTRY, )};
#undef DEFORMCONV_COPY_ENTRY

constexpr const char* kKnownNames = "avx512, avx2 or default";

bool runs_here(std::string_view name) {
#if defined(DEFORMCONV_X86_CPU_COPIES)
  // The instruction sets of the copies' target pragmas, and the operating system's support for
  // their registers, which GCC's CPU model checks too.
#if __GNUC__ >= 12
  if (name == "avx512") {
    return __builtin_cpu_supports("x86-64-v4");
  }
  if (name == "avx2") {
    return __builtin_cpu_supports("x86-64-v3");
  }
#else
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2");
  if (name == "avx512") {
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512cd");
  }
  if (name == "avx2") {
    return avx2;
  }
#endif
#endif
  return name == "default";
}

const CpuCopy* held_copy(std::string_view name) {
  for (const CpuCopy& copy : kCopies) {
    if (name == copy.name) {
      return &copy;
    }
  }
  return nullptr;
}

const CpuCopy& best_copy() {
  for (const CpuCopy& copy : kCopies) {
    if (runs_here(copy.name)) {
      return copy;
    }
  }
  return kCopies[std::size(kCopies) - 1];  // the default copy, which every CPU runs
}

std::string held_names() {
  std::string names;
  for (const CpuCopy& copy : kCopies) {
    names += names.empty() ? copy.name : std::string(" ") + copy.name;
  }
  return names;
}

// Why `name` cannot run here, or empty if it can.
std::string refusal(std::string_view name) {
  if (name != "avx512" && name != "avx2" && name != "default") {
    return "expected " + std::string(kKnownNames) + ", but got '" + std::string(name) + "'";
  }
  if (held_copy(name) == nullptr) {
    return "this build holds no " + std::string(name) + " copy (it holds: " + held_names() + ")";
  }
  if (!runs_here(name)) {
    return "this CPU cannot run the " + std::string(name) + " copy";
  }
  return "";
}

// Why the copy that DEFORMCONV_CPU_CAPABILITY names does not run, empty where it does or where
// the variable is not set: read once, with the first choice of a copy.
std::string& fallback() {
  static std::string why;
  return why;
}

const CpuCopy& requested_or_best_copy() {
  const char* requested = std::getenv("DEFORMCONV_CPU_CAPABILITY");
  if (requested == nullptr || *requested == '\0') {
    return best_copy();
  }
  const std::string why_not = refusal(requested);
  if (!why_not.empty()) {
    fallback() = "DEFORMCONV_CPU_CAPABILITY: " + why_not + "; running the " +
                 best_copy().name + " copy of the CPU kernels instead";
    return best_copy();
  }
  return *held_copy(requested);
}

std::atomic<const CpuCopy*>& selected_copy() {
  static std::atomic<const CpuCopy*> selected{&requested_or_best_copy()};
  return selected;
}

std::string cpu_capability_fallback() {
  selected_copy();
  return fallback();
}

std::string cpu_capability() { return selected_copy().load()->name; }

std::vector<std::string> cpu_capabilities() {
  std::vector<std::string> runnable;
  for (const CpuCopy& copy : kCopies) {
    if (runs_here(copy.name)) {
      runnable.emplace_back(copy.name);
    }
  }
  return runnable;
}

std::string select_cpu_capability(std::string capability) {
  const std::string why_not = refusal(capability);
  DEFORMCONV_CHECK_ARGUMENT(why_not.empty(), "_select_cpu_capability(): ", why_not);
  return selected_copy().exchange(held_copy(capability))->name;
}

}  // namespace

std::size_t cpu_copy_in_use() {
  const CpuCopy* copy = selected_copy().load();
  record_branch(copy->branch);
  return static_cast<std::size_t>(copy - kCopies);
}

// The copy in use (avx512, avx2 or default); those this build holds that this CPU runs, best
// first; for the tests, the choice of another, returning the one it replaces; and why the copy
// that DEFORMCONV_CPU_CAPABILITY names does not run (empty where it does, or where it is not
// set), which the Python package warns of.
STABLE_TORCH_LIBRARY_FRAGMENT(deformconv, m) {
  m.def("_cpu_capability() -> str");
  m.def("_cpu_capabilities() -> str[]");
  m.def("_select_cpu_capability(str capability) -> str");
  m.def("_cpu_capability_fallback() -> str");
}

STABLE_TORCH_LIBRARY_IMPL(deformconv, CompositeExplicitAutograd, m) {
  m.impl("_cpu_capability", TORCH_BOX(&cpu_capability));
  m.impl("_cpu_capabilities", TORCH_BOX(&cpu_capabilities));
  m.impl("_select_cpu_capability", TORCH_BOX(&select_cpu_capability));
  m.impl("_cpu_capability_fallback", TORCH_BOX(&cpu_capability_fallback));
}

}  // namespace deformconv
