"""Multi-scale deformable attention (Deformable DETR's core op) and its ops' fake, Autograd and
Autocast kernels."""


from typing import List, Optional

import torch
from torch import Tensor

from .. import decompositions, tensorrt_plugins
from ..onnx import sampling_form, tensorrt_plugin
from . import _vmap
from ._autograd import register_gradients_and_autocast
from ._common import (_check_cuda_kernels, _in_onnx_export, contiguous_like,
                      register_fake_kernels)


def ms_deform_attn(
    value: Tensor,
    spatial_shapes: Tensor,
    level_start_index: Tensor,
    sampling_locations: Tensor,
    attention_weights: Tensor,
    im2col_step: int = 64,
    points_per_level: Optional[List[int]] = None,
    sampling: str = "bilinear",
    softmax: bool = False,
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
        attention_weights: (N, Lq, M, L, P), used as given (the modules apply the softmax), or
            with ``softmax=True`` the logits.
        im2col_step: accepted for the originals' signature; the result and the memory do not
            depend on it.
        points_per_level: each level's number of points, where they differ (RT-DETRv2's,
            D-FINE's and DEIMv2's decoders; transformers' ``num_points_list``), or None for P on
            every level. With a list, sampling_locations is (N, Lq, M, sum(points_per_level), 2)
            and attention_weights (N, Lq, M, sum(points_per_level)), level 0's points first.
        sampling: ``"bilinear"``, or ``"nearest"``: transformers'
            ``multi_scale_deformable_attention_v2(..., method="discrete")`` (RT-DETRv2, DEIM),
            each axis's pixel ``int64(loc * W + 0.5)`` clamped into the level, the locations
            getting no gradient (value and attention_weights do).
        softmax: whether attention_weights are logits, normalised by a softmax over each
            (query, head)'s L * P (or sum(points_per_level)) samples inside the op, in float32
            for float16 and bfloat16 (DCNv4's FlashDeformAttn, deformops' ``method="softmax"``);
            the gradient is then the logits'.

    Returns:
        (N, Lq, M * D).
    """
    points: List[int] = [] if points_per_level is None else points_per_level
    if not torch.jit.is_scripting():
        _check_cuda_kernels("ms_deform_attn", value.device)
        if _in_onnx_export():
            if not tensorrt_plugin("ms_deform_attn"):
                return decompositions.ms_deform_attn(value, spatial_shapes, level_start_index,
                                                     sampling_locations, attention_weights,
                                                     im2col_step, points, sampling, softmax,
                                                     sampling_form=sampling_form())
            # The plugin node; what it cannot take (nearest) reaches the op's translation,
            # which refuses it.
            if sampling == "bilinear":
                locations, weights = tensorrt_plugins.ms_deform_attn_plugin_operands(
                    sampling_locations, attention_weights, spatial_shapes.shape[0], points,
                    softmax)
                return torch.ops.deformconv.ms_deform_attn(
                    value, spatial_shapes, level_start_index, locations, weights, im2col_step)
    return torch.ops.deformconv.ms_deform_attn(value, spatial_shapes, level_start_index,
                                               sampling_locations, attention_weights,
                                               im2col_step, points, sampling, softmax)


def flash_deform_attn(value: Tensor, value_spatial_shapes: Tensor,
                      value_level_start_index: Tensor, sampling_loc_attn: Tensor,
                      im2col_step: int = 64, K: int = 8) -> Tensor:
    """DCNv4's flash deformable attention (``FlashDeformAttnFunction.apply``, the same
    positional arguments): multi-scale deformable attention with K points on each of the L
    levels, the locations and the weights' logits packed in one operand, the softmax in the op.

    Args:
        value: (N, S, M, D), as ms_deform_attn's.
        value_spatial_shapes, value_level_start_index: ms_deform_attn's spatial_shapes and
            level_start_index.
        sampling_loc_attn: (N, Lq, M, 3 * L * K): each head's L * K locations (x, y), level by
            level, then its L * K logits. Cast to value's dtype (the original's kernel runs in
            float16 under its autocast).
        im2col_step: accepted for the original's signature.
        K: points per level.

    Returns:
        (N, Lq, M * D).
    """
    N, Lq, M, packed = sampling_loc_attn.shape
    L = value_spatial_shapes.shape[0]
    if packed != 3 * L * K:
        raise ValueError(f"flash_deform_attn(): expected sampling_loc_attn's last dimension to "
                         f"be 3 * levels * K = {3 * L * K} ({L} levels, K={K}: the locations "
                         f"then the logits), but got {packed}")
    packed_operand = sampling_loc_attn.to(value.dtype)
    locations = packed_operand[..., :2 * L * K].reshape(N, Lq, M, L, K, 2)
    logits = packed_operand[..., 2 * L * K:].reshape(N, Lq, M, L, K)
    return ms_deform_attn(value, value_spatial_shapes, value_level_start_index, locations,
                          logits, im2col_step, softmax=True)


# The checks read the levels' sizes and starts on real tensors only; on the meta copies, the
# shapes and dtypes. The real kernel checks the sizes against value.
register_fake_kernels(
    "ms_deform_attn",
    lambda a: (a.value.shape[0], a.sampling_locations.shape[1],
               a.value.shape[2] * a.value.shape[3]),
    [contiguous_like("value"), contiguous_like("sampling_locations"),
     contiguous_like("attention_weights")])


# Gradients of value, sampling_locations and attention_weights (spatial_shapes and
# level_start_index are integer tensors).
register_gradients_and_autocast(
    "ms_deform_attn", gradient_arguments=(0, 3, 4),
    batching_rules=(_vmap.batch_folding(torch.ops.deformconv.ms_deform_attn.default,
                                        ("value", "sampling_locations", "attention_weights")),
                    _vmap.batch_folding(torch.ops.deformconv.ms_deform_attn_backward.default,
                                        ("grad_output", "value", "sampling_locations",
                                         "attention_weights"))))
