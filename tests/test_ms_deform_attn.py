"""Multi-scale deformable attention against a readable reference (ms_deform_attn_reference.py),
gradcheck, every combination of requested gradients, dtypes, samples off and on the levels'
borders, determinism, and bad arguments."""

import itertools

import pytest
import torch

import deformconv
from ms_deform_attn_reference import (DEFAULT_OPTIONS, GRID, call, make_operands,
                                      ms_deform_attn_reference)

@pytest.mark.parametrize("shapes,heads,channels,points", GRID)
def test_matches_reference_forward_and_gradients(shapes, heads, channels, points):
    operands = make_operands(shapes, heads=heads, channels=channels, points=points)
    floating = [operands[0], operands[3], operands[4]]
    leaves = [t.clone().requires_grad_() for t in floating]
    ours = call([leaves[0], operands[1], operands[2], leaves[1], leaves[2]])
    grad_output = torch.randn_like(ours)
    ours_grads = torch.autograd.grad(ours, leaves, grad_output)
    references = [t.clone().requires_grad_() for t in floating]
    expected = ms_deform_attn_reference(references[0], operands[1], operands[2], references[1],
                                        references[2])
    expected_grads = torch.autograd.grad(expected, references, grad_output)
    torch.testing.assert_close(ours, expected)
    for name, got, want in zip(("value", "sampling_locations", "attention_weights"),
                               ours_grads, expected_grads):
        torch.testing.assert_close(got, want, msg=lambda m, name=name: f"{name}: {m}")


def test_gradcheck():
    operands = make_operands([(3, 4), (2, 2)], batch=1, queries=3, heads=2, channels=2,
                             points=2)
    value, shapes, starts, locations, weights = operands

    def op(value, locations, weights):
        return deformconv.ms_deform_attn(value, shapes, starts, locations, weights)

    assert torch.autograd.gradcheck(op, [t.requires_grad_() for t in (value, locations,
                                                                     weights)])


@pytest.mark.parametrize("requested", [r for r in itertools.product([False, True], repeat=3)
                                       if any(r)])
def test_every_combination_of_requested_gradients(requested):
    operands = make_operands([(4, 5), (2, 2)], heads=2, channels=5, points=3)
    grad_output = torch.randn(2, 5, 10, dtype=torch.float64)
    full = torch.ops.deformconv.ms_deform_attn_backward(grad_output, *operands, *DEFAULT_OPTIONS,
                                                        [True, True, True])
    some = torch.ops.deformconv.ms_deform_attn_backward(grad_output, *operands, *DEFAULT_OPTIONS,
                                                        list(requested))
    for want, got, reference in zip(requested, some, full):
        if want:
            assert torch.equal(got, reference)
        else:
            assert got is None


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.float16, 2e-2),
                                             (torch.bfloat16, 1e-1)])
def test_dtypes_against_float64(dtype, tolerance):
    """Half types accumulate in float32: compared on the same rounded operands, the output and
    the gradients are within a few roundings of the float64 op's."""
    operands = make_operands([(6, 5), (3, 3), (1, 1)], heads=2, channels=8, points=3,
                             dtype=dtype)
    exact = [t.double() if t.is_floating_point() else t for t in operands]
    grad_output = torch.randn(2, 5, 16, dtype=torch.float64)
    out = call(operands)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), call(exact), atol=tolerance, rtol=tolerance)
    grads = torch.ops.deformconv.ms_deform_attn_backward(grad_output.to(dtype), *operands,
                                                         *DEFAULT_OPTIONS, [True, True, True])
    exact_grads = torch.ops.deformconv.ms_deform_attn_backward(grad_output, *exact,
                                                               *DEFAULT_OPTIONS, [True, True, True])
    for got, want in zip(grads, exact_grads):
        assert got.dtype == dtype
        scale = want.abs().max().item()
        torch.testing.assert_close(got.double(), want, atol=tolerance * scale, rtol=tolerance)


def test_locations_far_outside_and_on_level_borders():
    operands = list(make_operands([(4, 4), (2, 3)], heads=2, channels=3, points=6))
    locations = operands[3]
    # Far outside on every side, exactly on each level's edges (0 and 1), and where a sample's
    # last corner row or column just leaves the level.
    edge = torch.tensor([[-5.0, 0.5], [0.5, 7.0], [0.0, 0.0], [1.0, 1.0], [0.0, 1.0],
                         [1.0 + 0.5 / 4, 0.3]], dtype=torch.float64)
    locations[:, :, :, :, :, :] = edge.view(1, 1, 1, 1, 6, 2)
    leaves = [operands[0].clone().requires_grad_(), locations.clone().requires_grad_(),
              operands[4].clone().requires_grad_()]
    ours = call([leaves[0], operands[1], operands[2], leaves[1], leaves[2]])
    expected = ms_deform_attn_reference(operands[0], operands[1], operands[2], locations,
                                        operands[4])
    torch.testing.assert_close(ours, expected)
    ours.sum().backward()
    assert all(torch.isfinite(leaf.grad).all() for leaf in leaves)
    # The far samples take no part: their gradients are 0.
    assert (leaves[1].grad[..., :2, :] == 0).all() and (leaves[2].grad[..., :2] == 0).all()


