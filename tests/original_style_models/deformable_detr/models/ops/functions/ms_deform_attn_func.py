"""Deformable DETR's autograd function over its compiled extension, imported at import time as
the original's models/ops/functions/ms_deform_attn_func.py imports it."""

import MultiScaleDeformableAttention as MSDA
from torch.autograd import Function
from torch.autograd.function import once_differentiable


class MSDeformAttnFunction(Function):
    @staticmethod
    def forward(ctx, value, spatial_shapes, level_start_index, sampling_locations,
                attention_weights, im2col_step):
        ctx.im2col_step = im2col_step
        ctx.save_for_backward(value, spatial_shapes, level_start_index, sampling_locations,
                              attention_weights)
        return MSDA.ms_deform_attn_forward(value, spatial_shapes, level_start_index,
                                           sampling_locations, attention_weights, im2col_step)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        value, spatial_shapes, level_start_index, locations, weights = ctx.saved_tensors
        grad_value, grad_locations, grad_weights = MSDA.ms_deform_attn_backward(
            value, spatial_shapes, level_start_index, locations, weights, grad_output,
            ctx.im2col_step)
        return grad_value, None, None, grad_locations, grad_weights, None
