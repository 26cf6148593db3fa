"""Multi-scale deformable attention modules: Deformable DETR's MSDeformAttn, mmcv's
MultiScaleDeformableAttention and DCNv4's FlashDeformAttn, with the originals' submodules,
parameter initialisation, state_dict keys and forward arguments, on deformconv.ms_deform_attn."""

import math
import warnings
from typing import List, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from ..ops.ms_deform_attn import flash_deform_attn, ms_deform_attn


def _points_per_level(points: Union[int, Sequence[int]], levels: int) -> List[int]:
    """The modules' points: an int for as many on every level, or a count per level (as
    D-FINE's decoder_n_points gives them)."""
    if isinstance(points, int):
        return [points] * levels
    counts = list(points)
    if len(counts) != levels or any(not isinstance(count, int) or count < 0 for count in counts):
        raise ValueError(f"expected the points to be an int or {levels} counts of at least 0, "
                         f"one per level, but got {points}")
    return counts


def _sampling_offset_bias(heads: int, points_per_level: Sequence[int]) -> Tensor:
    """The originals' initial sampling offsets: head h looks along the direction at angle
    2 pi h / heads, scaled so that its larger coordinate is 1, and a level's k-th point k + 1
    times that far. Flattened as (heads, samples, 2), each level's points in turn (the
    originals' (heads, levels, points, 2) where every level has as many)."""
    angles = torch.arange(heads, dtype=torch.float32) * (2.0 * math.pi / heads)
    directions = torch.stack([angles.cos(), angles.sin()], -1)
    directions = directions / directions.abs().max(-1, keepdim=True).values
    steps = torch.cat([torch.arange(1, count + 1, dtype=torch.float32)
                       for count in points_per_level]).view(1, -1, 1)
    return (directions.view(heads, 1, 2) * steps).flatten()