def test_infinite_values_in_rows_no_sample_reads_do_not_leak():
    """A sample off level 0 reads nothing of level 1's rows, which follow level 0's in value,
    and a sample of level 1 reads only its cell's four pixels: non-finite values in every other
    row change nothing, forward or backward."""
    value, shapes, starts, locations, weights = make_operands([(3, 3), (4, 4)], heads=1,
                                                             channels=4, points=3)
    locations[:, :, :, 0] = torch.tensor([1.5, 0.5], dtype=torch.float64)  # off level 0's right
    # At (x, y) = (0.4, 0.4) in level 1's pixels: its cell is pixels 0, 1, 4 and 5 of level 1.
    locations[:, :, :, 1] = 0.9 / 4
    read = {9 + pixel for pixel in (0, 1, 4, 5)}
    unread = [row for row in range(9 + 16) if row not in read]
    poisoned, clean = value.clone(), value.clone()
    poisoned[:, unread] = float("inf")
    poisoned[:, 4] = float("nan")
    clean[:, unread] = 0
    operands = [shapes, starts, locations, weights]
    out = call([poisoned, *operands])
    torch.testing.assert_close(out, call([clean, *operands]))
    grad_output = torch.randn_like(out)
    grads = torch.ops.deformconv.ms_deform_attn_backward(grad_output, poisoned, *operands,
                                                         *DEFAULT_OPTIONS, [True, True, True])
    clean_grads = torch.ops.deformconv.ms_deform_attn_backward(grad_output, clean, *operands,
                                                               *DEFAULT_OPTIONS, [True, True, True])
    for got, want in zip(grads, clean_grads):
        torch.testing.assert_close(got, want)


def test_cpu_backward_is_deterministic_across_threads():
    operands = make_operands([(8, 8), (4, 4)], batch=3, queries=40, heads=3, channels=8,
                             points=4, dtype=torch.float32)
    grad_output = torch.randn(3, 40, 24)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(torch.ops.deformconv.ms_deform_attn_backward(
                grad_output, *operands, *DEFAULT_OPTIONS, [True, True, True]))
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_im2col_step_changes_nothing_and_any_batch_works():
    operands = make_operands([(4, 5)], batch=5, heads=2, channels=3, points=2)
    reference = call(operands, 64)
    for step in (0, 1, 2, 3, 64):
        assert torch.equal(call(operands, step), reference)


def test_empty_queries_batch_and_channels():
    for batch, queries, channels in ((0, 5, 3), (2, 0, 3), (2, 5, 0)):
        operands = make_operands([(3, 3)], batch=batch, queries=queries, channels=channels)
        out = call(operands)
        assert out.shape == (batch, queries, 2 * channels)
    operands = make_operands([(3, 3)], points=0)
    assert torch.equal(call(operands), torch.zeros(2, 5, 6, dtype=torch.float64))


def test_double_backward_raises():
    operands = list(make_operands([(3, 3)]))
    operands[0].requires_grad_()
    out = call(operands)
    (grad,) = torch.autograd.grad(out.sum(), operands[0], create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        grad.sum().backward()


def changed(name, make):
    return pytest.param(name, make, id=name)


BAD = [
    ("level_start_index disagrees with spatial_shapes",
     lambda o: (o[0], o[1], torch.tensor([0, 23]), o[3], o[4]),
     ValueError, r"expected level_start_index\[1\] to be 24"),
    ("S disagrees with the levels",
     lambda o: (o[0][:, :-1], o[1], o[2], o[3], o[4]),
     ValueError, r"expected value to have as many rows \(dimension 1, 28\)"),
    ("a level of no pixels",
     lambda o: (o[0], torch.tensor([[4, 6], [0, 3]]), o[2], o[3], o[4]),
     ValueError, r"expected spatial_shapes\[1\] to be a \(height, width\) of 1"),
    ("spatial_shapes of floats",
     lambda o: (o[0], o[1].double(), o[2], o[3], o[4]),
     ValueError, "expected spatial_shapes to have an integer dtype"),
    ("spatial_shapes of 3 columns",
     lambda o: (o[0], torch.zeros(2, 3, dtype=torch.int64), o[2], o[3], o[4]),
     ValueError, r"expected spatial_shapes to be of shape \(levels, 2\)"),
    ("value of 3 dimensions",
     lambda o: (o[0][0], o[1], o[2], o[3], o[4]),
     ValueError, "expected value to be a 4-D tensor"),
    ("locations of another dtype",
     lambda o: (o[0], o[1], o[2], o[3].float(), o[4]),
     ValueError, "expected sampling_locations to have the dtype of value"),
    ("locations of another level count",
     lambda o: (o[0], o[1], o[2], o[3][:, :, :, :1], o[4]),
     ValueError, "expected sampling_locations of shape"),
    ("weights of another point count",
     lambda o: (o[0], o[1], o[2], o[3], o[4][..., :1]),
     ValueError, "expected attention_weights of shape"),
    ("integer value",
     lambda o: (o[0].long(), o[1], o[2], o[3], o[4]),
     ValueError, "expected value to have a floating point dtype"),
]


@pytest.mark.parametrize("case,change,error,pattern", BAD, ids=[b[0] for b in BAD])
def test_bad_arguments_raise(case, change, error, pattern):
    operands = make_operands([(4, 6), (1, 5)])
    with pytest.raises(error, match=pattern):
        call(change(operands))


def test_bad_im2col_step_raises():
    with pytest.raises(ValueError, match="expected im2col_step to be at least 0"):
        call(make_operands([(2, 2)]), -1)
