"""Export to standard ONNX operators (opset 19).

    import deformconv.onnx
    deformconv.onnx.export_onnx(model, (x,), "model.onnx")                 # torch.export based
    deformconv.onnx.export_onnx(model, (x,), "model.onnx", dynamo=False)   # TorchScript based

deform_conv2d maps onto DeformConv(X, W, offset, B, mask) one to one: ONNX uses the same offset
layout (y, x per tap, deform groups outermost), the same zero-outside bilinear sampling and the
same mask, so the exported graph computes what PyTorch computes. im2col_step is an execution
detail and has no ONNX counterpart.

ONNX has no DCNv3 or DCNv4 operator. While an export runs, deformconv.dcnv3 and
deformconv.dcnv4 compute through dcnv3_with_grid_sample instead, in standard operators only
(GridSample, which samples bilinearly with zeros outside as the ops do, then Mul and
ReduceSum), which both exporters translate.

ONNX has no multi-scale deformable attention operator either: under export,
deformconv.ms_deform_attn computes through ms_deform_attn_with_grid_sample, one GridSample per
level. The torch.export-based exporter reads the levels' sizes from spatial_shapes in the
graph; the TorchScript-based one, a tracer, records the sizes it saw as constants.
"""

import warnings
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

OPSET = 19


def _deform_conv2d_to_onnx(input, offset, weight, mask, bias, stride, padding, dilation,
                           groups, offset_groups, im2col_step):
    from onnxscript import opset19 as op

    return op.DeformConv(
        input, weight, offset, bias, mask,
        dilations=list(dilation),
        group=groups,
        offset_group=offset_groups,
        # ONNX pads: [y_begin, x_begin, y_end, x_end]; ours are symmetric.
        pads=[padding[0], padding[1], padding[0], padding[1]],
        strides=list(stride),
    )


def dcnv3_with_grid_sample(input: Tensor, offset: Tensor, mask: Tensor, kernel_h: int,
                           kernel_w: int, stride_h: int, stride_w: int, pad_h: int, pad_w: int,
                           dilation_h: int, dilation_w: int, group: int, group_channels: int,
                           offset_scale: float, remove_center: bool) -> Tensor:
    """DCNv3 (docs/dcnv3_dcnv4.md) in standard operators. offset is
    (N, H_out, W_out, group, P, 2) and mask (N, H_out, W_out, group, P): the layouts of both
    ops, viewed per group and point. Each group is an image of group_channels channels that
    F.grid_sample samples at all its points at once."""
    N, H, W = input.shape[0], input.shape[1], input.shape[2]
    Ho, Wo = offset.shape[1], offset.shape[2]
    G, D = group, group_channels
    # Positions in at least float32, rounded to the input's dtype only as grid_sample's grid:
    # a half-precision sum of a pixel index and an offset would be off by a fraction of a pixel.
    options = dict(dtype=torch.promote_types(input.dtype, torch.float32), device=input.device)
    # The taps column by column (i along x outer), the centre left out with remove_center; from
    # arange rather than a Python list, which a traced export would record as a constant.
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
    x = base_x.view(1, 1, -1, 1, 1) + (grid_x + offset[..., 0]) * offset_scale
    y = base_y.view(1, -1, 1, 1, 1) + (grid_y + offset[..., 1]) * offset_scale
    # align_corners=False puts pixel centre x at (2 x + 1) / W - 1.
    grid = torch.stack([(2 * x + 1) / W - 1, (2 * y + 1) / H - 1], dim=-1)
    grid = grid.permute(0, 3, 1, 2, 4, 5).reshape(N * G, Ho * Wo, P, 2).to(input.dtype)
    images = input.reshape(N, H, W, G, D).permute(0, 3, 4, 1, 2).reshape(N * G, D, H, W)
    samples = F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros",
                            align_corners=False)  # (N G, D, Ho Wo, P)
    weights = mask.permute(0, 3, 1, 2, 4).reshape(N * G, 1, Ho * Wo, P)
    out = (samples * weights).sum(dim=-1)
    return out.reshape(N, G, D, Ho, Wo).permute(0, 3, 4, 1, 2).reshape(N, Ho, Wo, G * D)


def dcnv3_in_standard_onnx_ops(input: Tensor, offset: Tensor, mask: Tensor, kernel_h: int,
                               kernel_w: int, stride_h: int, stride_w: int, pad_h: int,
                               pad_w: int, dilation_h: int, dilation_w: int, group: int,
                               group_channels: int, offset_scale: float,
                               remove_center: bool) -> Tensor:
    """deformconv.dcnv3 under export."""
    N, Ho, Wo = offset.shape[0], offset.shape[1], offset.shape[2]
    P = kernel_h * kernel_w - int(remove_center)
    return dcnv3_with_grid_sample(
        input, offset.reshape(N, Ho, Wo, group, P, 2), mask.reshape(N, Ho, Wo, group, P),
        kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w, group,
        group_channels, offset_scale, remove_center)


def dcnv4_in_standard_onnx_ops(input: Tensor, offset_mask: Tensor, kernel_h: int,
                               kernel_w: int, stride_h: int, stride_w: int, pad_h: int,
                               pad_w: int, dilation_h: int, dilation_w: int, group: int,
                               group_channels: int, offset_scale: float,
                               remove_center: bool) -> Tensor:
    """deformconv.dcnv4 under export: the packed offsets and mask sliced out of offset_mask
    (its padding channels left unread)."""
    N, Ho, Wo = offset_mask.shape[0], offset_mask.shape[1], offset_mask.shape[2]
    P = kernel_h * kernel_w - int(remove_center)
    packed = offset_mask[..., :3 * group * P].reshape(N, Ho, Wo, group, 3 * P)
    return dcnv3_with_grid_sample(
        input, packed[..., :2 * P].reshape(N, Ho, Wo, group, P, 2), packed[..., 2 * P:],
        kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w, group,
        group_channels, offset_scale, remove_center)


