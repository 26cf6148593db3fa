"""The benchmark's shapes: DCN v1/v2 convolutions (Shape), DCNv3/DCNv4 core ops (Dcnv3Shape) and
multi-scale deformable attention (MsdaShape), the CPU and GPU sets, and their random operands."""

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    in_channels: int
    out_channels: int
    height: int
    width: int
    stride: int = 1
    groups: int = 1
    offset_groups: int = 1
    kernel: int = 3
    padding: int = 1

    def output_size(self):
        length = lambda size: (size + 2 * self.padding - self.kernel) // self.stride + 1  # noqa
        return length(self.height), length(self.width)

    def gemm_flops(self) -> int:
        """Multiply-adds x 2 of the convolution proper, which a dense conv does too."""
        out_h, out_w = self.output_size()
        return (2 * self.batch * self.out_channels * (self.in_channels // self.groups)
                * self.kernel * self.kernel * out_h * out_w)


    def describe(self) -> str:
        return (f"N={self.batch} {self.in_channels}->{self.out_channels} "
                f"{self.height}x{self.width} stride {self.stride} groups {self.groups} "
                f"offset groups {self.offset_groups}")


@dataclass(frozen=True)
class Dcnv3Shape:
    """A DCNv3/DCNv4 core op: channels-last (batch, size, size, channels), 3x3, stride 1,
    pad 1, group groups of channels // group channels."""
    name: str
    batch: int
    size: int
    channels: int
    group: int

    def describe(self) -> str:
        return (f"DCNv3/DCNv4 N={self.batch} {self.size}x{self.size}x{self.channels} "
                f"group {self.group} (group_channels {self.channels // self.group}), 3x3")


@dataclass(frozen=True)
class MsdaShape:
    """Multi-scale deformable attention: batch images of the given levels (H, W), heads heads of
    channels channels, points points per level (or points_per_level's count on each, the op's
    flat layout of samples); queries queries per image, or one per pixel of every level (an
    encoder's self-attention) when None; with softmax, the attention weights are logits that
    the op normalises (softmax=True), which its peers normalise before they attend."""
    name: str
    batch: int
    levels: Tuple[Tuple[int, int], ...]
    heads: int
    channels: int
    points: int
    queries: Optional[int] = None
    points_per_level: Optional[Tuple[int, ...]] = None
    softmax: bool = False

    def level_points(self) -> Tuple[int, ...]:
        return self.points_per_level or (self.points,) * len(self.levels)

    def pixels(self) -> int:
        return sum(height * width for height, width in self.levels)

    def query_count(self) -> int:
        return self.pixels() if self.queries is None else self.queries

    def describe(self) -> str:
        levels = " ".join(f"{height}x{width}" for height, width in self.levels)
        points = (self.points if self.points_per_level is None
                  else "[" + ", ".join(map(str, self.points_per_level)) + "]")
        return (f"MSDA N={self.batch} levels {levels} (S={self.pixels()}) "
                f"Lq={self.query_count()} M={self.heads} D={self.channels} P={points}"
                + (" softmax in the op" if self.softmax else ""))


# Deformable DETR's four levels of a 512 x 512 image (strides 8 to 64) at 256 channels in 8
# heads: the encoder attends from every pixel, a decoder from 300 object queries.
DETR_LEVELS = ((64, 64), (32, 32), (16, 16), (8, 8))
# D-FINE's decoder (transformers' DFineMultiscaleDeformableAttention): 300 queries over the
# three levels of a 640 x 640 image (strides 8 to 32), [3, 6, 3] points. The encoder once more
# with the softmax in the op (DCNv4's flash deformable attention).
MSDA_SHAPES = [
    MsdaShape("detr-encoder", 2, DETR_LEVELS, heads=8, channels=32, points=4),
    MsdaShape("detr-encoder-softmax", 2, DETR_LEVELS, heads=8, channels=32, points=4,
              softmax=True),
    MsdaShape("detr-decoder", 2, DETR_LEVELS, heads=8, channels=32, points=4, queries=300),
    MsdaShape("dfine-decoder", 2, ((80, 80), (40, 40), (20, 20)), heads=8, channels=32,
              points=0, queries=300, points_per_level=(3, 6, 3)),
]


# ResNet-50 DCN stages at detection resolution (800 x 1333 input), plus batched and grouped
# cases: the table of the CPU performance issue. Then FlashInternImage-T's four stages at
# 224 x 224, batch 4, for DCNv3 and DCNv4.
CPU_SHAPES = [
    Shape("c3", 1, 128, 128, 100, 168),
    Shape("c4", 1, 256, 256, 50, 84),
    Shape("c5", 1, 512, 512, 25, 42),
    Shape("c3-stride2", 1, 128, 128, 200, 336, stride=2),
    Shape("batch", 8, 64, 64, 56, 56, offset_groups=4),
    Shape("grouped", 1, 512, 512, 50, 84, groups=32),
    Dcnv3Shape("fit-stage1", 4, 56, 64, 4),
    Dcnv3Shape("fit-stage2", 4, 28, 128, 8),
    Dcnv3Shape("fit-stage3", 4, 14, 256, 16),
    Dcnv3Shape("fit-stage4", 4, 7, 512, 32),
    *MSDA_SHAPES,
]


# Training batches on a GPU: the detection stages at batch 8, the batched case at batch 32,
# FlashInternImage-T's stages at batch 64.
GPU_SHAPES = [
    Shape("c3-batch8", 8, 128, 128, 100, 168),
    Shape("c4-batch8", 8, 256, 256, 50, 84),
    Shape("c5-batch8", 8, 512, 512, 25, 42),
    Shape("batch32", 32, 64, 64, 56, 56, offset_groups=4),
    Dcnv3Shape("fit-stage1-batch64", 64, 56, 64, 4),
    Dcnv3Shape("fit-stage2-batch64", 64, 28, 128, 8),
    Dcnv3Shape("fit-stage3-batch64", 64, 14, 256, 16),
    Dcnv3Shape("fit-stage4-batch64", 64, 7, 512, 32),
    *MSDA_SHAPES,
]


# Not in either set: a layer so small that the time of a call is mostly its fixed cost (the
# dispatcher, autograd, argument checks), to compare that cost between builds.
CALL_OVERHEAD_SHAPES = [Shape("small", 1, 16, 16, 16, 16)]


SHAPES = {s.name: s for s in CPU_SHAPES + GPU_SHAPES + CALL_OVERHEAD_SHAPES}
ROOFLINE_SHAPES = (Dcnv3Shape, MsdaShape)


DEFAULT_SHAPES = {"cpu": [s.name for s in CPU_SHAPES], "cuda": [s.name for s in GPU_SHAPES]}


def make_tensors(shape: Shape, dtype: torch.dtype, modulated: bool, seed: int = 0,
                 device: str = "cpu"):
    generator = torch.Generator().manual_seed(seed)
    out_h, out_w = shape.output_size()
    taps = shape.kernel * shape.kernel

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=generator) * scale).to(device=device, dtype=dtype)

    x = randn(shape.batch, shape.in_channels, shape.height, shape.width)
    weight = randn(shape.out_channels, shape.in_channels // shape.groups, shape.kernel,
                   shape.kernel, scale=0.05)
    bias = randn(shape.out_channels)
    offset = randn(shape.batch, 2 * shape.offset_groups * taps, out_h, out_w, scale=2.0)
    mask = (torch.rand(shape.batch, shape.offset_groups * taps, out_h, out_w,
                       generator=generator).to(device=device, dtype=dtype)
            if modulated else None)
    return x, offset, weight, bias, mask


