#pragma once

// The launcher table of the copy of the CPU kernels in use (Note [CPU copies], cpu_copies.h),
// which each op's CPU table file registers with its device-neutral drivers.

#include <cstddef>

#include "cpu_copy_list.h"

namespace deformconv {

// The place of the copy in use in DEFORMCONV_FOR_EACH_CPU_COPY's list (cpu_capability.cpp), its
// branch recorded.
std::size_t cpu_copy_in_use();

template <typename Launchers, std::size_t copies>
const Launchers& launchers_in_use(const Launchers& (*const (&tables)[copies])()) {
  return tables[cpu_copy_in_use()]();
}

#define DEFORMCONV_CPU_COPY_TABLE(copy, name, table) copy::table,

// The launcher table of the copy in use, of the tables that the function `table` returns in
// each copy (defined in each copy's namespace by the op's kernel file's body). Each op's CPU
// head names its own, so that a new op edits none of the CPU's shared files.
#define DEFORMCONV_CPU_LAUNCHERS_IN_USE(table) \
  launchers_in_use({DEFORMCONV_FOR_EACH_CPU_COPY(DEFORMCONV_CPU_COPY_TABLE, table)})

}  // namespace deformconv
