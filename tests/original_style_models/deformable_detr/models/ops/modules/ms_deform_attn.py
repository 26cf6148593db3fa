"""Deformable DETR's attention module as its models/ops/modules/ms_deform_attn.py builds it: the
four linear layers, and the sampling locations handed to MSDeformAttnFunction.apply."""

import torch
import torch.nn.functional as F
from torch import nn

from ..functions import MSDeformAttnFunction


class MSDeformAttn(nn.Module):
    def __init__(self, d_model=256, n_levels=4, n_heads=8, n_points=4):
        super().__init__()
        self.im2col_step = 64
        self.d_model, self.n_levels = d_model, n_levels
        self.n_heads, self.n_points = n_heads, n_points
        self.sampling_offsets = nn.Linear(d_model, n_heads * n_levels * n_points * 2)
        self.attention_weights = nn.Linear(d_model, n_heads * n_levels * n_points)
        self.value_proj = nn.Linear(d_model, d_model)
        self.output_proj = nn.Linear(d_model, d_model)

    def forward(self, query, reference_points, input_flatten, input_spatial_shapes,
                input_level_start_index, input_padding_mask=None):
        N, queries, _ = query.shape
        value = self.value_proj(input_flatten)
        if input_padding_mask is not None:
            value = value.masked_fill(input_padding_mask[..., None], 0.0)
        value = value.view(N, input_flatten.shape[1], self.n_heads, -1)
        shape = (N, queries, self.n_heads, self.n_levels, self.n_points)
        offsets = self.sampling_offsets(query).view(*shape, 2)
        weights = self.attention_weights(query).view(N, queries, self.n_heads, -1)
        weights = F.softmax(weights, -1).view(shape)
        normaliser = torch.stack([input_spatial_shapes[..., 1], input_spatial_shapes[..., 0]], -1)
        locations = (reference_points[:, :, None, :, None, :]
                     + offsets / normaliser[None, None, None, :, None, :])
        output = MSDeformAttnFunction.apply(value, input_spatial_shapes, input_level_start_index,
                                            locations, weights, self.im2col_step)
        return self.output_proj(output)