def ms_deform_attn_with_grid_sample(value: Tensor, spatial_shapes: Tensor,
                                    level_start_index: Tensor, sampling_locations: Tensor,
                                    attention_weights: Tensor) -> Tensor:
    """Multi-scale deformable attention (docs/ms_deform_attn.md) in standard operators: each
    level of each head an image of D channels, sampled by F.grid_sample at 2 loc - 1
    (align_corners=False, zeros outside: the op's convention exactly), weighted and summed over
    the levels and points."""
    N, S, M, D = value.shape
    Lq, L, P = sampling_locations.shape[1], sampling_locations.shape[3], sampling_locations.shape[4]
    with warnings.catch_warnings():
        # torch.jit's tracer warns that the lists become constants: that is what the
        # TorchScript-based exporter is documented to do with the levels' sizes.
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        sizes: List[List[int]] = spatial_shapes.tolist()
        starts: List[int] = level_start_index.tolist()
    output = value.new_zeros(N * M, D, Lq)
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
        image = value.narrow(1, start, height * width).permute(0, 2, 3, 1)
        image = image.reshape(N * M, D, height, width)
        grid = (2 * sampling_locations[:, :, :, level] - 1).transpose(1, 2)
        samples = F.grid_sample(image, grid.reshape(N * M, Lq, P, 2), mode="bilinear",
                                padding_mode="zeros", align_corners=False)  # (N M, D, Lq, P)
        weights = attention_weights[:, :, :, level].transpose(1, 2).reshape(N * M, 1, Lq, P)
        output = output + (samples * weights).sum(dim=-1)
    return output.view(N, M, D, Lq).permute(0, 3, 1, 2).reshape(N, Lq, M * D)


def translation_table() -> Dict[Any, Any]:
    """The custom translation table for ``torch.onnx.export(..., dynamo=True)``, for users who
    call the exporter themselves."""
    return {torch.ops.deformconv.deform_conv2d.default: _deform_conv2d_to_onnx}


def _deform_conv2d_symbolic(g, input, offset, weight, mask, bias, stride, padding, dilation,
                            groups, offset_groups, im2col_step):
    """The same mapping for the TorchScript-based exporter."""
    from torch.onnx import symbolic_helper

    stride = symbolic_helper._get_const(stride, "is", "stride")
    padding = symbolic_helper._get_const(padding, "is", "padding")
    dilation = symbolic_helper._get_const(dilation, "is", "dilation")
    inputs = [input, weight, offset]
    if not symbolic_helper._is_none(mask):
        if symbolic_helper._is_none(bias):
            # B sits before mask in DeformConv's inputs: a mask needs an explicit zero bias.
            out_channels = symbolic_helper._get_tensor_sizes(weight)[0]
            if out_channels is None:
                raise ValueError("export_onnx(): a mask without a bias needs a weight of "
                                 "static shape, to build the zero bias ONNX requires")
            dtype = symbolic_helper._try_get_scalar_type(input).dtype()
            bias = g.op("Constant", value_t=torch.zeros(out_channels, dtype=dtype))
        inputs += [bias, mask]
    elif not symbolic_helper._is_none(bias):
        inputs.append(bias)
    return g.op(
        "DeformConv", *inputs,
        dilations_i=dilation,
        group_i=symbolic_helper._get_const(groups, "i", "groups"),
        offset_group_i=symbolic_helper._get_const(offset_groups, "i", "offset_groups"),
        pads_i=[padding[0], padding[1], padding[0], padding[1]],
        strides_i=stride,
    )


def register_torchscript_symbolic(opset_version: int = OPSET) -> None:
    """Registers the DeformConv mapping with the TorchScript-based exporter
    (``torch.onnx.export(..., dynamo=False)``)."""
    torch.onnx.register_custom_op_symbolic("deformconv::deform_conv2d",
                                           _deform_conv2d_symbolic, opset_version)


def export_onnx(model: torch.nn.Module, args: tuple, path: str,
                opset_version: int = OPSET, dynamo: bool = True, **kwargs: Optional[Any]):
    """Exports ``model`` called on ``args`` to ``path`` with the deformconv ops as ONNX
    DeformConv nodes, through the torch.export-based exporter (``dynamo=True``, needs onnx and
    onnxscript) or the TorchScript-based one (``dynamo=False``). Extra keyword arguments go to
    ``torch.onnx.export``, whose result is returned."""
    if opset_version < OPSET:
        raise ValueError(f"export_onnx(): ONNX DeformConv needs opset_version >= {OPSET}, "
                         f"but got {opset_version}")
    if not dynamo:
        register_torchscript_symbolic(opset_version)
        return torch.onnx.export(model, args, path, dynamo=False, opset_version=opset_version,
                                 **kwargs)
    table = dict(kwargs.pop("custom_translation_table", None) or {})
    table.update(translation_table())
    return torch.onnx.export(model, args, path, dynamo=True, opset_version=opset_version,
                             custom_translation_table=table, **kwargs)
