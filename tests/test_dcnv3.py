"""DCNv3 (deformconv.dcnv3) against its conventions (docs/dcnv3_dcnv4.md): hand-computed
vectors, a readable pure-PyTorch reference written from them, gradcheck, the four dtypes,
non-finite values, the backward's passes, argument errors. The PyTorch workflows and the
emulated CUDA launchers, for both ops: test_dcnv3_workflows.py."""

import math
import warnings

import pytest
import torch

import deformconv
from branching import branch_trace
from dcnv3_reference import (FORMULA_VECTORS, GEOMETRIES, dcnv3_reference, formula_operands,
                             random_operands, run, spec_vectors_input)


def test_vector_v1_tap_order_and_xy_order():
    input = spec_vectors_input(1, 3, 4, 1) - 0  # 10 y + x
    offset = torch.zeros(1, 3, 4, 18, dtype=torch.float64)
    mask = torch.zeros(1, 3, 4, 9, dtype=torch.float64)
    offset[0, 1, 1, 2], offset[0, 1, 1, 3], mask[0, 1, 1, 1] = 0.5, 0.25, 1.0
    out = run(deformconv.dcnv3, input, offset, mask, GEOMETRIES[0])
    expected = torch.zeros(1, 3, 4, 1, dtype=torch.float64)
    expected[0, 1, 1, 0] = 13.0
    assert torch.equal(out, expected)


@pytest.mark.parametrize("scale,dx,dy,expected", [
    (1.0, 0, 0, 111.0), (2.0, 0, 0, 100.0), (0.5, 0, 0, 116.5), (2.0, 1, 0, 102.0),
    (0.5, 1, -1, 112.0),
])
def test_vector_v2_offset_scale(scale, dx, dy, expected):
    input = spec_vectors_input(1, 5, 5, 1) + 100
    offset = torch.zeros(1, 5, 5, 18, dtype=torch.float64)
    mask = torch.zeros(1, 5, 5, 9, dtype=torch.float64)
    offset[0, 2, 2, 0], offset[0, 2, 2, 1], mask[0, 2, 2, 0] = dx, dy, 1.0
    out = run(deformconv.dcnv3, input, offset, mask, GEOMETRIES[0], offset_scale=scale)
    assert out[0, 2, 2, 0].item() == expected
    assert torch.count_nonzero(out).item() == (1 if expected else 0)


def test_vector_v3_borders_and_gradients():
    input = (spec_vectors_input(1, 3, 4, 1) + 100).requires_grad_()
    offset = torch.zeros(1, 3, 4, 2, dtype=torch.float64)
    for (y, x), (dx, dy) in {(0, 1): (0, -0.5), (2, 3): (0.5, 0.75), (0, 0): (0, -1),
                             (1, 1): (-2.5, 0), (1, 2): (0.25, 0.5), (2, 0): (-0.75, 0)}.items():
        offset[0, y, x] = torch.tensor([dx, dy], dtype=torch.float64)
    offset.requires_grad_()
    mask = torch.ones(1, 3, 4, 1, dtype=torch.float64, requires_grad=True)
    geometry = ((1, 1), (1, 1), (0, 0), (1, 1), 1, 1)
    out = run(deformconv.dcnv3, input, offset, mask, geometry)
    expected = {(0, 1): 50.5, (2, 3): 15.375, (0, 0): 0.0, (1, 1): 0.0, (1, 2): 117.25,
                (2, 0): 30.0, (0, 2): 102.0}
    for (y, x), value in expected.items():
        assert out[0, y, x, 0].item() == value, (y, x)
    out.sum().backward()
    for (y, x), value in {(0, 1): (0.5, 101.0), (2, 3): (-30.75, -61.5), (0, 0): (0.0, 0.0),
                          (2, 0): (120.0, -30.0)}.items():
        assert tuple(offset.grad[0, y, x].tolist()) == value, (y, x)
    assert mask.grad[0, 2, 3, 0].item() == 15.375


