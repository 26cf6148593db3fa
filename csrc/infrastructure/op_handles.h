#pragma once

// The ops' descriptions, for kernels that call back into the dispatcher (autograd, autocast):
// each op's name, the C++ signatures of it and of its backward op (schemas.h), and how the
// two relate. Their typed handles are looked up once, on first use.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <array>
#include <cstddef>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>

namespace deformconv {

// Each description gives
//   kName                the op's name in the deformconv namespace, and in messages;
//   Signature            the op's C++ signature;
//   kArgumentNames       its arguments' names, as the schema gives them;
//   BackwardSignature    its backward op's: grad_output, kBackwardArguments, output_mask;
//   kGradientArguments   the places, among the op's arguments, of the tensors whose gradients
//                        the backward op returns, in its output_mask's order;
//   kBackwardArguments   the places of the arguments that the backward op takes after
//                        grad_output, in its order.

struct DeformConv2dOp {
  static constexpr const char* kName = "deform_conv2d";
  using Signature = at::Tensor(const at::Tensor& input, const at::Tensor& offset,
                               const at::Tensor& weight, const std::optional<at::Tensor>& mask,
                               const std::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                               c10::IntArrayRef padding, c10::IntArrayRef dilation,
                               int64_t groups, int64_t offset_groups, int64_t im2col_step);
  static constexpr std::array<const char*, 11> kArgumentNames = {
      "input", "offset", "weight", "mask", "bias", "stride", "padding", "dilation", "groups",
      "offset_groups", "im2col_step"};
  using BackwardSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& offset,
      const at::Tensor& weight, const std::optional<at::Tensor>& mask, c10::IntArrayRef stride,
      c10::IntArrayRef padding, c10::IntArrayRef dilation, int64_t groups, int64_t offset_groups,
      int64_t im2col_step, std::array<bool, 5> output_mask);
  static constexpr std::array<size_t, 5> kGradientArguments = {0, 1, 2, 3, 4};
  // All but bias, whose gradient needs only grad_output.
  static constexpr std::array<size_t, 10> kBackwardArguments = {0, 1, 2, 3, 5, 6, 7, 8, 9, 10};
};

struct Dcnv3Op {
  static constexpr const char* kName = "dcnv3";
  using Signature = at::Tensor(const at::Tensor& input, const at::Tensor& offset,
                               const at::Tensor& mask, int64_t kernel_h, int64_t kernel_w,
                               int64_t stride_h, int64_t stride_w, int64_t pad_h, int64_t pad_w,
                               int64_t dilation_h, int64_t dilation_w, int64_t group,
                               int64_t group_channels, double offset_scale, int64_t im2col_step,
                               bool remove_center);
  static constexpr std::array<const char*, 16> kArgumentNames = {
      "input", "offset", "mask", "kernel_h", "kernel_w", "stride_h", "stride_w", "pad_h", "pad_w",
      "dilation_h", "dilation_w", "group", "group_channels", "offset_scale", "im2col_step",
      "remove_center"};
  using BackwardSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& offset,
      const at::Tensor& mask, int64_t kernel_h, int64_t kernel_w, int64_t stride_h,
      int64_t stride_w, int64_t pad_h, int64_t pad_w, int64_t dilation_h, int64_t dilation_w,
      int64_t group, int64_t group_channels, double offset_scale, int64_t im2col_step,
      bool remove_center, std::array<bool, 3> output_mask);
  static constexpr std::array<size_t, 3> kGradientArguments = {0, 1, 2};
  static constexpr std::array<size_t, 16> kBackwardArguments = {0, 1, 2,  3,  4,  5,  6,  7,
                                                                8, 9, 10, 11, 12, 13, 14, 15};
};

struct Dcnv4Op {
  static constexpr const char* kName = "dcnv4";
  using Signature = at::Tensor(const at::Tensor& input, const at::Tensor& offset_mask,
                               int64_t kernel_h, int64_t kernel_w, int64_t stride_h,
                               int64_t stride_w, int64_t pad_h, int64_t pad_w, int64_t dilation_h,
                               int64_t dilation_w, int64_t group, int64_t group_channels,
                               double offset_scale, int64_t im2col_step, bool remove_center);
  static constexpr std::array<const char*, 15> kArgumentNames = {
      "input", "offset_mask", "kernel_h", "kernel_w", "stride_h", "stride_w", "pad_h", "pad_w",
      "dilation_h", "dilation_w", "group", "group_channels", "offset_scale", "im2col_step",
      "remove_center"};
  using BackwardSignature = std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& offset_mask,
      int64_t kernel_h, int64_t kernel_w, int64_t stride_h, int64_t stride_w, int64_t pad_h,
      int64_t pad_w, int64_t dilation_h, int64_t dilation_w, int64_t group,
      int64_t group_channels, double offset_scale, int64_t im2col_step, bool remove_center,
      std::array<bool, 2> output_mask);
  static constexpr std::array<size_t, 2> kGradientArguments = {0, 1};
  static constexpr std::array<size_t, 15> kBackwardArguments = {0, 1, 2,  3,  4,  5,  6, 7,
                                                                8, 9, 10, 11, 12, 13, 14};
};

struct MsDeformAttnOp {
  static constexpr const char* kName = "ms_deform_attn";
  using Signature = at::Tensor(const at::Tensor& value, const at::Tensor& spatial_shapes,
                               const at::Tensor& level_start_index,
                               const at::Tensor& sampling_locations,
                               const at::Tensor& attention_weights, int64_t im2col_step);
  static constexpr std::array<const char*, 6> kArgumentNames = {
      "value", "spatial_shapes", "level_start_index", "sampling_locations", "attention_weights",
      "im2col_step"};
  using BackwardSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor& grad_output, const at::Tensor& value, const at::Tensor& spatial_shapes,
      const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
      const at::Tensor& attention_weights, int64_t im2col_step, std::array<bool, 3> output_mask);
  // spatial_shapes and level_start_index are integer tensors, without gradients.
  static constexpr std::array<size_t, 3> kGradientArguments = {0, 3, 4};
  static constexpr std::array<size_t, 6> kBackwardArguments = {0, 1, 2, 3, 4, 5};
};

// The schemas' tensor arguments, as the C++ signatures take them: Tensor, and Tensor? (absent
// when std::nullopt).
template <typename Argument>
constexpr bool is_tensor_argument = std::is_same_v<std::decay_t<Argument>, at::Tensor>;

template <typename Argument>
constexpr bool is_optional_tensor_argument =
    std::is_same_v<std::decay_t<Argument>, std::optional<at::Tensor>>;

template <typename Op>
const c10::TypedOperatorHandle<typename Op::Signature>& forward_handle() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow((std::string("deformconv::") + Op::kName).c_str(), "")
          .template typed<typename Op::Signature>();
  return op;
}

template <typename Op>
const c10::TypedOperatorHandle<typename Op::BackwardSignature>& backward_handle() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow((std::string("deformconv::") + Op::kName + "_backward").c_str(), "")
          .template typed<typename Op::BackwardSignature>();
  return op;
}

}  // namespace deformconv
