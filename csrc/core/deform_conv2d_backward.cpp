// The backward of deformable convolution (deform_conv2d.h): per block of images and window of
// output pixels, the columns for the weight gradient, the GEMMs, then the columns gradient taken
// back to the input, offset and mask.

#include <algorithm>
#include <vector>

#include "../infrastructure/argument_checks.h"
#include "../infrastructure/branch_trace.h"
#include "../infrastructure/tensor_views.h"
#include "deform_conv2d.h"
#include "deform_conv2d_gemms.h"
#include "deform_conv2d_tiling.h"

namespace deformconv {

namespace {

// The gradients the backward is asked for (output_mask; the mask's only where there is a mask).
struct WantedGradients {
  bool input, offset, weight, mask, bias;

  // The gradient of the columns, which the input, offset and mask gradients come from.
  bool columns() const { return input || offset || mask; }
  // The input values, which all but the input gradient read.
  bool input_values() const { return weight || offset || mask; }
};

// Whether empty_like(input) is channels-last, (N, H, W, C_in) in memory: it keeps a dense
// input's strides, so for a dense input, whether it is channels-last itself. Any other input gets
// its gradient through a channels-last buffer, whatever layout empty_like gives it.
bool is_channels_last(const Tensor& input) {
  return views::permute(input, {0, 2, 3, 1}).is_contiguous();
}

// What a backward makes once and uses for every block of images.
struct BackwardScratch {
  WorkSplit w;
  // The columns for the weight gradient, then (with bmm) the gradient of the columns.
  Tensor columns;
  // prepare_window's, for col2im.
  Tensor workspace;
  const WindowGemms* gemms;
  // gemms->weight's; the oneDNN backward takes it even for the weight gradient alone.
  Tensor weight;
  // The weight gradient in the order of weight_rows, summed over the windows
  // (weight_gradient_rows).
  Tensor grad_weight_rows;