def test_vector_v4_remove_center():
    input = spec_vectors_input(1, 5, 5, 1) + 100
    offset = torch.zeros(1, 5, 5, 16, dtype=torch.float64)
    mask = torch.zeros(1, 5, 5, 8, dtype=torch.float64)
    mask[0, 2, 2, 4] = 1.0
    out = run(deformconv.dcnv3, input, offset, mask, GEOMETRIES[0], remove_center=True)
    assert out[0, 2, 2, 0].item() == 132.0


@pytest.mark.parametrize("name", sorted(FORMULA_VECTORS))
def test_formula_vectors(name):
    (N, H, W, G, D, kernel, stride, pad, dilation, scale, remove_center), sums = \
        FORMULA_VECTORS[name]
    operands = [t.requires_grad_() for t in
                formula_operands(N, H, W, G, D, kernel, stride, pad, dilation, remove_center)]
    out = run(deformconv.dcnv3, *operands, (kernel, stride, pad, dilation, G, D),
              offset_scale=scale, remove_center=remove_center)
    weights = (torch.arange(out.numel()) % 3 + 1).double().reshape(out.shape)
    (out * weights).sum().backward()
    measured = []
    for tensor in (out.detach(), operands[0].grad, operands[1].grad, operands[2].grad):
        measured += [tensor.sum().item(), (tensor * tensor).sum().item()]
    assert measured == list(sums)
    if name == "A":
        expected = torch.tensor([[5.6875, 14.40625, 44.28125, 17.859375],
                                 [29.0625, 41.203125, 28.28125, 28.0],
                                 [35.21875, 50.4375, 45.84375, 25.25]], dtype=torch.float64)
        assert torch.equal(out.detach()[0, :, :, 0], expected)


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("scale,remove_center", [(1.0, False), (0.5, True), (2.0, False),
                                                  (0.1, False)])
def test_matches_reference_forward_and_gradients(geometry, scale, remove_center):
    (kh, kw) = geometry[0]
    if remove_center and kh * kw == 1:
        pytest.skip("remove_center needs more than one point")
    operands = random_operands(2, 5, 6, geometry, remove_center)
    ours = [t.clone().requires_grad_() for t in operands]
    theirs = [t.clone().requires_grad_() for t in operands]
    out = run(deformconv.dcnv3, *ours, geometry, offset_scale=scale,
              remove_center=remove_center)
    expected = dcnv3_reference(*theirs, *sum(geometry[:4], ()), *geometry[4:], scale,
                               remove_center)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("geometry,remove_center", [(GEOMETRIES[1], False),
                                                    (GEOMETRIES[2], True)])
def test_gradcheck(geometry, remove_center):
    operands = [t.requires_grad_() for t in random_operands(1, 4, 5, geometry, remove_center,
                                                            spread=1.0, seed=3)]
    assert torch.autograd.gradcheck(
        lambda *t: run(deformconv.dcnv3, *t, geometry, offset_scale=0.75,
                       remove_center=remove_center), operands)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.float16, 2e-2),
                                             (torch.bfloat16, 1e-1)])
def test_dtypes_against_float64(dtype, tolerance):
    geometry = GEOMETRIES[5]
    operands = random_operands(2, 6, 7, geometry, dtype=dtype, spread=1.0)
    # The same (rounded) values in float64: what remains is the arithmetic's precision.
    reference = [t.double().requires_grad_() for t in operands]
    lowered = [t.clone().requires_grad_() for t in operands]
    expected = run(deformconv.dcnv3, *reference, geometry)
    out = run(deformconv.dcnv3, *lowered, geometry)
    assert out.dtype == dtype
    scale = expected.abs().max().item()
    torch.testing.assert_close(out.double(), expected, rtol=tolerance,
                               atol=tolerance * scale)
    out.backward(torch.ones_like(out))
    expected.backward(torch.ones_like(expected))
    for a, b in zip(lowered, reference):
        assert a.grad.dtype == dtype
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=tolerance,
                                   atol=tolerance * b.grad.abs().max().item())


