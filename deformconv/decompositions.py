"""Each op in core ATen operators, one formulation per op, with the op's own arguments: the
decompositions that torch.export's runtimes need, and the forms that the ONNX exports write in
standard operators.

    import deformconv
    program = torch.export.export(model, args)
    program = program.run_decompositions(deformconv.decompositions.table())

table() is torch's default table (core ATen) with these added: no ``deformconv::`` node is left,
and OpenVINO, ExecuTorch and the other consumers of core ATen graphs run the program.

Every form samples bilinearly in one of two sampling forms (SAMPLING_FORMS; table's
sampling_form, each function's keyword of that name):

- "grid_sample": ``F.grid_sample`` (``aten.grid_sampler_2d``, ONNX's GridSample), whose zero
  padding and ``align_corners=False`` are the ops' convention exactly: a corner outside the
  image counts zero, and a sample past a pixel of the border gets nothing;
- "gather": the same sampling as index arithmetic (``_gathered``): each of the four corners
  gathered by its flat index (``aten.gather``, ONNX's GatherElements) with its weight, zero
  outside. No GridSample: for the runtimes that lack it or miscompile it (Core ML, TensorRT).

The positions are worked out in at least float32 and sampled in it: half-precision positions
would be off by a fraction of a pixel, and the ops accumulate half-precision operands in
float32 too. Only the forward is decomposed; autograd differentiates these forms where a
backward is needed.
"""

import functools
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def _pixel_centres(positions: Tensor, size: int) -> Tensor:
    # With align_corners=False, grid_sample reads pixel x at the normalised (2 x + 1) / W - 1.
    return (2 * positions + 1) / size - 1


SAMPLING_FORMS = ("grid_sample", "gather")


def _gathered(images: Tensor, grid: Tensor) -> Tensor:
    """grid_sample's bilinear sampling of images (B, C, H, W) at grid (B, Hg, Wg, 2), with zero
    padding and align_corners=False, as index arithmetic: (B, C, Hg, Wg). A corner outside the
    image, or of a position that is not finite, has weight zero and reads pixel 0 (selected
    away with torch.where rather than multiplied, which would keep a NaN)."""
    B, C, H, W = images.shape
    Hg, Wg = grid.shape[1], grid.shape[2]
    x = ((grid[..., 0] + 1) * W - 1) / 2
    y = ((grid[..., 1] + 1) * H - 1) / 2
    x0, y0 = torch.floor(x), torch.floor(y)
    fx, fy = x - x0, y - y0
    flat = images.reshape(B, C, H * W)
    out = images.new_zeros(B, C, Hg * Wg)
    # Each corner row's and column's test, made once for the two corners that share it.
    rows = [(row, (row >= 0) & (row <= H - 1), weight)
            for row, weight in ((y0, 1 - fy), (y0 + 1, fy))]
    columns = [(column, (column >= 0) & (column <= W - 1), weight)
               for column, weight in ((x0, 1 - fx), (x0 + 1, fx))]
    for row, row_inside, weight_y in rows:
        for column, column_inside, weight_x in columns:
            inside = row_inside & column_inside
            index = torch.where(inside, row * W + column, torch.zeros_like(row))
            index = index.to(torch.int64).reshape(B, 1, Hg * Wg).expand(B, C, Hg * Wg)
            weight = torch.where(inside, weight_y * weight_x, torch.zeros_like(weight_x))
            out = out + flat.gather(2, index) * weight.reshape(B, 1, Hg * Wg)
    return out.reshape(B, C, Hg, Wg)


