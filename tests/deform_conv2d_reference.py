"""A short, readable pure-PyTorch deformable convolution: bilinear gather + einsum.

It is the oracle of the test suite: no code in common with the extension. Its gradients come
from PyTorch's autograd; at integer sample coordinates they are one-sided in the cell that
starts at floor(y), floor(x), because floor() has zero gradient and the cell is chosen by it.
"""

import torch


def bilinear(input, y, x):
    """Samples input (N, C, H, W) at float positions y, x of shape (N, C, *S); zero outside
    (-1, H) x (-1, W) and at corners outside the image."""
    n, c, h, w = input.shape
    flat = input.reshape(n, c, h * w)
    y0, x0 = torch.floor(y), torch.floor(x)
    ly, lx = y - y0, x - x0

    def corner(cy, cx):
        valid = (cy >= 0) & (cy < h) & (cx >= 0) & (cx < w)
        index = (cy.clamp(0, h - 1) * w + cx.clamp(0, w - 1)).long()
        values = torch.gather(flat, 2, index.flatten(2)).reshape(y.shape)
        return torch.where(valid, values, torch.zeros_like(values))

    value = ((1 - ly) * (1 - lx) * corner(y0, x0) + (1 - ly) * lx * corner(y0, x0 + 1)
             + ly * (1 - lx) * corner(y0 + 1, x0) + ly * lx * corner(y0 + 1, x0 + 1))
    inside = (y > -1) & (y < h) & (x > -1) & (x < w)
    return torch.where(inside, value, torch.zeros_like(value))


def deform_conv2d_reference(input, offset, weight, bias=None, stride=(1, 1), padding=(0, 0),
                            dilation=(1, 1), mask=None):
    n, c_in, _, _ = input.shape
    c_out, c_per_group, kh, kw = weight.shape
    groups = c_in // c_per_group
    taps = kh * kw
    offset_groups = offset.shape[1] // (2 * taps)
    out_h, out_w = offset.shape[2], offset.shape[3]
    device, dtype = input.device, input.dtype

    # Undeformed sample positions of every tap k = i * kW + j: (K, H_out, W_out).
    i = torch.arange(kh, device=device).repeat_interleave(kw)
    j = torch.arange(kw, device=device).repeat(kh)
    rows = torch.arange(out_h, device=device) * stride[0] - padding[0]
    cols = torch.arange(out_w, device=device) * stride[1] - padding[1]
    base_y = (rows[None, :, None] + (i * dilation[0])[:, None, None]).to(dtype)
    base_x = (cols[None, None, :] + (j * dilation[1])[:, None, None]).to(dtype)

    # Offsets are (y, x) pairs per tap per deform group; each channel uses its group's field.
    displacement = offset.reshape(n, offset_groups, taps, 2, out_h, out_w)
    per_channel = c_in // offset_groups
    y = (base_y + displacement[:, :, :, 0]).repeat_interleave(per_channel, dim=1)
    x = (base_x + displacement[:, :, :, 1]).repeat_interleave(per_channel, dim=1)
    sampled = bilinear(input, y, x)  # (N, C_in, K, H_out, W_out)
    if mask is not None:
        modulation = mask.reshape(n, offset_groups, taps, out_h, out_w)
        sampled = sampled * modulation.repeat_interleave(per_channel, dim=1)

    out = torch.einsum(
        "ngckhw,gock->ngohw",
        sampled.reshape(n, groups, c_per_group, taps, out_h, out_w),
        weight.reshape(groups, c_out // groups, c_per_group, taps),
    ).reshape(n, c_out, out_h, out_w)
    if bias is not None:
        out = out + bias[None, :, None, None]
    return out
