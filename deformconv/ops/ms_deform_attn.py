"""Multi-scale deformable attention (Deformable DETR's core op) and its fake kernels."""

from typing import List, Optional

import torch
from torch import Tensor

from ..onnx import ms_deform_attn_with_grid_sample
from ._common import _check_cuda_kernels, _has_static_shape, _in_onnx_export, _on_meta


def ms_deform_attn(
    value: Tensor,
    spatial_shapes: Tensor,
    level_start_index: Tensor,
    sampling_locations: Tensor,
    attention_weights: Tensor,
    im2col_step: int = 64,
) -> Tensor:
    r"""Multi-scale deformable attention, with the arguments of Deformable DETR's
    ``MSDeformAttnFunction.apply`` and mmcv's ``MultiScaleDeformableAttnFunction.apply``.

    For each query :math:`q` and head :math:`m`:

    .. math::
        \text{out}[n, q, m] = \sum_{l, p} a_{n q m l p}\,
            \text{bilinear}\big(\text{value}_l[n, :, m],\ x W_l - 0.5,\ y H_l - 0.5\big)

    with :math:`(x, y)` = ``sampling_locations[n, q, m, l, p]``: ``F.grid_sample``'s bilinear
    sampling with ``align_corners=False`` and zeros outside, each level on its own grid.

    Args:
        value: (N, S, M, D), the levels' pixels stacked along S = sum of H_l * W_l.
        spatial_shapes: (L, 2) int64, each level's (H_l, W_l).
        level_start_index: (L,) int64, where each level starts in S.
        sampling_locations: (N, Lq, M, L, P, 2), normalised (x, y): (0, 0) is the top-left
            corner of a level's top-left pixel, (1, 1) the bottom-right corner of its
            bottom-right one.
        attention_weights: (N, Lq, M, L, P), used as given (the modules apply the softmax).
        im2col_step: accepted for the originals' signature; the result and the memory do not
            depend on it.

    Returns:
        (N, Lq, M * D).
    """
    if not torch.jit.is_scripting():
        _check_cuda_kernels("ms_deform_attn", value.device)
        if _in_onnx_export():
            return ms_deform_attn_with_grid_sample(value, spatial_shapes, level_start_index,
                                                   sampling_locations, attention_weights)
    return torch.ops.deformconv.ms_deform_attn(value, spatial_shapes, level_start_index,
                                               sampling_locations, attention_weights,
                                               im2col_step)


def _check_ms_deform_attn_devices(value: Tensor, **others: Optional[Tensor]) -> None:
    # The meta copies below all sit on "meta": the device check of the op is made here.
    for name, tensor in others.items():
        if tensor is not None and tensor.device != value.device:
            raise ValueError(f"ms_deform_attn(): expected {name} to be on the device of value "
                             f"({value.device}), but got {tensor.device}")


def _check_ms_deform_attn_arguments(grad_output, value, spatial_shapes, level_start_index,
                                    sampling_locations, attention_weights,
                                    im2col_step) -> List[int]:
    """The op's own checks on meta copies, outside any fake mode, as
    _check_deform_conv2d_arguments does for deform_conv2d (whose docstring says why): the shapes
    and dtypes; the levels' sizes, which are data, are checked by the real kernel. Returns the
    output shape."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return torch.ops.deformconv._check_ms_deform_attn_arguments(
            *[_on_meta(t) for t in (grad_output, value, spatial_shapes, level_start_index,
                                    sampling_locations, attention_weights)], im2col_step)


def _all_static(*tensors: Optional[Tensor]) -> bool:
    return all(_has_static_shape(t) for t in tensors)


@torch.library.register_fake("deformconv::ms_deform_attn")
def _ms_deform_attn_fake(value, spatial_shapes, level_start_index, sampling_locations,
                         attention_weights, im2col_step):
    _check_ms_deform_attn_devices(value, spatial_shapes=spatial_shapes,
                                  level_start_index=level_start_index,
                                  sampling_locations=sampling_locations,
                                  attention_weights=attention_weights)
    if _all_static(value, spatial_shapes, level_start_index, sampling_locations,
                   attention_weights):
        shape = _check_ms_deform_attn_arguments(None, value, spatial_shapes, level_start_index,
                                                sampling_locations, attention_weights,
                                                im2col_step)
    else:
        # Symbolic sizes (dynamic shapes): the shape formula; the checks ran when the graph was
        # traced with concrete sizes, and run again in the real kernel.
        shape = (value.shape[0], sampling_locations.shape[1], value.shape[2] * value.shape[3])
    return value.new_empty(shape)


@torch.library.register_fake("deformconv::ms_deform_attn_backward")
def _ms_deform_attn_backward_fake(grad_output, value, spatial_shapes, level_start_index,
                                  sampling_locations, attention_weights, im2col_step,
                                  output_mask):
    _check_ms_deform_attn_devices(value, grad_output=grad_output, spatial_shapes=spatial_shapes,
                                  level_start_index=level_start_index,
                                  sampling_locations=sampling_locations,
                                  attention_weights=attention_weights)
    if _all_static(grad_output, value, spatial_shapes, level_start_index, sampling_locations,
                   attention_weights):
        _check_ms_deform_attn_arguments(grad_output, value, spatial_shapes, level_start_index,
                                        sampling_locations, attention_weights, im2col_step)
    want_value, want_locations, want_weights = output_mask
    return (torch.empty_like(value, memory_format=torch.contiguous_format) if want_value
            else None,
            torch.empty_like(sampling_locations, memory_format=torch.contiguous_format)
            if want_locations else None,
            torch.empty_like(attention_weights, memory_format=torch.contiguous_format)
            if want_weights else None)
