"""Multi-scale deformable attention's readable reference (per level, F.grid_sample of that
level, weighted and summed), its operands, and the helpers its tests share."""

import torch
import torch.nn.functional as F

import deformconv
from branching import assert_close_at

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def ms_deform_attn_reference(value, spatial_shapes, level_start_index, sampling_locations,
                             attention_weights, points_per_level=None, sampling="bilinear",
                             softmax=False):
    """The op's definition written out: each level of each head sampled by grid_sample on
    2 * loc - 1 (align_corners=False, zeros outside), weighted, and summed over the levels and
    points. With points_per_level, level l's points are its stretch of the sample axis of
    sampling_locations (N, Lq, M, sum, 2) and attention_weights (N, Lq, M, sum). Sampling
    "nearest" reads each sample's pixel (nearest_rows) instead. With softmax, the weights are
    torch.softmax of the logits given, over each (query, head)'s samples. Differentiable in
    every floating operand (the locations of nearest sampling take no part in the graph)."""
    N, S, M, D = value.shape
    Lq = sampling_locations.shape[1]
    if points_per_level is None:
        L, P = sampling_locations.shape[3:5]
        points_per_level = [P] * L
        sampling_locations = sampling_locations.flatten(3, 4)
        attention_weights = attention_weights.flatten(3, 4)
    if softmax:
        attention_weights = torch.softmax(attention_weights, dim=-1)
    out = value.new_zeros(N * M, D, Lq)
    first = 0
    for (H, W), start, P in zip(spatial_shapes.tolist(), level_start_index.tolist(),
                                points_per_level):
        locations = sampling_locations[:, :, :, first:first + P]  # (N, Lq, M, P, 2)
        if sampling == "nearest":
            rows = nearest_rows(locations, H, W, start)
            picked = value[torch.arange(N).view(N, 1, 1, 1), rows,
                           torch.arange(M).view(1, 1, M, 1)]  # (N, Lq, M, P, D)
            sampled = picked.permute(0, 2, 4, 1, 3).reshape(N * M, D, Lq, P)
        else:
            image = value[:, start:start + H * W].permute(0, 2, 3, 1).reshape(N * M, D, H, W)
            grid = (2 * locations - 1).transpose(1, 2).reshape(N * M, Lq, P, 2)
            sampled = F.grid_sample(image, grid, mode="bilinear", padding_mode="zeros",
                                    align_corners=False)  # (N * M, D, Lq, P)
        weights = attention_weights[:, :, :, first:first + P].transpose(1, 2)
        out = out + (sampled * weights.reshape(N * M, 1, Lq, P)).sum(-1)
        first += P
    return out.view(N, M, D, Lq).permute(0, 3, 1, 2).reshape(N, Lq, M * D)


def nearest_rows(locations, height, width, start):
    """transformers' method="discrete" (multi_scale_deformable_attention_v2): the pixel
    int64(loc * size + 0.5) of each axis, in the locations' dtype, clamped into the level; as
    rows of value's S."""
    x = (locations[..., 0] * width + 0.5).to(torch.int64).clamp(0, width - 1)
    y = (locations[..., 1] * height + 0.5).to(torch.int64).clamp(0, height - 1)
    return start + y * width + x


def levels_of(shapes):
    spatial_shapes = torch.tensor(shapes, dtype=torch.int64).view(-1, 2)
    areas = spatial_shapes.prod(1)
    level_start_index = torch.cat([areas.new_zeros(1), areas.cumsum(0)[:-1]])
    return spatial_shapes, level_start_index, int(areas.sum())


def make_operands(shapes, batch=2, queries=5, heads=2, channels=3, points=2, spread=1.4,
                  dtype=torch.float64, seed=0, points_per_level=None):
    """Random operands; locations in (-0.2, 1.2) by default, so that some samples fall off their
    level on every side, and attention weights of both signs. With points_per_level, in its
    layout: (batch, queries, heads, sum of the points[, 2])."""
    generator = torch.Generator().manual_seed(seed)
    spatial_shapes, level_start_index, S = levels_of(shapes)
    L = spatial_shapes.shape[0]
    samples = (L, points) if points_per_level is None else (sum(points_per_level),)
    value = torch.randn(batch, S, heads, channels, generator=generator, dtype=torch.float64)
    locations = (torch.rand(batch, queries, heads, *samples, 2, generator=generator,
                            dtype=torch.float64) - 0.5) * spread + 0.5
    weights = torch.randn(batch, queries, heads, *samples, generator=generator,
                          dtype=torch.float64)
    return (value.to(dtype), spatial_shapes, level_start_index, locations.to(dtype),
            weights.to(dtype))


def assert_requested_gradients(requested, grads, expected, dtype):
    """The backward's (value, sampling_locations, attention_weights) gradients: those requested
    close to `expected` at dtype's precision, the others not made."""
    for name, want, grad, full in zip(("value", "sampling_locations", "attention_weights"),
                                      requested, grads, expected):
        if want:
            assert_close_at(grad, full, dtype, f"{name} of {requested}")
        else:
            assert grad is None


# The op's arguments after its tensors at their defaults (im2col_step, points_per_level,
# sampling, softmax): what the backward op takes between them and output_mask.
DEFAULT_OPTIONS = (64, [], "bilinear", False)


def call(operands, im2col_step=64):
    return deformconv.ms_deform_attn(*operands, im2col_step)


# Levels of different sizes, 1x1 among them; heads, channels (1, 3, 32, 33) and points.
GRID = [
    ([(4, 6), (2, 3), (1, 1)], 1, 1, 1),
    ([(5, 3)], 2, 3, 4),
    ([(3, 4), (1, 1), (2, 2)], 8, 32, 1),
    ([(6, 5), (3, 3)], 3, 33, 8),
    ([(1, 1), (1, 1)], 4, 3, 3),
    ([(2, 7), (7, 2), (4, 4), (1, 3)], 2, 1, 2),
]
