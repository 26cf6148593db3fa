"""Functional API over torch.ops.deformconv, and the fake (meta) kernels of the ops."""

from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor

from .onnx import dcnv3_in_standard_onnx_ops, dcnv4_in_standard_onnx_ops

IntOrPair = Union[int, Tuple[int, int], List[int]]


@torch.jit.unused
def _check_pair(name: str, value: IntOrPair) -> None:
    # Python only: under TorchScript the argument's type has been checked already.
    if (not isinstance(value, (tuple, list)) or len(value) != 2
            or not all(isinstance(v, int) for v in value)):
        raise ValueError(f"deform_conv2d(): expected {name} to be an int or a pair of ints, "
                         f"but got {value!r}")


def _pair(name: str, value: IntOrPair) -> List[int]:
    if isinstance(value, int):
        return [value, value]
    if not torch.jit.is_scripting():
        _check_pair(name, value)
    if isinstance(value, list):
        if len(value) != 2:
            raise ValueError("deform_conv2d(): expected " + name + " to be an int or a pair of "
                             "ints, but got a list of " + str(len(value)))
        return value
    return [value[0], value[1]]


@torch.jit.unused
def _in_onnx_export() -> bool:
    # Both ONNX exporters trace the model: the TorchScript-based one with torch.jit's tracer,
    # the torch.export-based one as a compilation. torch.onnx.is_in_onnx_export imports two
    # modules at every call, slow where the interpreter's caches have gone cold, as between the
    # layers of a model; so it is asked only while tracing.
    return ((torch.jit.is_tracing() or torch.compiler.is_compiling())
            and torch.onnx.is_in_onnx_export())


