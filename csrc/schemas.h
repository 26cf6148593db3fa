#pragma once

// The op schemas, one string each: declared by TORCH_LIBRARY(deformconv) in deformconv.cpp, and
// under another namespace by the test suite's CUDA emulation library (tests/cuda_emulation).

namespace deformconv::schemas {

// DCN v1 without a mask, v2 with one. Shapes: input (N, C_in, H, W); offset
// (N, 2 * offset_groups * kH * kW, H_out, W_out), y before x for each tap; weight
// (C_out, C_in / groups, kH, kW); mask (N, offset_groups * kH * kW, H_out, W_out);
// bias (C_out). im2col_step: images per im2col block, 0 for automatic.
inline constexpr const char* kDeformConv2d =
    "deform_conv2d(Tensor input, Tensor offset, Tensor weight, Tensor? mask, Tensor? bias, "
    "SymInt[2] stride, SymInt[2] padding, SymInt[2] dilation, int groups, int offset_groups, "
    "int im2col_step) -> Tensor";

// Gradients of (input, offset, weight, mask, bias); output_mask selects which are computed,
// the others are returned undefined (None in Python).
inline constexpr const char* kDeformConv2dBackward =
    "deform_conv2d_backward(Tensor grad_output, Tensor input, Tensor offset, Tensor weight, "
    "Tensor? mask, SymInt[2] stride, SymInt[2] padding, SymInt[2] dilation, int groups, "
    "int offset_groups, int im2col_step, bool[5] output_mask) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)";

// The checks of deform_conv2d (grad_output absent) or of deform_conv2d_backward (present),
// reading no tensor data; returns the output shape. For the fake kernels.
inline constexpr const char* kCheckDeformConv2dArguments =
    "_check_deform_conv2d_arguments(Tensor? grad_output, Tensor input, Tensor offset, "
    "Tensor weight, Tensor? mask, Tensor? bias, SymInt[2] stride, SymInt[2] padding, "
    "SymInt[2] dilation, int groups, int offset_groups, int im2col_step) -> int[]";

// DCNv3 (InternImage), arguments in the original DCNv3Function's order; channels-last shapes:
// input (N, H, W, group * group_channels); offset (N, H_out, W_out, group * P * 2), x before y
// for each point; mask (N, H_out, W_out, group * P), P = kernel_h * kernel_w - remove_center.
// im2col_step is accepted for the originals' signature and changes nothing.
inline constexpr const char* kDcnv3 =
    "dcnv3(Tensor input, Tensor offset, Tensor mask, int kernel_h, int kernel_w, int stride_h, "
    "int stride_w, int pad_h, int pad_w, int dilation_h, int dilation_w, int group, "
    "int group_channels, float offset_scale, int im2col_step, bool remove_center) -> Tensor";

// Gradients of (input, offset, mask); output_mask selects which are computed.
inline constexpr const char* kDcnv3Backward =
    "dcnv3_backward(Tensor grad_output, Tensor input, Tensor offset, Tensor mask, int kernel_h, "
    "int kernel_w, int stride_h, int stride_w, int pad_h, int pad_w, int dilation_h, "
    "int dilation_w, int group, int group_channels, float offset_scale, int im2col_step, "
    "bool remove_center, bool[3] output_mask) -> (Tensor, Tensor, Tensor)";

// DCNv4 (FlashInternImage), in the original DCNv4Function's order: dcnv3 with offsets and mask
// packed in one tensor, offset_mask (N, H_out, W_out, C_pad), C_pad >= group * P * 3; group g
// owns channels [3 P g, 3 P (g + 1)): the (x, y) pairs of its P points, then their P mask
// values. Channels from group * P * 3 on are padding, never read.
inline constexpr const char* kDcnv4 =
    "dcnv4(Tensor input, Tensor offset_mask, int kernel_h, int kernel_w, int stride_h, "
    "int stride_w, int pad_h, int pad_w, int dilation_h, int dilation_w, int group, "
    "int group_channels, float offset_scale, int im2col_step, bool remove_center) -> Tensor";

// Gradients of (input, offset_mask), zero in offset_mask's padding; output_mask selects which
// are computed.
inline constexpr const char* kDcnv4Backward =
    "dcnv4_backward(Tensor grad_output, Tensor input, Tensor offset_mask, int kernel_h, "
    "int kernel_w, int stride_h, int stride_w, int pad_h, int pad_w, int dilation_h, "
    "int dilation_w, int group, int group_channels, float offset_scale, int im2col_step, "
    "bool remove_center, bool[2] output_mask) -> (Tensor, Tensor)";

// The checks of dcnv3 (grad_output absent) or dcnv3_backward (present), reading no tensor
// data; returns the output shape. For the fake kernels. Without a mask, those of dcnv4, the
// offset tensor being offset_mask.
inline constexpr const char* kCheckDcnv3Arguments =
    "_check_dcnv3_arguments(Tensor? grad_output, Tensor input, Tensor offset, Tensor? mask, "
    "int kernel_h, int kernel_w, int stride_h, int stride_w, int pad_h, int pad_w, "
    "int dilation_h, int dilation_w, int group, int group_channels, float offset_scale, "
    "int im2col_step, bool remove_center) -> int[]";

// Multi-scale deformable attention (Deformable DETR), in the original MSDeformAttnFunction's
// order: value (N, S, M, D), the levels' pixels stacked along S; spatial_shapes (L, 2) int64,
// each level's (H, W); level_start_index (L,) int64, where each level starts in S;
// sampling_locations (N, Lq, M, L, P, 2), normalised (x, y); attention_weights (N, Lq, M, L, P),
// used as given. Output (N, Lq, M * D). im2col_step is accepted for the originals' signature
// and changes nothing.
inline constexpr const char* kMsDeformAttn =
    "ms_deform_attn(Tensor value, Tensor spatial_shapes, Tensor level_start_index, "
    "Tensor sampling_locations, Tensor attention_weights, int im2col_step) -> Tensor";

// Gradients of (value, sampling_locations, attention_weights); output_mask selects which are
// computed.
inline constexpr const char* kMsDeformAttnBackward =
    "ms_deform_attn_backward(Tensor grad_output, Tensor value, Tensor spatial_shapes, "
    "Tensor level_start_index, Tensor sampling_locations, Tensor attention_weights, "
    "int im2col_step, bool[3] output_mask) -> (Tensor, Tensor, Tensor)";

// The checks of ms_deform_attn (grad_output absent) or its backward (present) that read no
// floating-point data: on meta tensors, the shapes only; on others, spatial_shapes and
// level_start_index too. Returns the output shape. For the fake kernels.
inline constexpr const char* kCheckMsDeformAttnArguments =
    "_check_ms_deform_attn_arguments(Tensor? grad_output, Tensor value, Tensor spatial_shapes, "
    "Tensor level_start_index, Tensor sampling_locations, Tensor attention_weights, "
    "int im2col_step) -> int[]";

// Note [Branch trace] (infrastructure/branch_trace.h): which paths the drivers and launchers
// take, for the tests. _start_branch_trace clears the record and turns it on;
// _take_branch_trace returns the names recorded since, sorted, and turns it off.
inline constexpr const char* kStartBranchTrace = "_start_branch_trace() -> ()";
inline constexpr const char* kTakeBranchTrace = "_take_branch_trace() -> str[]";

// The copies of the CPU kernels (Note [CPU copies], cpu/cpu_copies.h): the one in use
// (avx512, avx2 or default); those this build holds that this CPU runs, best first; for the
// tests, the choice of another, returning the one it replaces; and why the copy that
// DEFORMCONV_CPU_CAPABILITY names does not run (empty where it does, or where it is not set),
// which the Python package warns of.
inline constexpr const char* kCpuCapability = "_cpu_capability() -> str";
inline constexpr const char* kCpuCapabilities = "_cpu_capabilities() -> str[]";
inline constexpr const char* kSelectCpuCapability =
    "_select_cpu_capability(str capability) -> str";
inline constexpr const char* kCpuCapabilityFallback = "_cpu_capability_fallback() -> str";

}  // namespace deformconv::schemas
