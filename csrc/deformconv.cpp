// The op schemas, declared once. Kernels are registered per dispatch key next to their code:
// cpu/ (CPU), cuda/ (CUDA), pytorch/autograd.cpp (Autograd), pytorch/autocast.cpp (Autocast),
// and the fake kernels in Python (deformconv/ops.py), which run _check_arguments.

#include <torch/library.h>

TORCH_LIBRARY(deformconv, m) {
  // DCN v1 without a mask, v2 with one. Shapes: input (N, C_in, H, W); offset
  // (N, 2 * offset_groups * kH * kW, H_out, W_out), y before x for each tap; weight
  // (C_out, C_in / groups, kH, kW); mask (N, offset_groups * kH * kW, H_out, W_out);
  // bias (C_out). im2col_step: images per im2col block, 0 for automatic.
  m.def(
      "deform_conv2d(Tensor input, Tensor offset, Tensor weight, Tensor? mask, Tensor? bias, "
      "SymInt[2] stride, SymInt[2] padding, SymInt[2] dilation, int groups, int offset_groups, "
      "int im2col_step) -> Tensor");
  // Gradients of (input, offset, weight, mask, bias); output_mask selects which are computed,
  // the others are returned undefined (None in Python).
  m.def(
      "deform_conv2d_backward(Tensor grad_output, Tensor input, Tensor offset, Tensor weight, "
      "Tensor? mask, SymInt[2] stride, SymInt[2] padding, SymInt[2] dilation, int groups, "
      "int offset_groups, int im2col_step, bool[5] output_mask) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // The checks of deform_conv2d (grad_output absent) or of deform_conv2d_backward (present),
  // reading no tensor data; returns the output shape. For the fake kernels.
  m.def(
      "_check_arguments(Tensor? grad_output, Tensor input, Tensor offset, Tensor weight, "
      "Tensor? mask, Tensor? bias, SymInt[2] stride, SymInt[2] padding, SymInt[2] dilation, "
      "int groups, int offset_groups, int im2col_step) -> int[]");
}
