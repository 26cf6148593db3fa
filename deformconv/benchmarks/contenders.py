"""What deformconv is timed against: torchvision's op and a dense convolution of the same
geometry for DCN v1/v2, deformconv's GEMMs alone, and the grid_sample formulations of
DCNv3/DCNv4 and of multi-scale deformable attention (deformconv.decompositions', which the ONNX
exports write). The inference runtimes: runtimes.py."""

from typing import Callable, Dict, Tuple

import torch
import torch.nn.functional as F

import deformconv
from deformconv import decompositions

from .shapes import Dcnv3Shape, MsdaShape, Shape, pack_offset_mask

def contenders(shape: Shape, tensors, im2col_step: int) -> Dict[str, Callable]:
    x, offset, weight, bias, mask = tensors
    geometry = dict(stride=shape.stride, padding=shape.padding)
    runs = {
        "deformconv": lambda x, o, w, b, m: deformconv.deform_conv2d(
            x, o, w, b, mask=m, im2col_step=im2col_step, **geometry),
        "dense": lambda x, o, w, b, m: F.conv2d(x, w, b, groups=shape.groups, **geometry),
    }
    try:
        from torchvision.ops import deform_conv2d as torchvision_deform_conv2d
    except ImportError:
        pass
    else:
        runs["torchvision"] = lambda x, o, w, b, m: torchvision_deform_conv2d(
            x, o, w, b, mask=m, **geometry)
    return runs


