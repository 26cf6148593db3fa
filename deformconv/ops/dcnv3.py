"""dcnv3 and dcnv4 (InternImage's and FlashInternImage's core ops) over torch.ops.deformconv,
and their ops' fake, Autograd and Autocast kernels."""


import torch
from torch import Tensor

from .. import decompositions
from ..onnx import sampling_form, tensorrt_plugin
from . import _vmap
from ._autograd import register_gradients_and_autocast
from ._common import (_check_cuda_kernels, _in_onnx_export, _output_size, contiguous_like,
                      register_fake_kernels)


def dcnv3(
    input: Tensor,
    offset: Tensor,
    mask: Tensor,
    kernel_h: int,
    kernel_w: int,
    stride_h: int,
    stride_w: int,
    pad_h: int,
    pad_w: int,
    dilation_h: int,
    dilation_w: int,
    group: int,
    group_channels: int,
    offset_scale: float,
    im2col_step: int = 0,
    remove_center: bool = False,
) -> Tensor:
    r"""DCNv3, the core op of InternImage, in the original ``DCNv3Function.apply``'s argument
    order. Channels-last, with no weights: for output pixel (n, ho, wo) and channel c of group g,

    .. math::
        out_{n,ho,wo,gD+c} = \sum_{p < P} mask_{n,ho,wo,gP+p}\,
                             \mathrm{bilinear}(input_{n,:,:,gD+c},\; y_p, x_p)

    where point p = i * kernel_h + j runs column by column over the kernel (the centre left
    out with ``remove_center``) and samples at
    x_p = wo s_w - p_w + c_w + (i d_w - c_w + dx_p) * offset_scale, c_w = d_w (k_w - 1) // 2,
    and likewise y_p: offset_scale scales the dilated grid about its centre and the offsets.

    Args:
        input: (N, H, W, group * group_channels).
        offset: (N, H_out, W_out, group * P * 2); channel 2 (g P + p) is the x displacement
            of point p of group g, the next one its y displacement.
        mask: (N, H_out, W_out, group * P), used as given (the DCNv3 module applies a softmax
            over each group's P values before calling the op).
        im2col_step: accepted for the originals' signature; any batch size works, and the
            result and the memory used do not depend on it.
        remove_center: drop the kernel's centre point, P = kernel_h * kernel_w - 1.

    Returns:
        (N, H_out, W_out, group * group_channels), H_out as for a convolution.
    """
    if not torch.jit.is_scripting():
        _check_cuda_kernels("dcnv3", input.device)
        # With the plugin node asked for, the op itself is exported.
        if _in_onnx_export() and not tensorrt_plugin("dcnv3"):
            return decompositions.dcnv3(
                input, offset, mask, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w,
                dilation_h, dilation_w, group, group_channels, offset_scale, im2col_step,
                remove_center, sampling_form=sampling_form())
    return torch.ops.deformconv.dcnv3(
        input, offset, mask, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h,
        dilation_w, group, group_channels, float(offset_scale), im2col_step, bool(remove_center))


def dcnv4(
    input: Tensor,
    offset_mask: Tensor,
    kernel_h: int,
    kernel_w: int,
    stride_h: int,
    stride_w: int,
    pad_h: int,
    pad_w: int,
    dilation_h: int,
    dilation_w: int,
    group: int,
    group_channels: int,
    offset_scale: float,
    im2col_step: int = 0,
    remove_center: bool = False,
) -> Tensor:
    r"""DCNv4, the core op of FlashInternImage, in the original ``DCNv4Function.apply``'s
    argument order: :func:`dcnv3` with the offsets and the mask packed in one tensor.

    Args:
        input: (N, H, W, group * group_channels).
        offset_mask: (N, H_out, W_out, C_pad), C_pad >= group * P * 3 (the DCNv4 module makes
            it a multiple of 8). Group g owns channels [3 P g, 3 P (g + 1)): channels
            3 P g + 2 p and 3 P g + 2 p + 1 are the x and y displacements of its point p,
            channel 3 P g + 2 P + p that point's mask value, used as given (no softmax).
            Channels from group * P * 3 on are padding: never read, and their gradient is zero.
        The other arguments are those of :func:`dcnv3`.

    Returns:
        (N, H_out, W_out, group * group_channels).
    """
    if not torch.jit.is_scripting():
        _check_cuda_kernels("dcnv4", input.device)
        if _in_onnx_export():
            return decompositions.dcnv4(
                input, offset_mask, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w,
                dilation_h, dilation_w, group, group_channels, offset_scale, im2col_step,
                remove_center, sampling_form=sampling_form())
    return torch.ops.deformconv.dcnv4(
        input, offset_mask, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h,
        dilation_w, group, group_channels, float(offset_scale), im2col_step,
        bool(remove_center))


def _dcnv3_output_shape(a):
    return (a.input.shape[0],
            _output_size(a.input.shape[1], a.kernel_h, a.stride_h, a.pad_h, a.dilation_h),
            _output_size(a.input.shape[2], a.kernel_w, a.stride_w, a.pad_w, a.dilation_w),
            a.input.shape[3])


register_fake_kernels("dcnv3", _dcnv3_output_shape,
                      [contiguous_like("input"), contiguous_like("offset"), contiguous_like("mask")])
# dcnv4's checks are dcnv3's without a mask, offset_mask in offset's place.
register_fake_kernels("dcnv4", _dcnv3_output_shape,
                      [contiguous_like("input"), contiguous_like("offset_mask")],
                      checks_of="dcnv3", renamed={"offset": "offset_mask"})


# Gradients of input, offset and mask (dcnv3), of input and offset_mask (dcnv4); the backward
# ops take every argument.
# Every operand and every gradient of DCNv3 and DCNv4 is per image: vmap folds into the batch.
register_gradients_and_autocast(
    "dcnv3", gradient_arguments=range(3),
    batching_rules=(_vmap.batch_folding(torch.ops.deformconv.dcnv3.default,
                                        ("input", "offset", "mask")),
                    _vmap.batch_folding(torch.ops.deformconv.dcnv3_backward.default,
                                        ("grad_output", "input", "offset", "mask"))))
register_gradients_and_autocast(
    "dcnv4", gradient_arguments=range(2),
    batching_rules=(_vmap.batch_folding(torch.ops.deformconv.dcnv4.default,
                                        ("input", "offset_mask")),
                    _vmap.batch_folding(torch.ops.deformconv.dcnv4_backward.default,
                                        ("grad_output", "input", "offset_mask"))))
