"""The main CUDA kernels once each, forward and backward, at one realistic training shape: the
program that tools/gpu_check.sh runs under Nsight Compute (ncu) to read each kernel's achieved
DRAM bandwidth and SM throughput. DCNv3 and DCNv4 at FlashInternImage-T's stage 2 (batch 64)
in float32 and bfloat16; DCN v2 at ResNet-50's c4 stage (batch 8) in float32. One warm-up call
of each comes first, outside the NVTX range that ncu is told to profile.

    python tools/gpu_profile_once.py
"""

import torch

import deformconv
from deformconv.benchmarks.contenders import dcnv3_contenders
from deformconv.benchmarks.shapes import SHAPES, make_dcnv3_tensors, make_tensors


def forward_backward(run, operands):
    operands = [t.detach().requires_grad_(t.is_floating_point()) for t in operands]
    out = run(*operands)
    out.backward(torch.randn_like(out))


def main():
    calls = []
    for dtype in [torch.float32, torch.bfloat16]:
        shape = SHAPES["fit-stage2-batch64"]
        tensors = make_dcnv3_tensors(shape, dtype, device="cuda")
        for name, (run, operands) in dcnv3_contenders(shape, tensors).items():
            if name in ("dcnv3", "dcnv4"):
                calls.append((f"{name} {dtype}", run, operands))
    shape = SHAPES["c4-batch8"]
    x, offset, weight, bias, mask = make_tensors(shape, torch.float32, modulated=True,
                                                 device="cuda")
    calls.append(("deform_conv2d float32",
                  lambda x, o, w, b, m: deformconv.deform_conv2d(x, o, w, b, padding=1, mask=m),
                  [x, offset, weight, bias, mask]))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for _, run, operands in calls:
        forward_backward(run, operands)
    torch.cuda.synchronize()
    for name, run, operands in calls:
        torch.cuda.nvtx.range_push("profiled")
        forward_backward(run, operands)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        print("profiled", name)


if __name__ == "__main__":
    main()