def dcnv3_geometry(shape: Dcnv3Shape) -> tuple:
    """The benchmark's DCNv3/DCNv4 geometry: (kh, kw, sh, sw, ph, pw, dh, dw, group,
    group_channels, offset_scale), a 3 x 3 kernel of stride 1 and padding 1, offset scale 1."""
    return (3, 3, 1, 1, 1, 1, 1, 1, shape.group, shape.channels // shape.group, 1.0)


def dcnv3_contenders(shape: Dcnv3Shape, tensors) -> Dict[str, Tuple[Callable, list]]:
    """Each contender with the inputs its model feeds it: DCNv3 and the grid_sample formulation
    (deformconv.decompositions', which samples with F.grid_sample as the originals'
    pure-PyTorch DCNv3 does) the offsets and mask that InternImage's DCNv3 makes, DCNv4 the
    packed offset_mask that FlashInternImage's DCNv4 makes in one Linear layer
    (pack_offset_mask)."""
    geometry = dcnv3_geometry(shape)
    group = shape.group
    input, offset, mask = tensors
    return {
        "dcnv3": (lambda input, offset, mask: deformconv.dcnv3(input, offset, mask, *geometry),
                  [input, offset, mask]),
        "dcnv4": (lambda input, offset_mask: deformconv.dcnv4(input, offset_mask, *geometry),
                  [input, pack_offset_mask(offset, mask, group)]),
        "grid_sample formulation": (
            lambda input, offset, mask: decompositions.dcnv3(input, offset, mask, *geometry,
                                                             0, False),
            [input, offset, mask]),
    }


def msda_contenders(shape: MsdaShape, tensors) -> Dict[str, Tuple[Callable, list]]:
    """deformconv's op and the per-level grid_sample formulation that Deformable DETR's and
    mmcv's pure-PyTorch fallbacks compute (deformconv.decompositions'), on the same operands;
    where transformers is installed, its multi_scale_deformable_attention_v2 (RT-DETRv2's,
    D-FINE's and DEIMv2's; the same grid_sample steps, level by level) on the locations and
    weights in the flat layout it takes. With shape.softmax the weights are logits: the op
    normalises them itself, and also runs as today's op after a separate torch.softmax, as the
    peers do."""
    points = list(shape.points_per_level or [])
    softmax = shape.softmax

    def normalised(weights):
        return weights.flatten(3).softmax(-1).view(weights.shape) if softmax else weights

    runs = {
        "ms_deform_attn": (
            lambda *operands: deformconv.ms_deform_attn(*operands, points_per_level=points or None,
                                                        softmax=softmax),
            tensors),
        "grid_sample formulation": (
            lambda *operands: decompositions.ms_deform_attn(*operands, 64, points, "bilinear",
                                                            softmax),
            tensors),
    }
    if softmax:
        runs["ms_deform_attn + softmax"] = (
            lambda value, spatial_shapes, level_start_index, locations, logits:
            deformconv.ms_deform_attn(value, spatial_shapes, level_start_index, locations,
                                      normalised(logits), points_per_level=points or None),
            tensors)
    try:
        from transformers.models.d_fine.modeling_d_fine import multi_scale_deformable_attention_v2
    except ImportError:
        return runs
    levels = [list(level) for level in shape.levels]

    def transformers_v2(value, spatial_shapes, level_start_index, locations, weights):
        N, Lq, M = locations.shape[:3]
        return multi_scale_deformable_attention_v2(
            value, levels, locations.reshape(N, Lq, M, -1, 2),
            normalised(weights).reshape(N, Lq, M, -1), list(shape.level_points()), "default")

    runs["transformers"] = (transformers_v2, tensors)
    return runs


def gemm_steps(shape: Shape, dtype: torch.dtype,
               device: str = "cpu") -> Dict[str, Callable[[], None]]:
    """The GEMMs of deformconv's im2col formulation alone, whole-size, on random columns in its
    layout (per image and conv group, pixels x taps * channels), in the form deformconv runs
    them: forward, the output; backward, the columns gradient and the weight gradient. On the
    CPU in float32 with one conv group that form is a 1x1 convolution over the columns viewed
    as a channels-last image (oneDNN), elsewhere batched matrix products (bmm). No im2col +
    GEMM implementation can beat them, so they measure how much of the gap to a dense
    convolution is sampling and how much is the GEMMs themselves."""
    out_h, out_w = shape.output_size()
    pixels = out_h * out_w
    matrices = shape.batch * shape.groups
    rows = shape.in_channels // shape.groups * shape.kernel * shape.kernel
    out_per_group = shape.out_channels // shape.groups
    options = dict(device=device, dtype=dtype)
    columns = torch.randn(matrices, pixels, rows).to(**options)
    weight = torch.randn(shape.groups, out_per_group, rows).to(**options)
    grad_output = torch.randn(matrices, out_per_group, pixels).to(**options)
    as_convolution = (device == "cpu" and dtype == torch.float32 and shape.groups == 1
                      and torch.backends.mkldnn.is_available()
                      and torch.backends.mkldnn.enabled)
    if as_convolution:
        image = columns.permute(0, 2, 1).unsqueeze(2)  # (N, rows, 1, pixels), channels-last
        weight_1x1 = weight.view(shape.out_channels, rows, 1, 1)
        grad_image = grad_output.unsqueeze(2)

        def forward():
            torch.mkldnn_convolution(image, weight_1x1, None, [0, 0], [1, 1], [1, 1], 1)

        def forward_backward():
            forward()
            torch.ops.aten.convolution_backward(grad_image, image, weight_1x1, None, [1, 1],
                                                [0, 0], [1, 1], False, [0, 0], 1,
                                                [True, True, False])

        return {"GEMMs alone forward": forward,
                "GEMMs alone forward+backward": forward_backward}

    weight = weight.repeat(shape.batch, 1, 1)
    # Results go to buffers allocated once: the allocation of a fresh columns-sized buffer
    # (page faults) is not GEMM work.
    output, grad_weight = torch.empty_like(grad_output), torch.empty_like(weight)
    grad_columns = torch.empty_like(columns)

    def forward():
        torch.bmm(weight, columns.transpose(1, 2), out=output)

    def forward_backward():
        forward()
        torch.bmm(grad_output.transpose(1, 2), weight, out=grad_columns)
        torch.bmm(grad_output, columns, out=grad_weight)

    return {"GEMMs alone forward": forward, "GEMMs alone forward+backward": forward_backward}