def test_any_batch_size_and_im2col_step():
    geometry = GEOMETRIES[1]
    operands = random_operands(5, 4, 4, geometry)
    whole = run(deformconv.dcnv3, *operands, geometry)
    for step in (0, 1, 2, 256):
        assert torch.equal(run(deformconv.dcnv3, *operands, geometry, im2col_step=step), whole)
    for n in range(5):
        part = run(deformconv.dcnv3, *[t[n:n + 1] for t in operands], geometry)
        assert torch.equal(part, whole[n:n + 1])


@pytest.mark.parametrize("op", ["dcnv3", "dcnv4"])
def test_empty_input_with_padding_gives_zeros(op):
    """Height 0, padded to an output of 2 rows: nothing to sample, so the output and the
    offset and mask gradients are zero (not left as uninitialised memory)."""
    input = torch.randn(1, 0, 3, 2, dtype=torch.float64, requires_grad=True)
    offset = torch.randn(1, 2, 3, 2, dtype=torch.float64, requires_grad=True)
    mask = torch.randn(1, 2, 3, 1, dtype=torch.float64, requires_grad=True)
    scalars = (1, 1, 1, 1, 1, 0, 1, 1, 1, 2, 1.0)
    if op == "dcnv3":
        leaves = (input, offset, mask)
        out = deformconv.dcnv3(input, offset, mask, *scalars)
    else:
        offset_mask = torch.randn(1, 2, 3, 8, dtype=torch.float64, requires_grad=True)
        leaves = (input, offset_mask)
        out = deformconv.dcnv4(input, offset_mask, *scalars)
    assert out.shape == (1, 2, 3, 2) and torch.count_nonzero(out) == 0
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert grads[0].shape == input.shape
    assert all(torch.count_nonzero(grad) == 0 for grad in grads[1:])


def test_non_finite_positions_sample_nothing():
    geometry = GEOMETRIES[0]
    input, offset, mask = random_operands(1, 4, 4, geometry)
    offset[0, 1, 1, 0] = math.nan
    offset[0, 2, 2, 1] = math.inf
    out = run(deformconv.dcnv3, input, offset, mask, geometry)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("geometry", [GEOMETRIES[1], GEOMETRIES[5]])
