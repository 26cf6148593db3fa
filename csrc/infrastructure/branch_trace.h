#pragma once

// Note [Branch trace]
// The drivers and launchers choose among paths by dtype, size, thread count and the CPU's
// instruction sets: oneDNN or bmm GEMMs, the fused or the GEMM forward, one backward pass or
// two, a kernel instance specialised for 16 channels. A test that means to exercise one path
// must know that it ran, or a later change of a threshold would route it silently around the
// path it names. So each choice is recorded by name (record_branch) while a trace is on:
// start_branch_trace clears the record and turns the trace on, take_branch_trace returns the
// names recorded since, sorted, and turns it off. The tests reach them as
// torch.ops.deformconv._start_branch_trace and _take_branch_trace; docs/testing.md lists the
// names and the tests that force each. Off, a record costs one relaxed atomic load, made once
// per call, block or window, never per sample.

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace deformconv {

void record_branch(const char* name);

bool branch_trace_on();

// For a cascade of loops over `count` channels that takes them `widths[0]` at a time while that
// many are left, then `widths[1]` at a time, ..., then one by one: records "<stage>.<width>x"
// for each loop that runs, "<stage>.1x" for the last.
void record_channel_loops(const char* stage, int64_t count,
                          std::initializer_list<int64_t> widths);

void start_branch_trace();

std::vector<std::string> take_branch_trace();

// Their schemas: deformconv's (binding/branch_trace_registration.cpp) and the test suite's
// emulation library's.
inline constexpr const char* kStartBranchTraceSchema = "_start_branch_trace() -> ()";
inline constexpr const char* kTakeBranchTraceSchema = "_take_branch_trace() -> str[]";

}  // namespace deformconv
