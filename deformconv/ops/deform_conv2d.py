"""deform_conv2d, DCN v1/v2 over torch.ops.deformconv, and its ops' fake, Autograd and Autocast
kernels."""

from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor

from .. import decompositions
from ..onnx import deform_conv2d_in_standard_ops, sampling_form
from . import _vmap
from ._autograd import register_gradients_and_autocast
from ._common import (_check_cuda_kernels, _in_onnx_export, _output_size, contiguous_like,
                      register_fake_kernels)

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
    stride_pair = _pair("stride", stride)
    padding_pair = _pair("padding", padding)
    dilation_pair = _pair("dilation", dilation)
    if not torch.jit.is_scripting():
        _check_cuda_kernels("deform_conv2d", input.device)
    return deform_conv2d_with_groups(input, offset, weight, mask, bias, stride_pair,
                                     padding_pair, dilation_pair, groups, offset_groups,
                                     im2col_step)


def deform_conv2d_with_groups(input: Tensor, offset: Tensor, weight: Tensor,
                              mask: Optional[Tensor], bias: Optional[Tensor], stride: List[int],
                              padding: List[int], dilation: List[int], groups: int,
                              offset_groups: int, im2col_step: int) -> Tensor:
    """The op, with its arguments as the schema has them; while an ONNX export asks for the
    standard form, its decomposition instead. deform_conv2d calls it with the groups inferred
    from the shapes, the modules with their own."""
    if not torch.jit.is_scripting():
        # The export flag first: a global read, where the tracing checks call into torch.
        if deform_conv2d_in_standard_ops() and _in_onnx_export():
            return decompositions.deform_conv2d(input, offset, weight, mask, bias, stride,
                                                padding, dilation, groups, offset_groups,
                                                im2col_step, sampling_form=sampling_form())
    return torch.ops.deformconv.deform_conv2d(input, offset, weight, mask, bias, stride,
                                              padding, dilation, groups, offset_groups,
                                              im2col_step)


def _deform_conv2d_output_shape(a):
    return (a.input.shape[0], a.weight.shape[0],
            _output_size(a.input.shape[2], a.weight.shape[2], a.stride[0], a.padding[0],
                         a.dilation[0]),
            _output_size(a.input.shape[3], a.weight.shape[3], a.stride[1], a.padding[1],
                         a.dilation[1]))


# As the real kernel: grad_input and grad_weight keep the memory format of input and weight,
# grad_offset and grad_mask are contiguous; no mask, no mask gradient.
register_fake_kernels(
    "deform_conv2d", _deform_conv2d_output_shape,
    [lambda a: torch.empty_like(a.input),
     contiguous_like("offset"),
     lambda a: torch.empty_like(a.weight),
     lambda a: None if a.mask is None else contiguous_like("mask")(a),
     lambda a: a.weight.new_empty((a.weight.shape[0],))])


# Gradients of input, offset, weight, mask and bias; the backward op takes every argument but
# bias, whose gradient needs only grad_output.
register_gradients_and_autocast(
    "deform_conv2d", gradient_arguments=range(5),
    batching_rules=(_vmap.deform_conv2d_rule, _vmap.deform_conv2d_backward_rule))