def test_infinite_input_at_corners_of_zero_weight_makes_no_nan(geometry, dtype):
    """Zero offsets put every sample on a pixel: its other three corners weigh 0, and where
    its mask is 0 so does the pixel itself. An infinite input pixel that only such corners reach
    takes no part, not even 0 * infinity: the output is that of a zero there, bit for bit (16
    channels a group, the vectors' path, and 3, the channels one by one)."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw), G, D = geometry
    input, offset, mask = random_operands(2, 6, 7, geometry, dtype=dtype, seed=4)
    offset.zero_()
    P = kh * kw
    pixel = (1, 3, 2)
    # The weight of the pixel in each sample, point by point: the output for an input that is 1
    # there and 0 elsewhere, with the mask 1 at that point alone.
    one_hot = torch.zeros_like(input)
    one_hot[pixel] = 1
    reaches = torch.zeros_like(mask, dtype=torch.bool)
    for point in range(P):
        point_mask = torch.zeros_like(mask)
        point_mask[..., point::P] = 1
        weight = run(deformconv.dcnv3, one_hot, offset, point_mask, geometry)
        reaches[..., point::P] = weight.view(*weight.shape[:3], G, D)[..., 0] != 0
    assert reaches.any() and not reaches.all()
    mask[reaches] = 0
    infinite = input.clone()
    infinite[pixel] = math.inf
    zero = input.clone()
    zero[pixel] = 0
    with branch_trace() as taken:
        out = run(deformconv.dcnv3, infinite, offset, mask, geometry)
    assert "dcnv3.cpu.forward.non_finite_sums" in taken
    assert torch.isfinite(out).all()
    assert torch.equal(out, run(deformconv.dcnv3, zero, offset, mask, geometry))


@pytest.mark.parametrize("batch,threads", [(4, 1), (1, 2)])
def test_cpu_backward_passes_match_reference(batch, threads):
    """The CPU backward makes all the gradients in one pass over each image unless the images
    are at most half the threads (batch 4 on one thread: one pass; batch 1 on two: the input
    gradient by images and the offset and mask gradients apart); and separately too when only
    some gradients are asked for."""
    geometry = GEOMETRIES[3]
    operands = random_operands(batch, 5, 6, geometry, seed=5)
    (kh, kw), (sh, sw), (ph, pw), (dh, dw), G, D = geometry
    leaves = [t.clone().requires_grad_() for t in operands]
    expected = dcnv3_reference(*leaves, kh, kw, sh, sw, ph, pw, dh, dw, G, D, 0.5)
    grad_output = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, leaves, grad_output)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for output_mask in ([True, True, True], [True, False, False], [False, True, False],
                            [False, False, True]):
            grads = torch.ops.deformconv.dcnv3_backward(
                grad_output, *operands, kh, kw, sh, sw, ph, pw, dh, dw, G, D, 0.5, 0, False,
                output_mask)
            for wanted, grad, reference in zip(output_mask, grads, expected_grads):
                if wanted:
                    torch.testing.assert_close(grad, reference, rtol=1e-11, atol=1e-11)
                else:
                    assert grad is None
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("batch,threads", [(4, 1), (1, 2)])
@pytest.mark.parametrize("geometry", [GEOMETRIES[1], GEOMETRIES[5]])
def test_samples_of_zero_mask_add_nothing_to_the_input_gradient(geometry, batch, threads):
    """A sample of mask 0 weighs 0 at every corner and adds nothing to the input gradient, not
    even 0 * an infinite output gradient: NaN there would spread to every pixel it samples.
    Both CPU backward passes (batch 4 on one thread in one pass, batch 1 on two in two)."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw), G, D = geometry
    input, offset, mask = random_operands(batch, 6, 7, geometry, seed=3, spread=0.5)
    P = kh * kw
    mask[0, 1, 1, :P] = 0
    grad_output = torch.randn(*mask.shape[:3], G * D, dtype=input.dtype)
    finite_grad_output = grad_output.clone()
    grad_output[0, 1, 1, :D] = math.inf
    finite_grad_output[0, 1, 1, :D] = 0
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with branch_trace() as taken:
            grads = [torch.ops.deformconv.dcnv3_backward(
                grad, input, offset, mask, kh, kw, sh, sw, ph, pw, dh, dw, G, D, 1.0, 0, False,
                [True, True, True])[0] for grad in (grad_output, finite_grad_output)]
    finally:
        torch.set_num_threads(previous)
    assert "dcnv3.cpu.scatter.non_finite_gradient" in taken
    assert ("dcnv3.cpu.backward.one_pass" if 2 * batch > threads
            else "dcnv3.cpu.backward.input_pass") in taken
    assert torch.isfinite(grads[0]).all()
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


