"""Every CUDA kernel of every op once, forward and backward, in each dtype, on small operands:
the program that tools/gpu_check.sh runs under compute-sanitizer (memcheck, racecheck), which
slows each launch down a hundredfold. DCN v1 and v2, with conv and deform groups, a block of
several windows and an empty batch; DCNv3 and DCNv4 with and without remove_center, on every
path of their launchers (channel vectors of 16 bytes or one channel at a time, for a group's
width or the input's alignment; several passes of a warp over a group's channels; the points
staged in several rounds); multi-scale deformable attention on the same paths, with samples
off every level; every gradient asked for, then each alone. Prints one line per op and dtype.

    python tools/gpu_kernels_once.py
"""

import sys

import torch

import deformconv

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def deform_conv2d_once(dtype, batch, channels, groups, offset_groups, side, with_mask):
    generator = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to("cuda", dtype)

    x = rand(batch, channels, side, side)
    offset = rand(batch, 2 * offset_groups * 9, side, side, scale=2.0)
    weight = rand(channels, channels // groups, 3, 3)
    mask = rand(batch, offset_groups * 9, side, side).sigmoid() if with_mask else None
    bias = rand(channels)
    args = ([1, 1], [1, 1], [1, 1], groups, offset_groups, 0)
    out = torch.ops.deformconv.deform_conv2d(x, offset, weight, mask, bias, *args)
    grad = torch.ones_like(out)
    for output_mask in [[True] * 5] + [[i == j for j in range(5)] for i in range(5)]:
        torch.ops.deformconv.deform_conv2d_backward(grad, x, offset, weight, mask, *args,
                                                    output_mask)


def dcnv3_once(dtype, op, remove_center, group_channels=16, misaligned=False):
    generator = torch.Generator().manual_seed(1)
    groups, points = 2, 9 - int(remove_center)
    x = torch.randn(2, 7, 8, groups * group_channels, generator=generator).to("cuda", dtype)
    if misaligned:
        # The same values one element past the allocation's start: no 16-byte loads.
        storage = torch.empty(x.numel() + 1, device="cuda", dtype=dtype)
        x = storage[1:].view(x.shape).copy_(x)
    offset = (torch.randn(2, 7, 8, groups * points * 2, generator=generator) * 2).to(
        "cuda", dtype)
    mask = torch.rand(2, 7, 8, groups * points, generator=generator).to("cuda", dtype)
    tail = (3, 3, 1, 1, 1, 1, 1, 1, groups, group_channels, 1.0, 0, remove_center)
    if op == "dcnv3":
        operands = [x, offset, mask]
    else:
        packed = torch.cat([offset.view(2, 7, 8, groups, 2 * points),
                            mask.view(2, 7, 8, groups, points)], dim=4).view(2, 7, 8, -1)
        operands = [x, torch.nn.functional.pad(packed, (0, (-packed.shape[3]) % 8))]
    forward = getattr(torch.ops.deformconv, op)
    backward = getattr(torch.ops.deformconv, op + "_backward")
    out = forward(*operands, *tail)
    slots = len(operands)
    for output_mask in [[True] * slots] + [[i == j for j in range(slots)] for i in range(slots)]:
        backward(torch.ones_like(out), *operands, *tail, output_mask)


def ms_deform_attn_once(dtype, channels=16, misaligned=False):
    generator = torch.Generator().manual_seed(2)
    shapes = torch.tensor([[6, 5], [3, 3], [1, 1]], device="cuda")
    starts = torch.tensor([0, 30, 39], device="cuda")
    value = torch.randn(2, 40, 2, channels, generator=generator).to("cuda", dtype)
    if misaligned:
        storage = torch.empty(value.numel() + 1, device="cuda", dtype=dtype)
        value = storage[1:].view(value.shape).copy_(value)
    # Within (-0.3, 1.3): samples off every side of their level.
    locations = (torch.rand(2, 7, 2, 3, 4, 2, generator=generator) * 1.6 - 0.3).to("cuda", dtype)
    weights = torch.rand(2, 7, 2, 3, 4, generator=generator).to("cuda", dtype)
    operands = [value, shapes, starts, locations, weights]
    out = torch.ops.deformconv.ms_deform_attn(*operands, 64)
    for output_mask in ([True, True, True], [True, False, False], [False, True, False],
                        [False, False, True]):
        torch.ops.deformconv.ms_deform_attn_backward(torch.ones_like(out), *operands, 64, [],
                                                     "bilinear", False, output_mask)


def main() -> int:
    if not (torch.cuda.is_available() and deformconv.cuda_compiled()):
        print("gpu_kernels_once: needs a CUDA device and deformconv's CUDA kernels")
        return 1
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        deform_conv2d_once(dtype, 2, 8, 1, 1, 9, True)
        deform_conv2d_once(dtype, 3, 12, 2, 3, 7, False)
        deform_conv2d_once(dtype, 0, 4, 1, 1, 5, True)
        # 64 channels in 4 conv and deform groups over 48 x 48 pixels: launches of many
        # blocks, and deform groups of 16 channels (teams of 16 lanes for their gradients).
        deform_conv2d_once(dtype, 1, 64, 4, 4, 48, True)
        torch.cuda.synchronize()
        print(f"gpu_kernels_once: deform_conv2d {name} ok", flush=True)
        for op in ("dcnv3", "dcnv4"):
            for remove_center in (False, True):
                dcnv3_once(dtype, op, remove_center)
            # One channel at a time (5), two passes (33), several rounds (1), misaligned.
            for group_channels in (5, 33, 1):
                dcnv3_once(dtype, op, False, group_channels)
            dcnv3_once(dtype, op, False, misaligned=True)
            torch.cuda.synchronize()
            print(f"gpu_kernels_once: {op} {name} ok", flush=True)
        # Vectors (16), one channel at a time and two passes (33), several rounds (1),
        # misaligned.
        for channels in (16, 33, 1):
            ms_deform_attn_once(dtype, channels)
        ms_deform_attn_once(dtype, misaligned=True)
        torch.cuda.synchronize()
        print(f"gpu_kernels_once: ms_deform_attn {name} ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