def _sampled(images: Tensor, grid: Tensor, sampling_form: str) -> Tensor:
    if sampling_form == "gather":
        return _gathered(images, grid)
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros",
                         align_corners=False)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def deform_conv2d(input: Tensor, offset: Tensor, weight: Tensor, mask: Optional[Tensor],
                  bias: Optional[Tensor], stride: List[int], padding: List[int],
                  dilation: List[int], groups: int, offset_groups: int,
                  im2col_step: int = 0, *, sampling_form: str = "grid_sample") -> Tensor:
    """DCN v1/v2 (torch.ops.deformconv.deform_conv2d's arguments; im2col_step has no effect):
    each deform group's channels an image that grid_sample samples at every tap and output
    pixel at once, the samples weighted by the mask, then one batched matrix product per
    convolution group with the weight, as im2col and a GEMM."""
    N, C, H, W = input.shape
    C_out, C_per_group, kernel_h, kernel_w = weight.shape
    G, K = offset_groups, kernel_h * kernel_w
    Ho, Wo = offset.shape[2], offset.shape[3]
    dtype = _compute_dtype(input.dtype)
    options = dict(dtype=dtype, device=input.device)
    # Tap k = i kernel_w + j of the dilated grid; from arange rather than a Python list, which a
    # traced export would record as a constant.
    tap_y = (torch.arange(kernel_h, **options) * dilation[0]).repeat_interleave(kernel_w)
    tap_x = (torch.arange(kernel_w, **options) * dilation[1]).repeat(kernel_h)
    rows = torch.arange(Ho, **options) * stride[0] - padding[0]
    cols = torch.arange(Wo, **options) * stride[1] - padding[1]
    # Images and deform groups on one axis: no tensor of rank above 5 (Core ML's limit).
    displacement = offset.reshape(N * G, K, 2, Ho, Wo).to(dtype)
    y = rows.view(1, 1, -1, 1) + tap_y.view(1, -1, 1, 1) + displacement[:, :, 0]
    x = cols.view(1, 1, 1, -1) + tap_x.view(1, -1, 1, 1) + displacement[:, :, 1]
    grid = torch.stack([_pixel_centres(x, W), _pixel_centres(y, H)], dim=-1)
    images = input.to(dtype).reshape(N * G, C // G, H, W)
    # (N G, C / G, K, Ho Wo)
    samples = _sampled(images, grid.reshape(N * G, K, Ho * Wo, 2), sampling_form)
    if mask is not None:
        samples = samples * mask.to(dtype).reshape(N * G, 1, K, Ho * Wo)
    # The columns of each convolution group, rows (channel, tap) as the weight's.
    columns = samples.reshape(N, groups, C_per_group * K, Ho * Wo)
    kernels = weight.to(dtype).reshape(groups, C_out // groups, C_per_group * K)
    out = torch.matmul(kernels, columns).reshape(N, C_out, Ho, Wo)
    if bias is not None:
        out = out + bias.to(dtype).view(1, -1, 1, 1)
    return out.to(input.dtype)


def _dcnv3_points(input: Tensor, offset: Tensor, mask: Tensor, Ho: int, Wo: int,
                  kernel_h: int, kernel_w: int,
                  stride_h: int, stride_w: int, pad_h: int, pad_w: int, dilation_h: int,
                  dilation_w: int, group: int, group_channels: int, offset_scale: float,
                  remove_center: bool, sampling_form: str) -> Tensor:
    """DCNv3 and DCNv4 (docs/dcnv3_dcnv4.md) over offset (N, H_out W_out, group, P, 2) and
    mask (N, H_out W_out, group, P), the layouts of both ops viewed per pixel, group and point:
    the output's rows and columns on one axis, so that no tensor has a rank above 5 (Core ML's
    limit). Each group is an image of group_channels channels that grid_sample samples at all
    its points at once."""
    N, H, W = input.shape[0], input.shape[1], input.shape[2]
    G, D = group, group_channels
    dtype = _compute_dtype(input.dtype)
    options = dict(dtype=dtype, device=input.device)
    # The points column by column (i along x outer), the centre left out with remove_center.
    tap_i = torch.arange(kernel_w, **options).repeat_interleave(kernel_h)
    tap_j = torch.arange(kernel_h, **options).repeat(kernel_w)
    if remove_center:
        centre = kernel_w // 2 * kernel_h + kernel_h // 2
        tap_i = torch.cat([tap_i[:centre], tap_i[centre + 1:]])
        tap_j = torch.cat([tap_j[:centre], tap_j[centre + 1:]])
    P = kernel_h * kernel_w - int(remove_center)
    grid_x = tap_i * dilation_w
    grid_y = tap_j * dilation_h
    centre_w = dilation_w * (kernel_w - 1) // 2
    centre_h = dilation_h * (kernel_h - 1) // 2
    base_x = torch.arange(Wo, **options) * stride_w + (centre_w - pad_w - centre_w * offset_scale)
    base_y = torch.arange(Ho, **options) * stride_h + (centre_h - pad_h - centre_h * offset_scale)
    # Output pixel (row, column) at row Wo + column of the flattened axis.
    base_x, base_y = base_x.repeat(Ho), base_y.repeat_interleave(Wo)
    x = base_x.view(1, -1, 1, 1) + (grid_x + offset[..., 0].to(dtype)) * offset_scale
    y = base_y.view(1, -1, 1, 1) + (grid_y + offset[..., 1].to(dtype)) * offset_scale
    grid = torch.stack([_pixel_centres(x, W), _pixel_centres(y, H)], dim=-1)
    grid = grid.permute(0, 2, 1, 3, 4).reshape(N * G, Ho * Wo, P, 2)
    images = input.to(dtype).reshape(N, H, W, G, D).permute(0, 3, 4, 1, 2)
    samples = _sampled(images.reshape(N * G, D, H, W), grid, sampling_form)  # (N G, D, Ho Wo, P)
    weights = mask.to(dtype).permute(0, 2, 1, 3).reshape(N * G, 1, Ho * Wo, P)
    out = (samples * weights).sum(dim=-1)
    out = out.reshape(N, G, D, Ho, Wo).permute(0, 3, 4, 1, 2).reshape(N, Ho, Wo, G * D)
    return out.to(input.dtype)


def dcnv3(input: Tensor, offset: Tensor, mask: Tensor, kernel_h: int, kernel_w: int,
          stride_h: int, stride_w: int, pad_h: int, pad_w: int, dilation_h: int,
          dilation_w: int, group: int, group_channels: int, offset_scale: float,
          im2col_step: int = 0, remove_center: bool = False, *,
          sampling_form: str = "grid_sample") -> Tensor:
    """DCNv3 (torch.ops.deformconv.dcnv3's arguments; im2col_step has no effect)."""
    N, Ho, Wo = offset.shape[0], offset.shape[1], offset.shape[2]
    P = kernel_h * kernel_w - int(remove_center)
    return _dcnv3_points(
        input, offset.reshape(N, Ho * Wo, group, P, 2), mask.reshape(N, Ho * Wo, group, P),
        Ho, Wo, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w,
        group, group_channels, offset_scale, remove_center, sampling_form)


def dcnv4(input: Tensor, offset_mask: Tensor, kernel_h: int, kernel_w: int, stride_h: int,
          stride_w: int, pad_h: int, pad_w: int, dilation_h: int, dilation_w: int, group: int,
          group_channels: int, offset_scale: float, im2col_step: int = 0,
          remove_center: bool = False, *, sampling_form: str = "grid_sample") -> Tensor:
    """DCNv4 (torch.ops.deformconv.dcnv4's arguments; im2col_step has no effect): the packed
    offsets and mask sliced out of offset_mask, its padding channels left unread."""
    N, Ho, Wo = offset_mask.shape[0], offset_mask.shape[1], offset_mask.shape[2]
    P = kernel_h * kernel_w - int(remove_center)
    packed = offset_mask[..., :3 * group * P].reshape(N, Ho * Wo, group, 3 * P)
    return _dcnv3_points(
        input, packed[..., :2 * P].reshape(N, Ho * Wo, group, P, 2), packed[..., 2 * P:],
        Ho, Wo, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w,
        group, group_channels, offset_scale, remove_center, sampling_form)


def ms_deform_attn(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor,
                   sampling_locations: Tensor, attention_weights: Tensor,
                   im2col_step: int = 64, points_per_level: Sequence[int] = (),
                   sampling: str = "bilinear", softmax: bool = False, *,
                   sampling_form: str = "grid_sample") -> Tensor:
    """Multi-scale deformable attention (torch.ops.deformconv.ms_deform_attn's arguments;
    im2col_step has no effect; docs/ms_deform_attn.md): each level of each head an image of D
    channels, sampled at 2 loc - 1 (the op's locations are normalised already), weighted and
    summed over the levels and points. The levels' sizes and starts are read from the index
    tensors: torch.export makes them symbols of the graph, and a traced export (TorchScript's)
    records the sizes it saw as constants. With points_per_level, level l's points are its
    stretch of the locations' and weights' sample axis. Sampling "nearest" gathers each
    sample's pixel by its index instead (_nearest_samples): no GridSample. With softmax, the
    weights are logits, normalised over each (query, head)'s samples (a Softmax node)."""
    N, S, M, D = value.shape
    Lq, L = sampling_locations.shape[1], spatial_shapes.shape[0]
    dtype = _compute_dtype(value.dtype)
    if softmax:
        logits = attention_weights.to(dtype)
        attention_weights = logits.flatten(3).softmax(-1).view(logits.shape)
    first_points = [sum(points_per_level[:level]) for level in range(len(points_per_level))]

    def level_samples(level):
        """The level's (locations, weights, points): a slice of the locations' level axis, or,
        with points_per_level, of their sample axis."""
        if len(points_per_level) == 0:
            return (sampling_locations[:, :, :, level], attention_weights[:, :, :, level],
                    sampling_locations.shape[4])
        first, P = first_points[level], points_per_level[level]
        return sampling_locations.narrow(3, first, P), attention_weights.narrow(3, first, P), P

    with warnings.catch_warnings():
        # torch.jit's tracer warns that the lists become constants: that is what the
        # TorchScript-based exporter is documented to do with the levels' sizes.
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        sizes: List[List[int]] = spatial_shapes.tolist()
        starts: List[int] = level_start_index.tolist()
    output = value.new_zeros(N * M, D, Lq, dtype=dtype)
    for level in range(L):
        height, width, start = sizes[level][0], sizes[level][1], starts[level]
        if torch.compiler.is_compiling():
            # Under torch.export the sizes and starts are unbacked symbols: the checks tell it
            # what the op's own checks guarantee, so that slicing and reshaping by them need no
            # guess.
            torch._check(height >= 1)
            torch._check(width >= 1)
            torch._check(start >= 0)
            torch._check(start + height * width <= S)
        image = value.narrow(1, start, height * width).to(dtype).permute(0, 2, 3, 1)
        image = image.reshape(N * M, D, height, width)
        locations, weights, P = level_samples(level)
        if len(points_per_level) > 0 and P == 0:
            continue
        if sampling == "nearest":
            samples = _nearest_samples(image, locations, spatial_shapes[level])
        else:
            grid = (2 * locations.to(dtype) - 1).transpose(1, 2)
            samples = _sampled(image, grid.reshape(N * M, Lq, P, 2),
                               sampling_form)  # (N M, D, Lq, P)
        weights = weights.to(dtype).transpose(1, 2)
        output = output + (samples * weights.reshape(N * M, 1, Lq, P)).sum(dim=-1)
    output = output.view(N, M, D, Lq).permute(0, 3, 1, 2).reshape(N, Lq, M * D)
    return output.to(value.dtype)


def _nearest_samples(image: Tensor, locations: Tensor, shape: Tensor) -> Tensor:
    """Sampling "nearest" of one level (N M, D, H, W) at locations (N, Lq, M, P, 2), as
    transformers' multi_scale_deformable_attention_v2 with method="discrete": each axis's pixel
    (loc * size + 0.5) in the locations' dtype, converted to int64 (toward zero) and clamped
    into the level; (N M, D, Lq, P) gathered by index. `shape` is the level's (H, W)."""
    N, Lq, M, P, _ = locations.shape
    # Not shape.flip(0): Core ML's converter refuses the flip's constant (a negative stride).
    width_height = torch.stack([shape[1], shape[0]])
    pixel = (locations * width_height.to(locations.dtype) + 0.5).to(torch.int64)
    # maximum, not clamp: Core ML's clamp takes floats only.
    pixel = torch.minimum(torch.maximum(pixel, torch.zeros_like(pixel)), width_height - 1)
    index = (pixel[..., 1] * width_height[0] + pixel[..., 0]).transpose(1, 2)  # (N, M, Lq, P)
    flat = image.flatten(2)  # (N M, D, H W)
    index = index.reshape(N * M, 1, Lq * P).expand(-1, flat.shape[1], -1)
    return flat.gather(2, index).reshape(N * M, flat.shape[1], Lq, P)


def table(sampling_form: str = "grid_sample") -> Dict[Any, Callable]:
    """torch.export's default decomposition table (core ATen) with each deformconv op's
    decomposition, for ``ExportedProgram.run_decompositions``, sampling in `sampling_form`
    ("grid_sample" or "gather")."""
    if sampling_form not in SAMPLING_FORMS:
        raise ValueError(f"decompositions.table(): expected sampling_form to be one of "
                         f"{SAMPLING_FORMS}, but got {sampling_form!r}")
    decompositions = torch.export.default_decompositions()
    ops = torch.ops.deformconv
    for op, form in ((ops.deform_conv2d, deform_conv2d), (ops.dcnv3, dcnv3),
                     (ops.dcnv4, dcnv4), (ops.ms_deform_attn, ms_deform_attn)):
        decompositions[op.default] = functools.partial(form, sampling_form=sampling_form)
    return decompositions
