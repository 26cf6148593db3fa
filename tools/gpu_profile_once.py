"""The main CUDA kernels once each, forward and backward with every gradient, at one realistic
training shape: the program that tools/gpu_check.sh runs under Nsight Compute (ncu) to read each
kernel's achieved DRAM bandwidth and SM throughput. DCNv3 and DCNv4 at FlashInternImage-T's
stage 2 (batch 64) in float32 and bfloat16; DCN v2 at ResNet-50's c4 stage (batch 8) in
float32 and bfloat16; multi-scale deformable attention at Deformable DETR's encoder shape in float32.
DCNv3's float32 backward runs twice, the second time with DEFORMCONV_INPUT_GRADIENT_BANDS=0 (its
input gradient added in global memory, not in bands of shared memory), to compare the two
kernels. Each call runs in an NVTX range of its name, which ncu records beside each kernel
(tools/ncu_summary.py labels the kernels by it). The ops are called directly, not through
autograd, whose engine would run the backward on a thread of its own, outside the range.

    python tools/gpu_profile_once.py
"""

import os

import torch

from deformconv.benchmarks.shapes import (SHAPES, make_dcnv3_tensors, make_msda_tensors,
                                          make_tensors, pack_offset_mask)

ops = torch.ops.deformconv


def without_bands(call):
    """call, run with the input gradient of DCNv3's CUDA backward in global memory."""
    def run():
        os.environ["DEFORMCONV_INPUT_GRADIENT_BANDS"] = "0"
        try:
            call()
        finally:
            del os.environ["DEFORMCONV_INPUT_GRADIENT_BANDS"]
    return run


def dcnv3_calls(dtype):
    shape = SHAPES["fit-stage2-batch64"]
    input, offset, mask = make_dcnv3_tensors(shape, dtype, device="cuda")
    tail = (3, 3, 1, 1, 1, 1, 1, 1, shape.group, shape.channels // shape.group, 1.0, 0, False)
    name = str(dtype).removeprefix("torch.")
    calls = []
    for op, operands in (("dcnv3", [input, offset, mask]),
                         ("dcnv4", [input, pack_offset_mask(offset, mask, shape.group)])):
        forward, backward = getattr(ops, op), getattr(ops, op + "_backward")
        grad_output = torch.randn_like(input)
        every_gradient = [True] * len(operands)
        calls.append((f"{op} {name} forward", lambda f=forward, o=operands: f(*o, *tail)))
        backward_call = (lambda b=backward, o=operands, m=every_gradient:
                         b(grad_output, *o, *tail, m))
        calls.append((f"{op} {name} backward", backward_call))
        if op == "dcnv3" and dtype == torch.float32:
            calls.append((f"{op} {name} backward, input gradient in global memory",
                          without_bands(backward_call)))
    return calls


def deform_conv2d_calls(dtype):
    shape = SHAPES["c4-batch8"]
    x, offset, weight, bias, mask = make_tensors(shape, dtype, modulated=True, device="cuda")
    geometry = ([1, 1], [1, 1], [1, 1], 1, 1, 0)
    grad_output = torch.randn(shape.batch, shape.out_channels, *shape.output_size(),
                              device="cuda", dtype=dtype)
    name = str(dtype).removeprefix("torch.")
    return [(f"deform_conv2d {name} forward",
             lambda: ops.deform_conv2d(x, offset, weight, mask, bias, *geometry)),
            (f"deform_conv2d {name} backward",
             lambda: ops.deform_conv2d_backward(grad_output, x, offset, weight, mask, *geometry,
                                                [True] * 5))]


def ms_deform_attn_calls():
    operands = make_msda_tensors(SHAPES["detr-encoder"], torch.float32, device="cuda")
    value, locations = operands[0], operands[3]
    grad_output = torch.randn(value.shape[0], locations.shape[1], value.shape[2] * value.shape[3],
                              device="cuda")
    return [("ms_deform_attn float32 forward", lambda: ops.ms_deform_attn(*operands, 64)),
            ("ms_deform_attn float32 backward",
             lambda: ops.ms_deform_attn_backward(grad_output, *operands, 64, [], "bilinear",
                                                 False, [True] * 3))]


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # No warm-up: ncu replays each kernel on its own, caches flushed, so a first call's one-time
    # costs (module loading, library handles) do not enter its figures.
    for name, call in dcnv3_calls(torch.float32) + dcnv3_calls(torch.bfloat16) + \
            deform_conv2d_calls(torch.float32) + deform_conv2d_calls(torch.bfloat16) + \
            ms_deform_attn_calls():
        torch.cuda.nvtx.range_push(name)
        call()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        print("profiled", name)


if __name__ == "__main__":
    main()