def make_dcnv3_tensors(shape: Dcnv3Shape, dtype: torch.dtype, seed: int = 0,
                       device: str = "cpu"):
    """Input, offsets within a few pixels, and per-group softmax-normalised mask values, as
    the DCNv3 module feeds the op."""
    generator = torch.Generator().manual_seed(seed)
    N, size, points = shape.batch, shape.size, 9
    input = torch.randn(N, size, size, shape.channels, generator=generator)
    offset = torch.randn(N, size, size, shape.group * points * 2, generator=generator) * 2
    logits = torch.randn(N, size, size, shape.group, points, generator=generator)
    mask = logits.softmax(-1).reshape(N, size, size, shape.group * points)
    return [t.to(device=device, dtype=dtype) for t in (input, offset, mask)]


def pack_offset_mask(offset, mask, group: int):
    """DCNv4's offset_mask as its module's Linear layer makes it from the same offsets and mask:
    per group the (x, y) pairs of its points, then their mask values, the channels padded with
    zeros to a multiple of 8."""
    N, H, W, _ = offset.shape
    packed = torch.cat([offset.view(N, H, W, group, -1), mask.view(N, H, W, group, -1)], -1)
    packed = packed.view(N, H, W, -1)
    return F.pad(packed, [0, -packed.shape[-1] % 8])


def make_msda_tensors(shape: MsdaShape, dtype: torch.dtype, seed: int = 0,
                      device: str = "cpu"):
    """value, spatial_shapes, level_start_index, sampling_locations, attention_weights as
    Deformable DETR makes them: each query's reference point (in the encoder, the centre of its
    own pixel; in the decoder, anywhere) moved by offsets of a few pixels of each level, and
    weights softmax-normalised over a head's levels and points (with shape.softmax, the logits
    themselves). With points_per_level, the locations and weights in the op's flat layout of
    samples."""
    generator = torch.Generator().manual_seed(seed)
    N, M, D, L = shape.batch, shape.heads, shape.channels, len(shape.levels)
    counts = shape.level_points()
    samples = sum(counts)
    spatial_shapes = torch.tensor(shape.levels, dtype=torch.int64)
    areas = spatial_shapes.prod(1)
    level_start_index = torch.cat([areas.new_zeros(1), areas.cumsum(0)[:-1]])
    Lq = shape.query_count()
    if shape.queries is None:
        centres = []
        for height, width in shape.levels:
            y, x = torch.meshgrid((torch.arange(height) + 0.5) / height,
                                  (torch.arange(width) + 0.5) / width, indexing="ij")
            centres.append(torch.stack([x.flatten(), y.flatten()], -1))
        reference = torch.cat(centres).expand(N, Lq, 2)
    else:
        reference = torch.rand(N, Lq, 2, generator=generator)
    # (1 / W_l, 1 / H_l) of each sample's level.
    level_of_sample = torch.repeat_interleave(torch.arange(L), torch.tensor(counts))
    pixel = (1.0 / spatial_shapes.flip(-1))[level_of_sample]
    offsets = torch.randn(N, Lq, M, samples, 2, generator=generator) * 2
    locations = reference.view(N, Lq, 1, 1, 2) + offsets * pixel
    weights = torch.randn(N, Lq, M, samples, generator=generator)
    if not shape.softmax:
        weights = weights.softmax(-1)
    if shape.points_per_level is None:
        locations = locations.view(N, Lq, M, L, shape.points, 2)
        weights = weights.view(N, Lq, M, L, shape.points)
    value = torch.randn(N, shape.pixels(), M, D, generator=generator)
    floating = [t.to(device=device, dtype=dtype) for t in (value, locations, weights)]
    return [floating[0], spatial_shapes.to(device), level_start_index.to(device), floating[1],
            floating[2]]