def deform_conv2d(
    input: Tensor,
    offset: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    stride: IntOrPair = 1,
    padding: IntOrPair = 0,
    dilation: IntOrPair = 1,
    mask: Optional[Tensor] = None,
    im2col_step: int = 0,
) -> Tensor:
    r"""Deformable convolution: DCN v1, or v2 ("modulated") when ``mask`` is given.

    The same call as ``torchvision.ops.deform_conv2d``; groups and offset groups follow from the
    shapes. For output pixel (n, o, ho, wo) and kernel tap k = i * kW + j in deform group g:

    .. math::
        out = bias_o + \sum_{c, i, j} weight_{o,c,i,j}\, mask_{n,g,k}\,
              \mathrm{bilinear}(input_{n,c},\; ho\,s_h - p_h + i\,d_h + \Delta y_{n,g,k},\;
                                         wo\,s_w - p_w + j\,d_w + \Delta x_{n,g,k})

    Args:
        input: (N, C_in, H, W).
        offset: (N, 2 * offset_groups * kH * kW, H_out, W_out); channel 2k of a deform group is
            the y displacement of tap k, channel 2k + 1 its x displacement.
        weight: (C_out, C_in / groups, kH, kW).
        bias: (C_out,) or None.
        stride, padding, dilation: an int or a (height, width) pair.
        mask: (N, offset_groups * kH * kW, H_out, W_out) modulation, or None for DCN v1.
        im2col_step: images per im2col block; 0 (the default) picks as many as fit in a
            64 MiB columns buffer. The result does not depend on it.

    Returns:
        (N, C_out, H_out, W_out) with H_out = (H + 2 p_h - (d_h (kH - 1) + 1)) // s_h + 1.
    """
    groups = 1
    offset_groups = 1
    if input.dim() == 4 and weight.dim() == 4 and offset.dim() == 4:
        # Inferred as torchvision does; a shape that does not fit is reported by the op itself.
        if weight.shape[1] > 0:
            groups = max(1, input.shape[1] // weight.shape[1])
        taps = weight.shape[2] * weight.shape[3]
        if taps > 0:
            offset_groups = max(1, offset.shape[1] // (2 * taps))
    return torch.ops.deformconv.deform_conv2d(
        input, offset, weight, mask, bias,
        _pair("stride", stride), _pair("padding", padding), _pair("dilation", dilation),
        groups, offset_groups, im2col_step,
    )


def _output_size(size, kernel: int, stride: int, pad: int, dilation: int):
    return (size + 2 * pad - (dilation * (kernel - 1) + 1)) // stride + 1


def _has_static_shape(tensor: Optional[Tensor]) -> bool:
    return tensor is None or all(isinstance(size, int) for size in tensor.shape)


def _on_meta(tensor: Optional[Tensor]) -> Optional[Tensor]:
    return None if tensor is None else torch.empty(tensor.shape, dtype=tensor.dtype,
                                                   device="meta")


def _check_devices(op: str, input: Tensor, **others: Optional[Tensor]) -> None:
    # The meta tensors below all sit on "meta"; the device check of the op is made here.
    for name, tensor in others.items():
        if tensor is not None and tensor.device != input.device:
            raise ValueError(f"{op}(): expected {name} to be on the device of input "
                             f"({input.device}), but got {tensor.device}")


def _check_arguments(grad_output, input, offset, weight, mask, bias, *rest) -> List[int]:
    """The op's own argument checks (C++, no tensor data read), on meta copies of the tensors
    and outside any fake mode, so that fake tensors are rejected exactly as real ones are.
    Returns the output shape."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return torch.ops.deformconv._check_arguments(
            *[_on_meta(t) for t in (grad_output, input, offset, weight, mask, bias)], *rest)


@torch.library.register_fake("deformconv::deform_conv2d")
def _deform_conv2d_fake(input, offset, weight, mask, bias, stride, padding, dilation, groups,
                        offset_groups, im2col_step):
    _check_devices("deform_conv2d", input, offset=offset, weight=weight, mask=mask, bias=bias)
    if all(_has_static_shape(t) for t in (input, offset, weight, mask, bias)):
        shape = _check_arguments(None, input, offset, weight, mask, bias, stride, padding,
                                 dilation, groups, offset_groups, im2col_step)
    else:
        # Symbolic sizes (dynamic shapes): the shape formula; the checks ran when the graph was
        # traced with concrete sizes, and run again in the real kernel.
        shape = (input.shape[0], weight.shape[0],
                 _output_size(input.shape[2], weight.shape[2], stride[0], padding[0],
                              dilation[0]),
                 _output_size(input.shape[3], weight.shape[3], stride[1], padding[1],
                              dilation[1]))
    return input.new_empty(shape)


@torch.library.register_fake("deformconv::deform_conv2d_backward")
def _deform_conv2d_backward_fake(grad_output, input, offset, weight, mask, stride, padding,
                                 dilation, groups, offset_groups, im2col_step, output_mask):
    _check_devices("deform_conv2d_backward", input, grad_output=grad_output, offset=offset,
                   weight=weight, mask=mask)
    if all(_has_static_shape(t) for t in (grad_output, input, offset, weight, mask)):
        _check_arguments(grad_output, input, offset, weight, mask, None, stride, padding,
                         dilation, groups, offset_groups, im2col_step)
    want_input, want_offset, want_weight, want_mask, want_bias = output_mask
    # As the real kernel: grad_input and grad_weight keep the memory format of input and
    # weight, grad_offset and grad_mask are contiguous.
    contiguous = torch.contiguous_format
    return (
        torch.empty_like(input) if want_input else None,
        torch.empty_like(offset, memory_format=contiguous) if want_offset else None,
        torch.empty_like(weight) if want_weight else None,
        torch.empty_like(mask, memory_format=contiguous)
        if want_mask and mask is not None else None,
        weight.new_empty((weight.shape[0],)) if want_bias else None,
    )


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
        if _in_onnx_export():
            return dcnv3_in_standard_onnx_ops(
                input, offset, mask, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w,
                dilation_h, dilation_w, group, group_channels, offset_scale, remove_center)
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
        if _in_onnx_export():
            return dcnv4_in_standard_onnx_ops(
                input, offset_mask, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w,
                dilation_h, dilation_w, group, group_channels, offset_scale, remove_center)
    return torch.ops.deformconv.dcnv4(
        input, offset_mask, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h,
        dilation_w, group, group_channels, float(offset_scale), im2col_step,
        bool(remove_center))


def _check_dcnv3_arguments(grad_output, input, offset, mask, *rest) -> List[int]:
    """dcnv3's own argument checks on meta copies, as _check_arguments does for
    deform_conv2d; those of dcnv4 when mask is None, offset being offset_mask."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return torch.ops.deformconv._check_dcnv3_arguments(
            *[_on_meta(t) for t in (grad_output, input, offset, mask)], *rest)


@torch.library.register_fake("deformconv::dcnv3")
def _dcnv3_fake(input, offset, mask, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w,
                dilation_h, dilation_w, group, group_channels, offset_scale, im2col_step,
                remove_center):
    _check_devices("dcnv3", input, offset=offset, mask=mask)
    scalars = (kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w,
               group, group_channels, offset_scale, im2col_step, remove_center)
    if all(_has_static_shape(t) for t in (input, offset, mask)):
        shape = _check_dcnv3_arguments(None, input, offset, mask, *scalars)
    else:
        shape = _dcnv3_output_shape(input, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w,
                                    dilation_h, dilation_w)
    return input.new_empty(shape)


@torch.library.register_fake("deformconv::dcnv3_backward")
def _dcnv3_backward_fake(grad_output, input, offset, mask, kernel_h, kernel_w, stride_h,
                         stride_w, pad_h, pad_w, dilation_h, dilation_w, group, group_channels,
                         offset_scale, im2col_step, remove_center, output_mask):
    _check_devices("dcnv3_backward", input, grad_output=grad_output, offset=offset, mask=mask)
    if all(_has_static_shape(t) for t in (grad_output, input, offset, mask)):
        _check_dcnv3_arguments(grad_output, input, offset, mask, kernel_h, kernel_w, stride_h,
                               stride_w, pad_h, pad_w, dilation_h, dilation_w, group,
                               group_channels, offset_scale, im2col_step, remove_center)
    contiguous = torch.contiguous_format
    want_input, want_offset, want_mask = output_mask
    return (
        torch.empty_like(input, memory_format=contiguous) if want_input else None,
        torch.empty_like(offset, memory_format=contiguous) if want_offset else None,
        torch.empty_like(mask, memory_format=contiguous) if want_mask else None,
    )


def _dcnv3_output_shape(input, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w,
                        dilation_h, dilation_w):
    return (input.shape[0],
            _output_size(input.shape[1], kernel_h, stride_h, pad_h, dilation_h),
            _output_size(input.shape[2], kernel_w, stride_w, pad_w, dilation_w),
            input.shape[3])


@torch.library.register_fake("deformconv::dcnv4")
def _dcnv4_fake(input, offset_mask, *scalars):
    _check_devices("dcnv4", input, offset_mask=offset_mask)
    if all(_has_static_shape(t) for t in (input, offset_mask)):
        shape = _check_dcnv3_arguments(None, input, offset_mask, None, *scalars)
    else:
        shape = _dcnv3_output_shape(input, *scalars[:8])
    return input.new_empty(shape)


@torch.library.register_fake("deformconv::dcnv4_backward")
def _dcnv4_backward_fake(grad_output, input, offset_mask, *scalars_and_output_mask):
    *scalars, output_mask = scalars_and_output_mask
    _check_devices("dcnv4_backward", input, grad_output=grad_output, offset_mask=offset_mask)
    if all(_has_static_shape(t) for t in (grad_output, input, offset_mask)):
        _check_dcnv3_arguments(grad_output, input, offset_mask, None, *scalars)
    contiguous = torch.contiguous_format
    want_input, want_offset_mask = output_mask
    return (
        torch.empty_like(input, memory_format=contiguous) if want_input else None,
        torch.empty_like(offset_mask, memory_format=contiguous) if want_offset_mask else None,
    )
