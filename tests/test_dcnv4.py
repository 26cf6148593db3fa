"""DCNv4 (deformconv.dcnv4) against its conventions (docs/dcnv3_dcnv4.md, DCNv4's packed
offset_mask): the V5 vector, the hand-computed DCNv3 vectors packed into offset_mask, DCNv3's pure-PyTorch reference over packed
operands whose padding is NaN, gradcheck and argument errors. The PyTorch workflows and the
emulated CUDA launchers, for both ops: test_dcnv3_workflows.py."""

import pytest
import torch

import deformconv
from dcnv3_reference import (FORMULA_VECTORS, GEOMETRIES, dcnv3_reference, formula_operands,
                             pack_offset_mask, random_operands, spec_vectors_input,
                             unpack_offset_mask)


def run(op, input, offset_mask, geometry, offset_scale=1.0, remove_center=False,
        im2col_step=0):
    (kh, kw), (sh, sw), (ph, pw), (dh, dw), G, D = geometry
    return op(input, offset_mask, kh, kw, sh, sw, ph, pw, dh, dw, G, D, offset_scale,
              im2col_step, remove_center)


def points(geometry, remove_center):
    (kh, kw) = geometry[0]
    return kh * kw - int(remove_center)


def test_vector_v5_packed_layout():
    input = spec_vectors_input(1, 3, 4, 2)
    offset_mask = torch.zeros(1, 3, 4, 56, dtype=torch.float64)
    offset_mask[..., 54:] = 1000.0
    offset_mask[0, 1, 2, 33], offset_mask[0, 1, 2, 34] = 0.5, 0.25
    offset_mask[0, 1, 2, 48], offset_mask[0, 1, 2, 22] = 2.0, -1.0
    out = run(deformconv.dcnv4, input, offset_mask, ((3, 3), (1, 1), (1, 1), (1, 1), 2, 1))
    expected = torch.zeros(1, 3, 4, 2, dtype=torch.float64)
    expected[0, 1, 2, 0], expected[0, 1, 2, 1] = -12.0, 210.0
    assert torch.equal(out, expected)


@pytest.mark.parametrize("name", sorted(FORMULA_VECTORS))
def test_formula_vectors_packed(name):
    (N, H, W, G, D, kernel, stride, pad, dilation, scale, remove_center), sums = \
        FORMULA_VECTORS[name]
    input, offset, mask = formula_operands(N, H, W, G, D, kernel, stride, pad, dilation,
                                           remove_center)
    input.requires_grad_()
    # Padded to a multiple of 7, which leaves padding channels in every vector.
    offset_mask = pack_offset_mask(offset, mask, G, padding_value=7.0,
                                   multiple=7).requires_grad_()
    out = run(deformconv.dcnv4, input, offset_mask, (kernel, stride, pad, dilation, G, D),
              offset_scale=scale, remove_center=remove_center)
    weights = (torch.arange(out.numel()) % 3 + 1).double().reshape(out.shape)
    (out * weights).sum().backward()
    P = kernel[0] * kernel[1] - int(remove_center)
    grad_offset, grad_mask, grad_padding = unpack_offset_mask(offset_mask.grad, G, P)
    measured = []
    for tensor in (out.detach(), input.grad, grad_offset, grad_mask):
        measured += [tensor.sum().item(), (tensor * tensor).sum().item()]
    assert measured == list(sums)
    assert grad_padding.numel() > 0 and torch.count_nonzero(grad_padding).item() == 0


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("scale,remove_center", [(1.0, False), (0.5, True), (2.0, False)])
def test_matches_reference_with_nan_padding(geometry, scale, remove_center):
    if remove_center and points(geometry, False) == 1:
        pytest.skip("remove_center needs more than one point")
    input, offset, mask = random_operands(2, 5, 6, geometry, remove_center)
    G = geometry[4]
    ours = [input.clone().requires_grad_(), pack_offset_mask(offset, mask, G).requires_grad_()]
    theirs = [t.clone().requires_grad_() for t in (input, offset, mask)]
    out = run(deformconv.dcnv4, *ours, geometry, offset_scale=scale,
              remove_center=remove_center)
    expected = dcnv3_reference(*theirs, *sum(geometry[:4], ()), *geometry[4:], scale,
                               remove_center)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    grad_offset, grad_mask, grad_padding = unpack_offset_mask(
        ours[1].grad, G, points(geometry, remove_center))
    torch.testing.assert_close(ours[0].grad, theirs[0].grad, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(grad_offset, theirs[1].grad, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(grad_mask, theirs[2].grad, rtol=1e-11, atol=1e-11)
    assert torch.count_nonzero(grad_padding).item() == 0


def test_equals_dcnv3_on_the_same_operands():
    geometry = GEOMETRIES[5]
    input, offset, mask = random_operands(3, 7, 6, geometry, dtype=torch.float32)
    offset_mask = pack_offset_mask(offset, mask, geometry[4], multiple=16)
    (kh, kw), (sh, sw), (ph, pw), (dh, dw), G, D = geometry
    assert torch.equal(run(deformconv.dcnv4, input, offset_mask, geometry),
                       deformconv.dcnv3(input, offset, mask, kh, kw, sh, sw, ph, pw, dh, dw, G,
                                        D, 1.0))


def test_gradcheck():
    geometry = GEOMETRIES[2]
    input, offset, mask = random_operands(1, 4, 5, geometry, True, spread=1.0, seed=3)
    operands = [input.requires_grad_(),
                pack_offset_mask(offset, mask, geometry[4], padding_value=0.3).requires_grad_()]
    assert torch.autograd.gradcheck(
        lambda *t: run(deformconv.dcnv4, *t, geometry, offset_scale=0.75, remove_center=True),
        operands)


@pytest.mark.parametrize("change,error,pattern", [
    (lambda a: a.update(offset_mask=a["offset_mask"][..., :50]), ValueError,
     "offset_mask to have at least group \\* points \\* 3 = 2 \\* 9 \\* 3 = 54 channels"),
    (lambda a: a.update(offset_mask=a["offset_mask"][:, :-1]), ValueError,
     "offset_mask of shape"),
    (lambda a: a.update(offset_mask=a["offset_mask"][0]), ValueError,
     "offset_mask to be a 4-D tensor"),
    (lambda a: a.update(offset_mask=a["offset_mask"].float()), ValueError,
     "offset_mask to have the dtype of input"),
    (lambda a: a.update(input=a["input"][..., :-1]), ValueError,
     "input to have group \\* group_channels"),
    (lambda a: a.update(dilation_w=0), ValueError, "dilation_w to be at least 1"),
])
def test_bad_arguments_raise(change, error, pattern):
    geometry = GEOMETRIES[1]
    input, offset, mask = random_operands(1, 4, 4, geometry)
    arguments = dict(input=input, offset_mask=pack_offset_mask(offset, mask, 2), kernel_h=3,
                     kernel_w=3, stride_h=1, stride_w=1, pad_h=1, pad_w=1, dilation_h=1,
                     dilation_w=1, group=2, group_channels=3, offset_scale=1.0)
    change(arguments)
    with pytest.raises(error, match="dcnv4\\(\\): expected " + pattern):
        deformconv.dcnv4(**arguments)
