"""Forward and all five gradients of deformconv.deform_conv2d against the pure-PyTorch
reference (tests/deform_conv2d_reference.py), over geometries, masks, biases, batch sizes,
im2col steps and memory layouts; gradcheck in float64; low precision on the CPU."""

import json

import pytest
import torch

import deformconv
from deform_conv2d_cases import (GEOMETRIES, Geometry, differentiable, forward_and_grads,
                                 make_operands, strided_copies)
from deform_conv2d_reference import deform_conv2d_reference
from fresh_process import run_script


def assert_close_all(actual, expected, **tolerance):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, **tolerance)


def check_against_reference(operands, geometry, *, atol=1e-10, rtol=1e-10, **kwargs):
    out, grads = forward_and_grads(deformconv.deform_conv2d, *operands, geometry, **kwargs)
    ref_out, ref_grads = forward_and_grads(deform_conv2d_reference, *operands, geometry)
    torch.testing.assert_close(out, ref_out, atol=atol, rtol=rtol)
    assert_close_all(grads, ref_grads, atol=atol, rtol=rtol)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
@pytest.mark.parametrize("with_mask", [False, True], ids=["v1", "v2"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_matches_reference(geometry, with_mask, with_bias):
    operands = make_operands(geometry, with_mask=with_mask, with_bias=with_bias)
    check_against_reference(operands, geometry)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
@pytest.mark.parametrize("with_mask", [False, True], ids=["v1", "v2"])
def test_im2col_forward_matches_reference(geometry, with_mask, im2col_forward):
    operands = make_operands(geometry, with_mask=with_mask)
    check_against_reference(operands, geometry)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16,
                                   torch.bfloat16], ids=str)
def test_fused_and_im2col_forwards_agree(dtype, monkeypatch):
    # Conv groups and deform groups that do not line up; 60 output channels per group, which
    # the fused forward's multiply-adds take as vectors of two registers' width, of one, and
    # one by one (float32: 32 + 16 + 12 on AVX-512, 3 x 16 + 8 + 4 on AVX2); and a stretch of
    # output pixels that does not divide into its blocks of pixels. Both forwards sum each
    # output over (tap, input channel) in the same order.
    geometry = Geometry("fused", 3, 12, 120, 11, 13, (3, 2), stride=(1, 2), padding=(1, 1),
                        dilation=(2, 1), groups=2, offset_groups=3)
    input, offset, weight, bias, mask = make_operands(geometry, dtype=dtype, offset_scale=3.0)
    arguments = dict(stride=geometry.stride, padding=geometry.padding,
                     dilation=geometry.dilation, mask=mask)
    fused = deformconv.deform_conv2d(input, offset, weight, bias, **arguments)
    monkeypatch.setenv("DEFORMCONV_FUSED_FORWARD", "0")
    im2col = deformconv.deform_conv2d(input, offset, weight, bias, **arguments)
    tolerance = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-2,
                 torch.bfloat16: 1e-1}[dtype]
    torch.testing.assert_close(fused, im2col, atol=tolerance, rtol=tolerance)
    reference = deform_conv2d_reference(input.double(), offset.double(), weight.double(),
                                        bias.double(), mask=mask.double(),
                                        stride=geometry.stride, padding=geometry.padding,
                                        dilation=geometry.dilation)
    torch.testing.assert_close(fused.double(), reference, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("geometry", GEOMETRIES[1:3], ids=str)
def test_offsets_far_outside_the_image(geometry):
    # Scale 25 on images of side < 12: most samples land outside, some partly inside.
    operands = make_operands(geometry, offset_scale=25.0)
    check_against_reference(operands, geometry)


def test_samples_straddling_the_border():
    # Offsets that put samples within one pixel outside the image, where only some corners
    # of the bilinear cell are inside.
    geometry = Geometry("border", 2, 2, 3, 5, 5, (3, 3), padding=(1, 1))
    input, offset, weight, bias, mask = make_operands(geometry)
    offset = torch.where(torch.rand_like(offset) < 0.5, offset.sign() * 1.3, offset)
    check_against_reference((input, offset, weight, bias, mask), geometry)


@pytest.mark.parametrize("batch,im2col_step", [(0, 0), (0, 3), (1, 0), (1, 5), (7, 3),
                                               (7, 1), (7, 0), (7, 64)])
def test_batch_sizes_and_im2col_step(batch, im2col_step):
    geometry = GEOMETRIES[4]
    operands = make_operands(geometry, batch=batch)
    out, grads = forward_and_grads(deformconv.deform_conv2d, *operands, geometry,
                                   im2col_step=im2col_step)
    out_h, out_w = geometry.output_size()
    assert out.shape == (batch, geometry.out_channels, out_h, out_w)
    assert [g.shape for g in grads] == [t.shape for t in operands if t is not None]
    ref_out, ref_grads = forward_and_grads(deform_conv2d_reference, *operands, geometry)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-10)
    assert_close_all(grads, ref_grads, atol=1e-10, rtol=1e-10)


