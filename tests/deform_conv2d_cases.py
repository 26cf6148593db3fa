"""Random operands of deformable convolution for a geometry, shared by the test files."""

from dataclasses import dataclass
from typing import Tuple

import torch


@dataclass(frozen=True)
class Geometry:
    name: str
    batch: int
    in_channels: int
    out_channels: int
    height: int
    width: int
    kernel: Tuple[int, int]
    stride: Tuple[int, int] = (1, 1)
    padding: Tuple[int, int] = (0, 0)
    dilation: Tuple[int, int] = (1, 1)
    groups: int = 1
    offset_groups: int = 1

    def output_size(self):
        def length(size, k, s, p, d):
            return (size + 2 * p - (d * (k - 1) + 1)) // s + 1

        return (length(self.height, self.kernel[0], self.stride[0], self.padding[0],
                       self.dilation[0]),
                length(self.width, self.kernel[1], self.stride[1], self.padding[1],
                       self.dilation[1]))

    def __str__(self):
        return self.name


GEOMETRIES = [
    Geometry("1x1", 2, 4, 6, 5, 6, (1, 1)),
    Geometry("3x3-pad1", 2, 4, 4, 7, 8, (3, 3), padding=(1, 1)),
    Geometry("2x3-nonsquare", 2, 6, 4, 9, 7, (2, 3), stride=(2, 1), padding=(1, 0),
             dilation=(1, 2), groups=2, offset_groups=3),
    Geometry("5x5-dilated", 1, 3, 3, 11, 10, (5, 5), stride=(1, 2), padding=(2, 3),
             dilation=(2, 1), offset_groups=3),
    Geometry("groups4-offset2", 3, 8, 12, 6, 6, (3, 3), padding=(1, 1), groups=4,
             offset_groups=2),
    Geometry("stride2-offset4", 2, 4, 4, 9, 9, (3, 3), stride=(2, 2), padding=(2, 2),
             groups=2, offset_groups=4),
]


def make_operands(geometry, *, dtype=torch.float64, device="cpu", with_mask=True,
                  with_bias=True, offset_scale=1.5, batch=None, seed=0):
    """Returns (input, offset, weight, bias or None, mask or None), float64 leaves."""
    generator = torch.Generator().manual_seed(seed)
    g = geometry
    n = g.batch if batch is None else batch
    out_h, out_w = g.output_size()
    taps = g.kernel[0] * g.kernel[1]

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).to(
            device=device, dtype=dtype)

    input = rand(n, g.in_channels, g.height, g.width)
    offset = rand(n, 2 * g.offset_groups * taps, out_h, out_w, scale=offset_scale)
    weight = rand(g.out_channels, g.in_channels // g.groups, *g.kernel, scale=0.5)
    bias = rand(g.out_channels) if with_bias else None
    mask = None
    if with_mask:
        mask = torch.rand(n, g.offset_groups * taps, out_h, out_w, generator=generator,
                          dtype=torch.float64).to(device=device, dtype=dtype)
    return input, offset, weight, bias, mask


def differentiable(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_() for t in tensors]


def forward_and_grads(fn, input, offset, weight, bias, mask, geometry, grad_seed=1, **kwargs):
    """Runs fn on fresh leaves and returns (output, [grads of present operands])."""
    leaves = differentiable(input, offset, weight, bias, mask)
    x, o, w, b, m = leaves
    out = fn(x, o, w, b, geometry.stride, geometry.padding, geometry.dilation, m, **kwargs)
    generator = torch.Generator().manual_seed(grad_seed)
    grad_out = torch.randn(out.shape, generator=generator, dtype=torch.float64).to(out)
    present = [t for t in leaves if t is not None]
    return out, list(torch.autograd.grad(out, present, grad_out))


def strided_copies(input, offset, weight, bias, mask):
    """The same values in other layouts: channels_last input and weight; offset, mask and bias
    as views of other buffers, none of them contiguous."""
    strided = (
        input.to(memory_format=torch.channels_last),
        offset.transpose(2, 3).contiguous().transpose(2, 3),
        weight.to(memory_format=torch.channels_last),
        torch.stack([bias, bias], dim=1)[:, 0],
        mask.transpose(0, 1).contiguous().transpose(0, 1),
    )
    assert not any(t.is_contiguous() for t in strided)
    return strided


def check_indices_past_two_to_the_31(device: str) -> None:
    """One 46341 x 46341 plane has 2,147,488,281 > 2^31 elements: the sample at (46340, 46340)
    lies at flat index 2,147,488,280, which int32 arithmetic would wrap to a negative one.
    float16 keeps the input at 4.3 GB. A 1x1 kernel with stride side - 1 samples the four
    corners of the plane; the forward and the input gradient must find them."""
    import deformconv

    side = 46341
    x = torch.zeros(1, 1, side, side, dtype=torch.float16, device=device)
    x[0, 0, side - 1, side - 1] = 3.0
    x[0, 0, side - 1, side - 2] = 1.0
    weight = torch.full((1, 1, 1, 1), 2.0, dtype=torch.float16, device=device)
    offset = torch.zeros(1, 2, 2, 2, dtype=torch.float16, device=device)
    offset[0, 1, 1, 1] = -0.5  # x of the last sample: halfway between the last two columns
    out = deformconv.deform_conv2d(x, offset, weight, stride=side - 1)
    assert out.tolist() == [[[[0.0, 0.0], [0.0, 2.0 * (0.5 * 3.0 + 0.5 * 1.0)]]]]
    x.zero_()  # the input no longer matters to its gradient: reused rather than reallocated
    grad_input = torch.ops.deformconv.deform_conv2d_backward(
        torch.ones_like(out), x, offset, weight, None, [side - 1] * 2, [0, 0], [1, 1], 1, 1, 0,
        [True, False, False, False, False])[0]
    del x
    # weight 2 times bilinear weight 0.5 at the last two columns; weight 2 at the other three
    # corners of the plane, which the other samples hit exactly; nothing anywhere else.
    assert grad_input[0, 0, side - 1, side - 1].item() == 1.0
    assert grad_input[0, 0, side - 1, side - 2].item() == 1.0
    assert grad_input[0, 0, 0, 0].item() == 2.0
    assert grad_input[0, 0, 0, side - 1].item() == 2.0
    assert grad_input[0, 0, side - 1, 0].item() == 2.0
    assert grad_input.float().sum().item() == 1.0 + 1.0 + 3 * 2.0
