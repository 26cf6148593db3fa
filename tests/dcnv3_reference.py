"""DCNv3's readable pure-PyTorch reference, written from its conventions (docs/dcnv3_dcnv4.md),
and the operands the DCNv3 and DCNv4 tests share: hand-computed vectors (every value exact in
binary) and random operands over a grid of geometries."""

import itertools

import torch


def output_length(size, kernel, stride, pad, dilation):
    return (size + 2 * pad - (dilation * (kernel - 1) + 1)) // stride + 1


def dcnv3_reference(input, offset, mask, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w,
                    dilation_h, dilation_w, group, group_channels, offset_scale,
                    remove_center=False):
    """The conventions written out: the points column by column, their (x, y) positions, bilinear
    sampling with zeros outside, the mask-weighted sum over the points. Differentiable, with the
    one-sided derivative of the cell that starts at (floor y, floor x)."""
    N, H, W, _ = input.shape
    Ho = output_length(H, kernel_h, stride_h, pad_h, dilation_h)
    Wo = output_length(W, kernel_w, stride_w, pad_w, dilation_w)
    taps = [(i, j) for i in range(kernel_w) for j in range(kernel_h)
            if not (remove_center and (i, j) == (kernel_w // 2, kernel_h // 2))]
    P, G, D = len(taps), group, group_channels
    offset = offset.reshape(N, Ho, Wo, G, P, 2)
    mask = mask.reshape(N, Ho, Wo, G, P)
    image = input.reshape(N, H, W, G, D)
    i = torch.tensor([t[0] for t in taps], dtype=input.dtype)
    j = torch.tensor([t[1] for t in taps], dtype=input.dtype)
    centre_w = dilation_w * (kernel_w - 1) // 2
    centre_h = dilation_h * (kernel_h - 1) // 2
    wo = torch.arange(Wo, dtype=input.dtype).view(1, 1, Wo, 1, 1)
    ho = torch.arange(Ho, dtype=input.dtype).view(1, Ho, 1, 1, 1)
    x = (wo * stride_w - pad_w + centre_w) - centre_w * offset_scale \
        + (i * dilation_w + offset[..., 0]) * offset_scale
    y = (ho * stride_h - pad_h + centre_h) - centre_h * offset_scale \
        + (j * dilation_h + offset[..., 1]) * offset_scale
    inside = (y > -1) & (y < H) & (x > -1) & (x < W)
    y = torch.where(inside, y, torch.zeros_like(y))
    x = torch.where(inside, x, torch.zeros_like(x))
    y0, x0 = torch.floor(y), torch.floor(x)
    ly, lx = y - y0, x - x0
    n_index = torch.arange(N).view(N, 1, 1, 1, 1)
    g_index = torch.arange(G).view(1, 1, 1, G, 1)
    value = 0
    for dy, dx in itertools.product((0, 1), (0, 1)):
        yy, xx = (y0 + dy).long(), (x0 + dx).long()
        valid = inside & (yy >= 0) & (yy < H) & (xx >= 0) & (xx < W)
        weight = (ly if dy else 1 - ly) * (lx if dx else 1 - lx)
        corner = image[n_index, yy.clamp(0, H - 1), xx.clamp(0, W - 1), g_index]
        value = value + torch.where(valid[..., None], weight[..., None] * corner,
                                    torch.zeros_like(corner))
    return (value * mask[..., None]).sum(4).reshape(N, Ho, Wo, G * D)


def run(op, input, offset, mask, geometry, offset_scale=1.0, remove_center=False,
        im2col_step=0):
    (kh, kw), (sh, sw), (ph, pw), (dh, dw), G, D = geometry
    return op(input, offset, mask, kh, kw, sh, sw, ph, pw, dh, dw, G, D, offset_scale,
              im2col_step, remove_center)


def random_operands(N, H, W, geometry, remove_center=False, dtype=torch.float64, spread=2.0,
                    seed=0):
    (kh, kw), (sh, sw), (ph, pw), (dh, dw), G, D = geometry
    Ho, Wo = output_length(H, kh, sh, ph, dh), output_length(W, kw, sw, pw, dw)
    P = kh * kw - int(remove_center)
    generator = torch.Generator().manual_seed(seed)
    input = torch.randn(N, H, W, G * D, generator=generator, dtype=torch.float64)
    # Offsets off integer coordinates (the derivative is one-sided there), some far outside.
    offset = (torch.rand(N, Ho, Wo, G * P * 2, generator=generator, dtype=torch.float64) - 0.5)
    offset = offset * 2 * spread + 0.123
    mask = torch.rand(N, Ho, Wo, G * P, generator=generator, dtype=torch.float64) * 2 - 0.5
    return [t.to(dtype) for t in (input, offset, mask)]


# (kernel, stride, padding, dilation, group, group_channels)
GEOMETRIES = [
    ((3, 3), (1, 1), (1, 1), (1, 1), 1, 1),
    ((3, 3), (1, 1), (1, 1), (1, 1), 2, 3),
    ((2, 3), (2, 1), (1, 2), (2, 1), 1, 2),   # non-square, stride 2, unequal pad, dilation
    ((3, 1), (1, 2), (0, 1), (1, 3), 3, 4),
    ((1, 1), (1, 1), (0, 0), (1, 1), 4, 17),  # channels beyond one vector
    ((3, 3), (2, 2), (1, 1), (1, 1), 2, 16),
]


def spec_vectors_input(N, H, W, C, dtype=torch.float64):
    index = torch.arange(N * H * W * C)
    n, y, x, c = (index // (H * W * C), index // (W * C) % H, index // C % W, index % C)
    return (1000 * n + 100 * c + 10 * y + x).to(dtype).reshape(N, H, W, C)


# name: (N, H, W, G, D, kernel, stride, pad, dilation, scale, remove_center), then the sums of
# The vectors' table: out, out², g_in, g_in², g_offset, g_offset², g_mask, g_mask².
FORMULA_VECTORS = {
    "A": ((1, 3, 4, 1, 1, (3, 3), (1, 1), (1, 1), (1, 1), 1.0, False),
          (365.53125, 13169.34326171875, 68.359375, 424.521728515625, 225.5, 27230.90625,
           1238.9375, 39948.11328125)),
    "B": ((2, 4, 5, 2, 2, (3, 3), (1, 1), (1, 1), (1, 1), 2.0, False),
          (175511.75, 344909015.578125, 528.25, 2093.1640625, -129637.5, 2513922591.25,
           568462.5, 2286292600.625)),
    "C": ((1, 5, 6, 1, 2, (2, 3), (2, 1), (1, 2), (2, 1), 0.5, False),
          (8161.7109375, 2558328.0913391113, 220.03125, 907.1261291503906, -100.40625,
           641473.4702148438, 25454.65625, 7361234.081542969)),
    "D": ((1, 3, 4, 2, 1, (3, 3), (1, 1), (1, 1), (1, 1), 1.0, True),
          (3737.453125, 1053518.2082519531, 116.96875, 613.03662109375, -1591.625,
           1284791.2265625, 10662.125, 2081460.2265625)),
}


def formula_operands(N, H, W, G, D, kernel, stride, pad, dilation, remove_center):
    Ho = output_length(H, kernel[0], stride[0], pad[0], dilation[0])
    Wo = output_length(W, kernel[1], stride[1], pad[1], dilation[1])
    P = kernel[0] * kernel[1] - int(remove_center)
    input = spec_vectors_input(N, H, W, G * D)
    n, ho, wo, k = torch.meshgrid(torch.arange(N), torch.arange(Ho), torch.arange(Wo),
                                  torch.arange(G * P * 2), indexing="ij")
    offset = (((7 * k + 3 * ho + 5 * wo + 11 * n) % 13) - 6).double() / 4
    n, ho, wo, k = torch.meshgrid(torch.arange(N), torch.arange(Ho), torch.arange(Wo),
                                  torch.arange(G * P), indexing="ij")
    mask = (((k + 2 * ho + wo + n) % 4) + 1).double() / 4
    return input, offset, mask


def pack_offset_mask(offset, mask, group, padding_value=float("nan"), multiple=8):
    """DCNv4's offset_mask (docs/dcnv3_dcnv4.md) from DCNv3's offset and mask: per group the (x, y) pairs of
    its P points, then their P mask values; then padding channels of `padding_value` up to a
    multiple of `multiple`."""
    N, Ho, Wo, used = mask.shape[0], mask.shape[1], mask.shape[2], 3 * mask.shape[3]
    points = mask.shape[3] // group
    packed = torch.cat([offset.reshape(N, Ho, Wo, group, 2 * points),
                        mask.reshape(N, Ho, Wo, group, points)], dim=4).reshape(N, Ho, Wo, used)
    channels = -(-used // multiple) * multiple
    padding = packed.new_full((N, Ho, Wo, channels - used), padding_value)
    return torch.cat([packed, padding], dim=3)


def unpack_offset_mask(offset_mask, group, points):
    """(offset, mask, padding) of a DCNv4 offset_mask (or of its gradient)."""
    N, Ho, Wo, _ = offset_mask.shape
    used = offset_mask[..., :3 * group * points].reshape(N, Ho, Wo, group, 3 * points)
    return (used[..., :2 * points].reshape(N, Ho, Wo, 2 * group * points),
            used[..., 2 * points:].reshape(N, Ho, Wo, group * points),
            offset_mask[..., 3 * group * points:])
