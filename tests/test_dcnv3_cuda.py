"""DCNv3 and DCNv4 on a GPU against the CPU op: forward and every gradient, in four dtypes, over
the geometries of tests/dcnv3_reference.py. Skipped where no GPU is present, which is every
machine of this project's CI; tools/gpu_check.sh runs them on a machine with one."""

import pytest
import torch

import deformconv
from branching import assert_close_at
from dcnv3_reference import GEOMETRIES, pack_offset_mask, random_operands

needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and deformconv.cuda_compiled()),
    reason="needs a CUDA device and deformconv built with its CUDA kernels")
pytestmark = [pytest.mark.cuda, needs_cuda]

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def arguments(geometry, remove_center):
    (kh, kw), (sh, sw), (ph, pw), (dh, dw), G, D = geometry
    return (kh, kw, sh, sw, ph, pw, dh, dw, G, D, 0.5, 0, remove_center)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
@pytest.mark.parametrize("op", ["dcnv3", "dcnv4"])
def test_cuda_matches_cpu(op, geometry, dtype):
    remove_center = geometry[0] == (3, 3)
    input, offset, mask = random_operands(2, 6, 7, geometry, remove_center=remove_center)
    G = geometry[4]
    operands = [input, offset, mask] if op == "dcnv3" else [
        input, pack_offset_mask(offset, mask, G, padding_value=0.0)]
    low = [t.to(dtype) for t in operands]
    # The CPU op in float64 on the same rounded operands: what remains is the GPU's arithmetic
    # at that precision.
    exact = [t.double() for t in low]
    tail = arguments(geometry, remove_center)
    forward = getattr(torch.ops.deformconv, op)
    backward = getattr(torch.ops.deformconv, op + "_backward")
    expected = forward(*exact, *tail)
    grad_output = torch.randn(expected.shape, generator=torch.Generator().manual_seed(2),
                              dtype=torch.float64)
    flags = [True] * len(operands)
    expected_grads = backward(grad_output, *exact, *tail, flags)
    on_gpu = [t.cuda() for t in low]
    out = forward(*on_gpu, *tail)
    grads = backward(grad_output.to(dtype).cuda(), *on_gpu, *tail, flags)
    assert out.dtype == dtype and out.is_cuda
    assert_close_at(out.cpu(), expected, dtype, "output")
    for index, (grad, full) in enumerate(zip(grads, expected_grads)):
        assert grad.dtype == dtype
        assert_close_at(grad.cpu(), full, dtype, f"gradient {index}")


@pytest.mark.parametrize("op", ["dcnv3", "dcnv4"])
def test_cuda_gradcheck(op):
    geometry = GEOMETRIES[1]
    input, offset, mask = random_operands(1, 4, 5, geometry)
    G = geometry[4]
    operands = [input, offset, mask] if op == "dcnv3" else [
        input, pack_offset_mask(offset, mask, G, padding_value=0.0)]
    leaves = [t.cuda().requires_grad_() for t in operands]
    function = getattr(deformconv, op)
    tail = arguments(geometry, False)
    assert torch.autograd.gradcheck(lambda *args: function(*args, *tail), leaves, eps=1e-6,
                                    atol=1e-6)