def _last_size(tensor: Tensor) -> int:
    """tensor.shape[-1] as an int. Under torch.jit's tracer (the TorchScript-based ONNX
    exporter) a size is a tensor, whose conversion warns that the trace keeps the branch it took:
    as the originals' traced modules do, and as intended."""
    if not torch.jit.is_tracing():
        return tensor.shape[-1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        return int(tensor.shape[-1])


def _sampling_locations(reference_points: Tensor, offsets: Tensor, spatial_shapes: Tensor,
                        points: int) -> Tensor:
    """Where the samples lie, (N, Lq, M, L, P, 2), from the predicted offsets
    (N, Lq, M, L, P, 2) and the reference points (N, Lq, L, 2 or 4), as the originals place
    them: a point (x, y) moved by the offsets in pixels of each level; a box (x, y, w, h), its
    centre moved by offset / P * (w, h) / 2, so that offsets up to P reach its edges."""
    coordinates = _last_size(reference_points)
    if coordinates == 2:
        # (W, H) of each level: an offset of one unit is one pixel of that level.
        pixels = torch.stack([spatial_shapes[:, 1], spatial_shapes[:, 0]], -1)
        return (reference_points[:, :, None, :, None, :]
                + offsets / pixels[None, None, None, :, None, :])
    if coordinates == 4:
        return (reference_points[:, :, None, :, None, :2]
                + offsets / points * reference_points[:, :, None, :, None, 2:] * 0.5)
    raise ValueError("expected reference_points to end in 2 (x, y) or 4 (x, y, w, h) "
                     f"coordinates, but got shape {tuple(reference_points.shape)}")


def _listed_sampling_locations(reference_points: Tensor, offsets: Tensor,
                               spatial_shapes: Tensor, points_per_level: List[int]) -> Tensor:
    """_sampling_locations with a count of points per level: (N, Lq, M, samples, 2) from
    offsets of that shape, each sample placed on its own level's pixels or box, a box's
    offsets divided by its level's count of points (D-FINE's num_points_scale)."""
    levels = torch.cat([torch.full((count,), level, dtype=torch.long)
                        for level, count in enumerate(points_per_level)])
    levels = levels.to(reference_points.device)
    references = reference_points[:, :, None, levels]  # (N, Lq, 1, samples, 2 or 4)
    coordinates = _last_size(reference_points)
    if coordinates == 2:
        pixels = torch.stack([spatial_shapes[:, 1], spatial_shapes[:, 0]], -1)[levels]
        return references + offsets / pixels
    if coordinates == 4:
        counts = torch.tensor(points_per_level, dtype=offsets.dtype, device=offsets.device)
        return references[..., :2] + offsets / counts[levels, None] * references[..., 2:] * 0.5
    raise ValueError("expected reference_points to end in 2 (x, y) or 4 (x, y, w, h) "
                     f"coordinates, but got shape {tuple(reference_points.shape)}")


def _checked_sampling(sampling: str) -> str:
    if sampling not in ("bilinear", "nearest"):
        raise ValueError(f'expected sampling to be "bilinear" or "nearest", but got {sampling!r}')
    return sampling


def _add_attention(module: nn.Module, channels: int, value_channels: int, heads: int,
                   levels: int, points: Union[int, Sequence[int]], sampling: str) -> None:
    """Both originals' submodules, of the points' sum of samples per head, and the points and
    sampling as the forward uses them."""
    module.sampling = _checked_sampling(sampling)
    module.points_per_level = _points_per_level(points, levels)
    module.listed_points = not isinstance(points, int)
    samples = sum(module.points_per_level)
    module.sampling_offsets = nn.Linear(channels, heads * samples * 2)
    module.attention_weights = nn.Linear(channels, heads * samples)
    module.value_proj = nn.Linear(channels, value_channels)
    module.output_proj = nn.Linear(value_channels, channels)


def _init_attention(module: nn.Module, heads: int, points_per_level: Sequence[int]) -> None:
    """The originals' initialisation, the same in both: zero offset weights and the fanned-out
    offset bias, zero attention logits (uniform weights), Xavier projections with zero bias."""
    nn.init.zeros_(module.sampling_offsets.weight)
    with torch.no_grad():
        module.sampling_offsets.bias.copy_(_sampling_offset_bias(heads, points_per_level))
    nn.init.zeros_(module.attention_weights.weight)
    nn.init.zeros_(module.attention_weights.bias)
    for projection in (module.value_proj, module.output_proj):
        nn.init.xavier_uniform_(projection.weight)
        nn.init.zeros_(projection.bias)


def _projected_value(module: nn.Module, values: Tensor, padding_mask: Optional[Tensor],
                     heads: int) -> Tensor:
    """The originals' values, (N, S, heads, channels per head): projected, zero at padding."""
    value = module.value_proj(values)
    if padding_mask is not None:
        value = value.masked_fill(padding_mask[..., None], 0.0)
    return value.view(values.shape[0], values.shape[1], heads, -1)


def _attend(module: nn.Module, query: Tensor, values: Tensor, reference_points: Tensor,
            spatial_shapes: Tensor, level_start_index: Tensor, padding_mask: Optional[Tensor],
            heads: int, points_per_level: List[int], listed: bool, sampling: str,
            im2col_step: int) -> Tensor:
    """Both originals' attention, batch first: the values projected (zero at padding) and split
    into heads, the offsets and the weights' logits from the query, the op (which checks the
    values' rows against the levels' pixels, and normalises the logits by the originals'
    softmax over each head's samples), the output projection. `listed`: the points
    given per level, in the op's flat layout of samples; else P on every level, in its
    (L, P) layout."""
    N, queries, _ = query.shape
    value = _projected_value(module, values, padding_mask, heads)
    logits = module.attention_weights(query).view(N, queries, heads, -1)
    if listed:
        offsets = module.sampling_offsets(query).view(N, queries, heads, -1, 2)
        locations = _listed_sampling_locations(reference_points, offsets, spatial_shapes,
                                               points_per_level)
        output = ms_deform_attn(value, spatial_shapes, level_start_index, locations, logits,
                                im2col_step, points_per_level, sampling, softmax=True)
    else:
        points = points_per_level[0]
        shape = (N, queries, heads, len(points_per_level), points)
        offsets = module.sampling_offsets(query).view(*shape, 2)
        locations = _sampling_locations(reference_points, offsets, spatial_shapes, points)
        output = ms_deform_attn(value, spatial_shapes, level_start_index, locations,
                                logits.view(shape), im2col_step, None, sampling, softmax=True)
    return module.output_proj(output)


def _check_heads(module: str, d_model: int, n_heads: int) -> None:
    """Deformable DETR's and DCNv4's check of the heads: d_model a multiple of n_heads, and
    their warning where the channels per head are not a power of 2."""
    if d_model % n_heads != 0:
        raise ValueError(f"expected d_model ({d_model}) to be a multiple of n_heads "
                         f"({n_heads})")
    head_channels = d_model // n_heads
    if head_channels & (head_channels - 1) != 0:
        warnings.warn(f"{module}: channels per head (d_model / n_heads = {head_channels}) that "
                      "are not a power of 2 run less efficiently in the originals' CUDA "
                      "kernels", stacklevel=4)


def _init_deformable_detr_module(module: nn.Module, d_model: int, n_levels: int,
                                 n_heads: int, n_points: Union[int, Sequence[int]],
                                 sampling: str) -> None:
    """The constructor of Deformable DETR's module, which DCNv4's FlashDeformAttn shares: the
    heads checked, the originals' attributes and submodules, their initialisation."""
    _check_heads(type(module).__name__, d_model, n_heads)
    module.im2col_step = 64
    module.d_model = d_model
    module.n_levels = n_levels
    module.n_heads = n_heads
    module.n_points = n_points
    _add_attention(module, d_model, d_model, n_heads, n_levels, n_points, sampling)
    module._reset_parameters()


class MSDeformAttn(nn.Module):
    """Deformable DETR's multi-scale deformable attention module (its ``MSDeformAttn``): the
    same submodules, ``_reset_parameters`` and forward, so that its state_dict loads as it is.

    Args:
        d_model: channels of the queries and values; a multiple of ``n_heads``.
        n_levels: feature levels sampled.
        n_heads: attention heads.
        n_points: points sampled per head and level, or a list of them, one per level (as
            D-FINE's ``decoder_n_points``; the op's points_per_level).
        sampling: the op's, ``"bilinear"`` or ``"nearest"`` (RT-DETRv2's and D-FINE's
            ``method="discrete"``).
    """

    def __init__(self, d_model: int = 256, n_levels: int = 4, n_heads: int = 8,
                 n_points: Union[int, Sequence[int]] = 4, sampling: str = "bilinear"):
        super().__init__()
        _init_deformable_detr_module(self, d_model, n_levels, n_heads, n_points, sampling)

    def _reset_parameters(self) -> None:
        _init_attention(self, self.n_heads, self.points_per_level)

    def forward(self, query: Tensor, reference_points: Tensor, input_flatten: Tensor,
                input_spatial_shapes: Tensor, input_level_start_index: Tensor,
                input_padding_mask: Optional[Tensor] = None) -> Tensor:
        """query (N, Lq, C); reference_points (N, Lq, L, 2) normalised (x, y) or
        (N, Lq, L, 4) boxes (x, y, w, h); input_flatten (N, S, C), the levels' pixels;
        input_spatial_shapes (L, 2) and input_level_start_index (L,) int64;
        input_padding_mask (N, S), True where a pixel is padding. Returns (N, Lq, C)."""
        return _attend(self, query, input_flatten, reference_points, input_spatial_shapes,
                       input_level_start_index, input_padding_mask, self.n_heads,
                       self.points_per_level, self.listed_points, self.sampling,
                       self.im2col_step)


class MultiScaleDeformableAttention(nn.Module):
    """mmcv's multi-scale deformable attention module (``mmcv.ops.MultiScaleDeformableAttention``):
    the same submodules, initialisation, state_dict keys and forward keywords, without mmcv or
    mmengine. ``norm_cfg`` and ``init_cfg`` are accepted for the signature and unused, as in
    mmcv (whose ``init_weights`` is run here at construction).

    Args:
        embed_dims: channels of the queries and of the output.
        num_heads, num_levels, num_points: attention heads, feature levels, points per head
            and level (or a list of them, one per level).
        im2col_step: passed to the op (changes nothing there).
        dropout: dropout on the output, before the residual.
        batch_first: (batch, queries, channels) tensors rather than (queries, batch, channels).
        value_proj_ratio: the value projection's width, a fraction of embed_dims.
        sampling: the op's, ``"bilinear"`` or ``"nearest"``.
    """

    def __init__(self, embed_dims: int = 256, num_heads: int = 8, num_levels: int = 4,
                 num_points: Union[int, Sequence[int]] = 4, im2col_step: int = 64,
                 dropout: float = 0.1,
                 batch_first: bool = False, norm_cfg: Optional[dict] = None,
                 init_cfg: Optional[dict] = None, value_proj_ratio: float = 1.0,
                 sampling: str = "bilinear"):
        super().__init__()
        if embed_dims % num_heads != 0:
            raise ValueError(f"expected embed_dims ({embed_dims}) to be a multiple of "
                             f"num_heads ({num_heads})")
        value_dims = int(embed_dims * value_proj_ratio)
        if value_dims % num_heads != 0:
            raise ValueError(f"expected embed_dims * value_proj_ratio ({value_dims}) to be a "
                             f"multiple of num_heads ({num_heads})")
        self.norm_cfg = norm_cfg
        self.init_cfg = init_cfg
        self.dropout = nn.Dropout(dropout)
        self.batch_first = batch_first
        self.im2col_step = im2col_step
        self.embed_dims = embed_dims
        self.num_levels = num_levels
        self.num_heads = num_heads
        self.num_points = num_points
        _add_attention(self, embed_dims, value_dims, num_heads, num_levels, num_points,
                       sampling)
        self.init_weights()

    def init_weights(self) -> None:
        _init_attention(self, self.num_heads, self.points_per_level)

    def forward(self, query: Tensor, key: Optional[Tensor] = None,
                value: Optional[Tensor] = None, identity: Optional[Tensor] = None,
                query_pos: Optional[Tensor] = None, key_padding_mask: Optional[Tensor] = None,
                reference_points: Optional[Tensor] = None,
                spatial_shapes: Optional[Tensor] = None,
                level_start_index: Optional[Tensor] = None, **kwargs) -> Tensor:
        """query (Lq, N, C), or (N, Lq, C) with batch_first; value likewise (S rows; the query
        when None); identity, the residual (the query when None); query_pos added to the query;
        key_padding_mask (N, S), True at padding; reference_points (N, Lq, L, 2 or 4);
        spatial_shapes (L, 2), level_start_index (L,). `key` and other keywords are accepted
        and unused, as in mmcv. Returns dropout(attention) + identity, laid out as query."""
        if reference_points is None or spatial_shapes is None or level_start_index is None:
            raise ValueError("MultiScaleDeformableAttention: expected reference_points, "
                             "spatial_shapes and level_start_index")
        if value is None:
            value = query
        if identity is None:
            identity = query
        if query_pos is not None:
            query = query + query_pos
        if not self.batch_first:
            query = query.transpose(0, 1)
            value = value.transpose(0, 1)
        output = _attend(self, query, value, reference_points, spatial_shapes,
                         level_start_index, key_padding_mask, self.num_heads,
                         self.points_per_level, self.listed_points, self.sampling,
                         self.im2col_step)
        if not self.batch_first:
            output = output.transpose(0, 1)
        return self.dropout(output) + identity


class FlashDeformAttn(nn.Module):
    """DCNv4's flash deformable attention module (``DCNv4.FlashDeformAttn``): Deformable DETR's
    submodules, initialisation and forward arguments, the locations and the weights' logits
    packed in one operand of :func:`deformconv.flash_deform_attn`, which applies the softmax.
    Its state_dict is MSDeformAttn's. The locations keep the dtype of the values (the
    original rounds them to float16 for its kernel).

    Args:
        d_model: channels of the queries and values; a multiple of ``n_heads``.
        n_levels, n_heads, n_points: feature levels, attention heads, points per head and
            level.
    """

    def __init__(self, d_model: int = 256, n_levels: int = 4, n_heads: int = 8,
                 n_points: int = 4):
        super().__init__()
        _init_deformable_detr_module(self, d_model, n_levels, n_heads, n_points, "bilinear")

    def _reset_parameters(self) -> None:
        _init_attention(self, self.n_heads, self.points_per_level)

    def forward(self, query: Tensor, reference_points: Tensor, input_flatten: Tensor,
                input_spatial_shapes: Tensor, input_level_start_index: Tensor,
                input_padding_mask: Optional[Tensor] = None) -> Tensor:
        """MSDeformAttn's arguments and result."""
        N, queries, _ = query.shape
        value = _projected_value(self, input_flatten, input_padding_mask, self.n_heads)
        shape = (N, queries, self.n_heads, self.n_levels, self.n_points)
        offsets = self.sampling_offsets(query).view(*shape, 2)
        locations = _sampling_locations(reference_points, offsets, input_spatial_shapes,
                                        self.n_points)
        logits = self.attention_weights(query).view(N, queries, self.n_heads, -1)
        sampling_loc_attn = torch.cat([locations.flatten(-3), logits], -1)
        output = flash_deform_attn(value, input_spatial_shapes, input_level_start_index,
                                   sampling_loc_attn, self.im2col_step, self.n_points)
        return self.output_proj(output)