  // Frees the buffers that only the windows use, once the last window is done.
  void release_window_buffers() {
    columns = Tensor();
    workspace = Tensor();
    weight = Tensor();
  }
};

BackwardScratch backward_scratch(const DeformConv2dLaunchers& launchers,
                                 const DeformConv2dGeometry& g, const WantedGradients& want,
                                 int64_t batch, int64_t im2col_step, const Tensor& input,
                                 const Tensor& weight, Tensor& grad_weight) {
  BackwardScratch scratch;
  scratch.w = split_work(g, batch, im2col_step, input.scalar_type(), launchers,
                         kMinBackwardWindowPixels);
  const WorkSplit& w = scratch.w;
  scratch.columns = columns_buffer(launchers, g, w, input);
  if (want.input) {
    scratch.workspace = window_workspace(launchers, g, w, input);
  }
  scratch.gemms = &launchers.gemms(g, input.scalar_type());
  record_branch(scratch.gemms->gradients_branch);
  record_split(w, batch, "deform_conv2d.backward.blocks", "deform_conv2d.backward.windows");
  scratch.weight = scratch.gemms->weight(launchers, g, weight, w);
  if (want.weight) {
    scratch.grad_weight_rows = weight_gradient_rows(w, grad_weight);
  }
  return scratch;
}

// One block of images: its operands, and where its gradients go (undefined where not wanted).
struct BackwardBlock {
  int64_t first;
  int64_t images;
  Tensor input;  // channels-last, (images, H, W, C_in)
  Tensor offset;
  Tensor mask;
  Tensor grad_output;  // (images, G, C_out / G, P)
  // Channels-last and zeroed, for col2im to add into: grad_input's own memory when grad_input
  // is channels-last (grad_input_in_place), else a block-sized buffer copied into grad_input
  // afterwards.
  Tensor grad_input;
  Tensor grad_offset;
  Tensor grad_mask;
};

BackwardBlock backward_block(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                             const WantedGradients& want, const WorkSplit& w, int64_t first,
                             int64_t images, const Tensor& grad_output, const Tensor& input,
                             const Tensor& offset, const Tensor& mask, bool grad_input_in_place,
                             const Tensor& grad_input, const Tensor& grad_offset,
                             const Tensor& grad_mask) {
  BackwardBlock block;
  block.first = first;
  block.images = images;
  if (want.input_values()) {
    block.input = channels_last_block(launchers, input, first, images);
  }
  block.offset = views::narrow(offset, 0, first, images);
  if (mask.defined()) {
    block.mask = views::narrow(mask, 0, first, images);
  }
  block.grad_output = views::view(views::narrow(grad_output, 0, first, images),
                                  {images, w.groups, w.out_per_group, w.pixels});
  if (want.input) {
    block.grad_input =
        grad_input_in_place
            ? views::permute(views::narrow(grad_input, 0, first, images), {0, 2, 3, 1})
            : launchers.scratch(input, {images, g.in_height, g.in_width, g.in_channels},
                                input.scalar_type());
    torch::stable::zero_(block.grad_input);
  }
  if (want.offset) {
    block.grad_offset = views::narrow(grad_offset, 0, first, images);
  }
  if (want.mask) {
    block.grad_mask = views::narrow(grad_mask, 0, first, images);
  }
  return block;
}

// The gradients of one window of a block: its columns (for the weight gradient), the GEMMs,
// then the columns gradient taken back to the input, offset and mask.
void backward_window(const DeformConv2dLaunchers& launchers, const DeformConv2dGeometry& g,
                     const WantedGradients& want, BackwardScratch& scratch, BackwardBlock& block,
                     const PixelWindow& window, bool deterministic) {
  // (images, G, C_out / G, window) inside grad_output: rows P apart.
  const Tensor grad_output_window =
      views::narrow(block.grad_output, 3, window.begin, window.pixels);
  // Prepared for col2im, which im2col then shares; im2col alone and the offset and mask
  // gradients locate their samples themselves.
  const WindowSampling sampling = want.input
                                      ? window_sampling(launchers, g, window, block.images,
                                                        block.offset, block.mask, scratch.workspace)
                                      : WindowSampling{block.offset, block.mask, Tensor()};
  if (want.weight) {
    launchers.im2col(g, window, block.images, block.input, sampling, scratch.columns);
  }
  const Tensor grad_columns =
      scratch.gemms->gradients(scratch.w, window, block.images, scratch.columns, grad_output_window,
                               scratch.weight, want.columns(), scratch.grad_weight_rows);
  if (want.columns()) {
    launchers.column_gradients(g, window, block.images, grad_columns, block.input, sampling,
                               block.grad_input, block.grad_offset, block.grad_mask, deterministic);
  }
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> deform_conv2d_backward(
    const DeformConv2dLaunchers& launchers, const Tensor& grad_output_arg, const Tensor& input_arg,
    const Tensor& offset_arg, const Tensor& weight_arg, const std::optional<Tensor>& mask_arg,
    const std::vector<int64_t>& stride, const std::vector<int64_t>& padding,
    const std::vector<int64_t>& dilation, int64_t groups, int64_t offset_groups,
    int64_t im2col_step, const std::vector<bool>& output_mask, bool deterministic) {
  check_output_mask("deform_conv2d_backward()", output_mask, 5);
  const DeformConv2dGeometry g = check_deform_conv2d_backward_arguments(
      grad_output_arg, input_arg, offset_arg, weight_arg, mask_arg, stride, padding, dilation,
      groups, offset_groups, im2col_step);
  const int64_t batch = input_arg.size(0);
  const Tensor grad_output = as_contiguous(grad_output_arg);
  const Tensor offset = as_contiguous(offset_arg);
  const Tensor mask = mask_arg.has_value() ? as_contiguous(*mask_arg) : Tensor();
  const WantedGradients want{output_mask[0], output_mask[1], output_mask[2],
                             output_mask[3] && mask.defined(), output_mask[4]};

  // The input and weight gradients keep the memory format of input and weight; the offset and
  // mask gradients are contiguous, and written in full, so they need no zero fill. col2im adds
  // into grad_input itself where that is channels-last; otherwise into a channels-last buffer,
  // copied into grad_input a block at a time. grad_input is then allocated only for the first
  // block's copy, after that block's channels-last input (and, after the last block, the
  // windows' buffers) is freed, so that grad_input, the buffer and the channels-last input are
  // never all live at once (c3-stride2: 33 MiB each).
  const bool grad_input_in_place = want.input && is_channels_last(input_arg);
  Tensor grad_input = grad_input_in_place ? torch::stable::empty_like(input_arg) : Tensor();
  Tensor grad_offset = want.offset ? new_contiguous(offset, offset.sizes()) : Tensor();
  Tensor grad_weight = want.weight ? torch::stable::empty_like(weight_arg) : Tensor();
  Tensor grad_mask = want.mask ? new_contiguous(mask, mask.sizes()) : Tensor();
  Tensor grad_bias =
      want.bias ? torch::stable::sum(grad_output, std::vector<int64_t>{0, 2, 3}) : Tensor();
  if (batch == 0 || !(want.columns() || want.weight)) {
    if (want.input) {
      grad_input = torch::stable::empty_like(input_arg);
      torch::stable::zero_(grad_input);
    }
    if (want.weight) {
      torch::stable::zero_(grad_weight);
    }
    return {grad_input, grad_offset, grad_weight, grad_mask, grad_bias};
  }

  BackwardScratch scratch =
      backward_scratch(launchers, g, want, batch, im2col_step, input_arg, weight_arg, grad_weight);
  const int64_t step = scratch.w.step;
  for (int64_t first = 0; first < batch; first += step) {
    BackwardBlock block = backward_block(
        launchers, g, want, scratch.w, first, std::min(step, batch - first), grad_output,
        input_arg, offset, mask, grad_input_in_place, grad_input, grad_offset, grad_mask);
    for (const PixelWindow& window : windows_of(scratch.w)) {
      backward_window(launchers, g, want, scratch, block, window, deterministic);
    }
    if (first + step >= batch) {
      scratch.release_window_buffers();
    }
    if (want.input && !grad_input_in_place) {
      block.input = Tensor();
      if (!grad_input.defined()) {
        grad_input = torch::stable::empty_like(input_arg);
      }
      copy_from_channels_last(launchers, block.grad_input,
                              views::narrow(grad_input, 0, block.first, block.images));
    }
  }
  if (want.weight) {
    store_weight_gradient(launchers, g, scratch.grad_weight_rows, grad_weight);
  }
  return {grad_input, grad_offset, grad_weight, grad_mask, grad_bias};
}

}  // namespace deformconv
