"""CUDA against the CPU path. Skipped where no GPU is present, which is every machine of this
project's CI; run them on a machine with one."""

import pytest
import torch

import deformconv
from deform_conv2d_cases import GEOMETRIES, forward_and_grads, make_operands

needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and deformconv.cuda_compiled()),
    reason="needs a CUDA device and deformconv built with its CUDA kernels")
pytestmark = [pytest.mark.cuda, needs_cuda]


def to(operands, device, dtype=None):
    return [None if t is None else t.to(device=device, dtype=dtype or t.dtype)
            for t in operands]


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
@pytest.mark.parametrize("with_mask", [False, True], ids=["v1", "v2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_matches_cpu(geometry, with_mask, dtype):
    operands = make_operands(geometry, with_mask=with_mask, dtype=dtype)
    cpu_out, cpu_grads = forward_and_grads(deformconv.deform_conv2d, *operands, geometry)
    out, grads = forward_and_grads(deformconv.deform_conv2d, *to(operands, "cuda"), geometry)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(out.cpu(), cpu_out, **tol)
    for a, b in zip(grads, cpu_grads):
        torch.testing.assert_close(a.cpu(), b, **tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_low_precision_within_float32_bound(dtype):
    # Error against a float64 run on the same operands rounded to dtype, within a few rounding
    # steps of the dtype times the result's magnitude: what summing in float32 and rounding the
    # result once allows. The float64 run takes the rounded operands because the offset
    # gradient jumps where a sample crosses an integer coordinate (bilinear weights are only
    # piecewise linear): rounding an offset to 8 bits can move a sample across one, and against
    # the unrounded operands that shows as an error of the gradient's own size.
    geometry = GEOMETRIES[1]
    rounded = [None if t is None else t.to(dtype) for t in make_operands(geometry)]
    exact, exact_grads = forward_and_grads(
        deformconv.deform_conv2d, *to(rounded, "cuda", torch.float64), geometry)
    low, low_grads = forward_and_grads(deformconv.deform_conv2d, *to(rounded, "cuda"), geometry)
    step = torch.finfo(dtype).eps
    for a, e in zip([low] + low_grads, [exact] + exact_grads):
        assert a.dtype == dtype
        error = (a.double() - e).abs().max().item()
        assert error <= 4 * step * e.abs().max().item()


def test_cuda_batch_blocks_and_empty_batch():
    geometry = GEOMETRIES[4]
    for batch, step in ((0, 0), (7, 3)):
        operands = make_operands(geometry, batch=batch)
        cpu_out, cpu_grads = forward_and_grads(deformconv.deform_conv2d, *operands, geometry)
        out, grads = forward_and_grads(deformconv.deform_conv2d, *to(operands, "cuda"),
                                       geometry, im2col_step=step)
        torch.testing.assert_close(out.cpu(), cpu_out)
        for a, b in zip(grads, cpu_grads):
            torch.testing.assert_close(a.cpu(), b)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_second_device():
    geometry = GEOMETRIES[1]
    operands = make_operands(geometry)
    cpu_out, _ = forward_and_grads(deformconv.deform_conv2d, *operands, geometry)
    out, _ = forward_and_grads(deformconv.deform_conv2d, *to(operands, "cuda:1"), geometry)
    assert out.device == torch.device("cuda:1")
    torch.testing.assert_close(out.cpu(), cpu_out)


def test_mixed_devices_raise():
    geometry = GEOMETRIES[1]
    input, offset, weight, bias, mask = make_operands(geometry)
    with pytest.raises(ValueError, match="expected offset to be on the device of input"):
        deformconv.deform_conv2d(input.cuda(), offset, weight.cuda())


def test_cuda_autocast_computes_in_float32():
    geometry = GEOMETRIES[1]
    x, o, w, b, m = to(make_operands(geometry, dtype=torch.float32), "cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        out = deformconv.deform_conv2d(x.half(), o.half(), w, b, 1, 1, 1, m)
    assert out.dtype == torch.float32
    expected = deformconv.deform_conv2d(x.half().float(), o.half().float(), w, b, 1, 1, 1, m)
    torch.testing.assert_close(out, expected)