@pytest.mark.parametrize("backend,batch,threads", [("cpu", 4, 1), ("cpu", 1, 2),
                                                   ("emulated cuda", 2, 1)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_input_gradient_is_zero_where_no_sample_reaches(emulated, backend, batch, threads, dtype):
    """The backward gets the input gradient uninitialised and zeroes it itself (the CPU image
    by image, next to its scatter): a 1x1 kernel of stride 2 and zero offsets samples only the
    pixels of even row and column, and every other pixel's gradient is exactly 0, though
    uninitialised memory is filled with NaN here (torch.use_deterministic_algorithms with
    torch.utils.deterministic.fill_uninitialized_memory). Every pass that makes it (one pass
    on one thread, the input gradient apart on two), and a float32 sum for bfloat16."""
    input = torch.randn(batch, 6, 5, 16).to(dtype)
    offset = torch.zeros(batch, 3, 3, 2, dtype=dtype)
    mask = torch.ones(batch, 3, 3, 1, dtype=dtype)
    grad_output = torch.randn(batch, 3, 3, 16).to(dtype)
    backward = (torch.ops.deformconv.dcnv3_backward if backend == "cpu"
                else emulated.dcnv3_backward)
    previous = torch.get_num_threads()
    deterministic = (torch.are_deterministic_algorithms_enabled(),
                     torch.is_deterministic_algorithms_warn_only_enabled())
    torch.set_num_threads(threads)
    # warn_only: the CUDA launchers' input gradient adds atomically, which would raise.
    torch.use_deterministic_algorithms(True, warn_only=True)
    assert torch.utils.deterministic.fill_uninitialized_memory
    try:
        for output_mask in ([True, True, True], [True, False, False]):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                grad_input = backward(grad_output, input, offset, mask, 1, 1, 2, 2, 0, 0, 1, 1, 1,
                                      16, 1.0, 0, False, output_mask)[0]
            expected = torch.zeros_like(input)
            expected[:, ::2, ::2] = grad_output
            assert torch.equal(grad_input, expected)
    finally:
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
        torch.set_num_threads(previous)


@pytest.mark.parametrize("geometry,dtype", [(GEOMETRIES[5], torch.float32),
                                            (GEOMETRIES[3], torch.float64),
                                            (GEOMETRIES[4], torch.float64)])
def test_cpu_backward_is_deterministic_across_threads(geometry, dtype):
    """Batch 3 runs the backward in one pass over each image on one or two threads and in two
    passes on eight: the same gradients, to the last bit, with group_channels of one vector
    (16 floats), less than one (4) and more (17 doubles)."""
    operands = random_operands(3, 9, 8, geometry, dtype=dtype)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, 8):
            torch.set_num_threads(count)
            leaves = [t.clone().requires_grad_() for t in operands]
            out = run(deformconv.dcnv3, *leaves, geometry)
            out.backward(torch.linspace(-1.5, 2, out.numel(), dtype=dtype).view_as(out))
            results.append([out.detach()] + [t.grad for t in leaves])
    finally:
        torch.set_num_threads(threads)
    for result in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], result))


@pytest.mark.parametrize("change,pattern", [
    (lambda a: a.update(input=a["input"][..., :-1]), "group \\* group_channels"),
    (lambda a: a.update(offset=a["offset"][..., :-1]), "offset of shape"),
    (lambda a: a.update(mask=a["mask"][:, :-1]), "mask of shape"),
    (lambda a: a.update(input=a["input"][0]), "input to be a 4-D tensor"),
    (lambda a: a.update(stride_h=0), "stride_h to be at least 1"),
    (lambda a: a.update(group=0), "group to be at least 1"),
    (lambda a: a.update(offset_scale=math.inf), "offset_scale to be finite"),
    (lambda a: a.update(kernel_h=9), "at least as large as the dilated kernel"),
    (lambda a: a.update(input=a["input"][:, :1].expand(-1, 2 ** 31, -1, -1)),
     "height and width to be at most 2147483646, but got 2147483648 x 4"),
])
def test_bad_arguments_raise_value_errors(change, pattern):
    geometry = GEOMETRIES[1]
    input, offset, mask = random_operands(1, 4, 4, geometry)
    arguments = dict(input=input, offset=offset, mask=mask, kernel_h=3, kernel_w=3, stride_h=1,
                     stride_w=1, pad_h=1, pad_w=1, dilation_h=1, dilation_w=1, group=2,
                     group_channels=3, offset_scale=1.0)
    change(arguments)
    with pytest.raises(ValueError, match=pattern):
        deformconv.dcnv3(**arguments)


def test_wrong_dtype_raises_type_error():
    geometry = GEOMETRIES[1]
    input, offset, mask = random_operands(1, 4, 4, geometry)
    with pytest.raises(ValueError, match="mask to have the dtype of input"):
        run(deformconv.dcnv3, input, offset, mask.float(), geometry)