def test_result_does_not_depend_on_im2col_step():
    geometry = GEOMETRIES[2]
    operands = make_operands(geometry, batch=5)
    baseline, baseline_grads = forward_and_grads(deformconv.deform_conv2d, *operands, geometry,
                                                 im2col_step=5)
    for step in (1, 2, 3, 4, 0):
        out, grads = forward_and_grads(deformconv.deform_conv2d, *operands, geometry,
                                       im2col_step=step)
        torch.testing.assert_close(out, baseline, atol=1e-12, rtol=1e-12)
        assert_close_all(grads, baseline_grads, atol=1e-12, rtol=1e-12)


def test_non_contiguous_and_channels_last_operands():
    geometry = GEOMETRIES[1]
    input, offset, weight, bias, mask = make_operands(geometry)
    expected, expected_grads = forward_and_grads(deformconv.deform_conv2d, input, offset,
                                                 weight, bias, mask, geometry)
    strided = strided_copies(input, offset, weight, bias, mask)
    out, grads = forward_and_grads(deformconv.deform_conv2d, *strided, geometry)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-12)
    assert_close_all(grads, expected_grads, atol=1e-12, rtol=1e-12)


def test_only_requested_gradients_are_computed():
    geometry = GEOMETRIES[1]
    input, offset, weight, bias, mask = make_operands(geometry)
    expected_out, expected_grads = forward_and_grads(deform_conv2d_reference, input, offset,
                                                     weight, bias, mask, geometry)
    names = ["input", "offset", "weight", "bias", "mask"]
    for wanted in range(5):
        leaves = [t.detach().clone() for t in (input, offset, weight, bias, mask)]
        leaves[wanted].requires_grad_()
        x, o, w, b, m = leaves
        out = deformconv.deform_conv2d(x, o, w, b, geometry.stride, geometry.padding,
                                       geometry.dilation, m)
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1),
                               dtype=torch.float64)
        (grad,) = torch.autograd.grad(out, leaves[wanted], grad_out)
        torch.testing.assert_close(grad, expected_grads[wanted], atol=1e-10, rtol=1e-10,
                                   msg=lambda m, name=names[wanted]: f"{name}: {m}")


def test_backward_op_returns_none_for_gradients_not_asked_for():
    geometry = GEOMETRIES[1]
    input, offset, weight, _, mask = make_operands(geometry)
    grad_output = torch.ones(geometry.batch, geometry.out_channels, *geometry.output_size(),
                             dtype=torch.float64)
    grads = torch.ops.deformconv.deform_conv2d_backward(
        grad_output, input, offset, weight, mask, geometry.stride, geometry.padding,
        geometry.dilation, 1, 1, 0, [False, True, False, True, False])
    assert grads[0] is None and grads[2] is None and grads[4] is None
    assert grads[1].shape == offset.shape and grads[3].shape == mask.shape


@pytest.mark.parametrize("with_mask", [False, True], ids=["v1", "v2"])
def test_gradcheck(with_mask):
    geometry = Geometry("small", 2, 4, 2, 5, 4, (2, 3), stride=(1, 2), padding=(1, 1),
                        dilation=(2, 1), groups=2, offset_groups=2)
    input, offset, weight, bias, mask = make_operands(geometry, with_mask=with_mask)
    # Random offsets almost surely keep samples off integer coordinates, where bilinear
    # interpolation has kinks; shift any that come within 1e-3 of one.
    near_integer = (offset - offset.round()).abs() < 1e-3
    offset = torch.where(near_integer, offset + 0.01, offset)
    leaves = [t for t in differentiable(input, offset, weight, bias, mask) if t is not None]

    def fn(*args):
        x, o, w, b = args[:4]
        m = args[4] if with_mask else None
        return deformconv.deform_conv2d(x, o, w, b, geometry.stride, geometry.padding,
                                        geometry.dilation, m, im2col_step=1)

    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_on_cpu(dtype):
    # The error of our low-precision result against float64 must stay within a small multiple
    # of the error that the plain-PyTorch reference itself makes at that precision.
    geometry = GEOMETRIES[1]
    operands = make_operands(geometry)
    exact, exact_grads = forward_and_grads(deform_conv2d_reference, *operands, geometry)
    low = [None if t is None else t.to(dtype) for t in operands]
    ours, ours_grads = forward_and_grads(deformconv.deform_conv2d, *low, geometry)
    theirs, theirs_grads = forward_and_grads(deform_conv2d_reference, *low, geometry)
    assert ours.dtype == dtype
    for a, b, e in zip([ours] + ours_grads, [theirs] + theirs_grads, [exact] + exact_grads):
        our_error = (a.double() - e).abs().max().item()
        reference_error = (b.double() - e).abs().max().item()
        assert our_error <= 3 * reference_error + 1e-3 * e.abs().max().item()


def test_float32_matches_float64_reference():
    geometry = GEOMETRIES[4]
    operands = make_operands(geometry)
    out, grads = forward_and_grads(deformconv.deform_conv2d,
                                   *[None if t is None else t.float() for t in operands],
                                   geometry)
    ref_out, ref_grads = forward_and_grads(deform_conv2d_reference, *operands, geometry)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-4, rtol=1e-4)
    assert_close_all([g.double() for g in grads], ref_grads, atol=1e-4, rtol=1e-4)


def test_package_metadata():
    assert isinstance(deformconv.__version__, str) and deformconv.__version__.count(".") == 2
    assert isinstance(deformconv.cuda_compiled(), bool)


@pytest.mark.parametrize("im2col_step", [0, 3])
def test_output_pixels_tiled_into_windows(im2col_step, im2col_forward):
    # The CPU launchers aim at 4 MiB of columns and plans per window of output pixels, at least
    # 1,024 pixels in the forward and 512 in the backward, evened out: in float64, 16 channels
    # and 4 deform groups of 9 taps take 3,456 bytes per pixel and image. With the default step
    # (one image per block) the 4,096 output pixels are worked in 3 windows of 1,366 pixels
    # (1,364 the last); with im2col_step 3, in 4 forward windows of 1,024 and 8 backward ones
    # of 512. Windows must join up seamlessly.
    geometry = Geometry("windows", 7, 16, 8, 64, 64, (3, 3), padding=(1, 1), groups=2,
                        offset_groups=4)
    operands = make_operands(geometry)
    check_against_reference(operands, geometry, im2col_step=im2col_step)


# A wide input of many channels and a stride of 2 make the input-sized buffers (32 MiB each)
# outweigh the rest: the columns of a window (4 MiB at most on the CPU), its sampling plans, the
# offset and mask gradients (2 MiB). Run in a fresh process whose scratch pool keeps no block
# (DEFORMCONV_KEPT_SCRATCH_MIB=0): the profiler counts the blocks the pool keeps, and the pool
# would keep the channels-last copy of the input for the next call, past the end of its use.
BACKWARD_PEAK_SCRIPT = """
import json, torch, deformconv
from deformconv.benchmarks.timing import peak_bytes
torch.manual_seed(0)
input = torch.randn(1, 128, 256, 256)
offset = torch.randn(1, 18, 128, 128)
mask = torch.rand(1, 9, 128, 128)
weight = torch.randn(8, 128, 3, 3)
grad_output = torch.randn(1, 8, 128, 128)
backward = torch.ops.deformconv.deform_conv2d_backward
peak = peak_bytes(lambda: backward(grad_output, input, offset, weight, mask, [2, 2], [1, 1],
                                   [1, 1], 1, 1, 0, [True] * 5))
print(json.dumps({"peak": peak, "input": input.numel() * input.element_size()}))
"""


def test_backward_never_holds_three_input_sized_buffers(tmp_path):
    # Note in core/deform_conv2d_backward.cpp: with a contiguous input, grad_input, the
    # channels-last buffer that col2im adds into and the channels-last copy of the input are
    # never all live at once (all three: 3.4 times the input).
    run = run_script(BACKWARD_PEAK_SCRIPT, tmp_path, DEFORMCONV_KEPT_SCRATCH_MIB="0")
    assert run.returncode == 0, run.stderr
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    assert measured["peak"] < 2.75 * measured["input"], measured
