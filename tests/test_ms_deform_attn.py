"""Multi-scale deformable attention against a readable reference (per level, F.grid_sample of
that level, weighted and summed), gradcheck, the levels' checks, the PyTorch workflows, and
the CUDA launchers' paths under the emulator."""

import itertools

import pytest
import torch
import torch.nn.functional as F

import deformconv
from branching import (assert_close_at, branch_trace, channel_loops, cuda_lane_paths,
                       misaligned, opmath_bytes, requested_subsets, vector_bytes)

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def ms_deform_attn_reference(value, spatial_shapes, level_start_index, sampling_locations,
                             attention_weights):
    """The op's definition written out: each level of each head sampled by grid_sample on
    2 * loc - 1 (align_corners=False, zeros outside), weighted, and summed over the levels and
    points. Differentiable in every floating operand."""
    N, S, M, D = value.shape
    _, Lq, _, L, P, _ = sampling_locations.shape
    out = value.new_zeros(N * M, D, Lq)
    for level, ((H, W), start) in enumerate(zip(spatial_shapes.tolist(),
                                                level_start_index.tolist())):
        image = value[:, start:start + H * W].permute(0, 2, 3, 1).reshape(N * M, D, H, W)
        grid = 2 * sampling_locations[:, :, :, level] - 1  # (N, Lq, M, P, 2)
        grid = grid.transpose(1, 2).reshape(N * M, Lq, P, 2)
        sampled = F.grid_sample(image, grid, mode="bilinear", padding_mode="zeros",
                                align_corners=False)  # (N * M, D, Lq, P)
        weights = attention_weights[:, :, :, level].transpose(1, 2).reshape(N * M, 1, Lq, P)
        out = out + (sampled * weights).sum(-1)
    return out.view(N, M, D, Lq).permute(0, 3, 1, 2).reshape(N, Lq, M * D)


def levels_of(shapes):
    spatial_shapes = torch.tensor(shapes, dtype=torch.int64).view(-1, 2)
    areas = spatial_shapes.prod(1)
    level_start_index = torch.cat([areas.new_zeros(1), areas.cumsum(0)[:-1]])
    return spatial_shapes, level_start_index, int(areas.sum())


def make_operands(shapes, batch=2, queries=5, heads=2, channels=3, points=2, spread=1.4,
                  dtype=torch.float64, seed=0):
    """Random operands; locations in (-0.2, 1.2) by default, so that some samples fall off their
    level on every side, and attention weights of both signs."""
    generator = torch.Generator().manual_seed(seed)
    spatial_shapes, level_start_index, S = levels_of(shapes)
    L = spatial_shapes.shape[0]
    value = torch.randn(batch, S, heads, channels, generator=generator, dtype=torch.float64)
    locations = (torch.rand(batch, queries, heads, L, points, 2, generator=generator,
                            dtype=torch.float64) - 0.5) * spread + 0.5
    weights = torch.randn(batch, queries, heads, L, points, generator=generator,
                          dtype=torch.float64)
    return (value.to(dtype), spatial_shapes, level_start_index, locations.to(dtype),
            weights.to(dtype))


def assert_requested_gradients(requested, grads, expected, dtype):
    """The backward's (value, sampling_locations, attention_weights) gradients: those requested
    close to `expected` at dtype's precision, the others not made."""
    for name, want, grad, full in zip(("value", "sampling_locations", "attention_weights"),
                                      requested, grads, expected):
        if want:
            assert_close_at(grad, full, dtype, f"{name} of {requested}")
        else:
            assert grad is None


def call(operands, im2col_step=64):
    return deformconv.ms_deform_attn(*operands, im2col_step)


# Levels of different sizes, 1x1 among them; heads, channels (1, 3, 32, 33) and points.
GRID = [
    ([(4, 6), (2, 3), (1, 1)], 1, 1, 1),
    ([(5, 3)], 2, 3, 4),
    ([(3, 4), (1, 1), (2, 2)], 8, 32, 1),
    ([(6, 5), (3, 3)], 3, 33, 8),
    ([(1, 1), (1, 1)], 4, 3, 3),
    ([(2, 7), (7, 2), (4, 4), (1, 3)], 2, 1, 2),
]


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
    full = torch.ops.deformconv.ms_deform_attn_backward(grad_output, *operands, 64,
                                                        [True, True, True])
    some = torch.ops.deformconv.ms_deform_attn_backward(grad_output, *operands, 64,
                                                        list(requested))
    for want, got, reference in zip(requested, some, full):
        if want:
            assert torch.equal(got, reference)
        else:
            assert got is None


LANES = 8  # kLanes of csrc/cpu/cpu_loops.h
CPU_BRANCHES = ("ms_deform_attn.cpu.scatter.", "ms_deform_attn.cpu.dots.")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("channels", [3, 8, 32, 33])
def test_cpu_backward_channel_loops(channels, dtype):
    """The CPU backward's channel loops (the value gradient's scatter in vectors of the clone's
    register width, then of kLanes, then one by one; the corner dot products kLanes at a time,
    the last channels in zero-filled lanes), each forced by the head's channels and checked to
    have run, for every combination of requested gradients, against the reference's gradients
    in float64 on the same rounded operands."""
    operands = make_operands([(5, 4), (2, 3), (1, 1)], heads=2, channels=channels, points=3,
                             seed=channels)
    rounded = [operands[0].to(dtype), operands[3].to(dtype), operands[4].to(dtype)]
    leaves = [t.double().requires_grad_() for t in rounded]
    reference = ms_deform_attn_reference(leaves[0], operands[1], operands[2], leaves[1],
                                         leaves[2])
    grad_output = torch.randn(reference.shape, generator=torch.Generator().manual_seed(3),
                              dtype=torch.float64)
    expected = torch.autograd.grad(reference, leaves, grad_output)
    width = vector_bytes() // opmath_bytes(dtype)
    for requested in requested_subsets(3):
        with branch_trace() as taken:
            grads = torch.ops.deformconv.ms_deform_attn_backward(
                grad_output.to(dtype), rounded[0], operands[1], operands[2], rounded[1],
                rounded[2], 64, list(requested))
        names = set()
        if requested[0]:
            names |= channel_loops("ms_deform_attn.cpu.scatter", channels,
                                   [max(width, LANES), LANES])
        if any(requested[1:]):
            names |= channel_loops("ms_deform_attn.cpu.dots", channels, [LANES])
        assert {name for name in taken if name.startswith(CPU_BRANCHES)} == names, sorted(taken)
        assert_requested_gradients(requested, grads, expected, dtype)


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
    grads = torch.ops.deformconv.ms_deform_attn_backward(grad_output.to(dtype), *operands, 64,
                                                         [True, True, True])
    exact_grads = torch.ops.deformconv.ms_deform_attn_backward(grad_output, *exact, 64,
                                                               [True, True, True])
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
    grads = torch.ops.deformconv.ms_deform_attn_backward(grad_output, poisoned, *operands, 64,
                                                         [True, True, True])
    clean_grads = torch.ops.deformconv.ms_deform_attn_backward(grad_output, clean, *operands,
                                                               64, [True, True, True])
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
                grad_output, *operands, 64, [True, True, True]))
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


# Changes to level 1 of [(4, 6), (2, 3), (1, 1)] (S = 31) that the version counter does not see:
# made through .data, which shares the storage but not the counter.
UNSEEN_CHANGES = {
    "start past S": lambda shapes, starts: starts.data.__setitem__(1, 26),  # would end at 32
    "negative start": lambda shapes, starts: starts.data.__setitem__(1, -1),
    "no rows": lambda shapes, starts: shapes.data.__setitem__((1, 0), 0),
    "side past the limit": lambda shapes, starts: shapes.data.__setitem__((1, 1), 2**40),
}


@pytest.mark.parametrize("change", UNSEEN_CHANGES)
def test_emulated_levels_checked_once_while_unmodified(emulated, change):
    """Off the CPU, reading the levels waits for the device: the driver checks a pair of index
    tensors once and remembers it, with value's S, while neither is modified (the emulated op's
    CPU tensors stand for device tensors). Another S or a change in place is checked again; a
    level changed behind the version counter's back so that it no longer fits in value is read
    by the kernels as empty, never outside value."""
    operands = make_operands([(4, 6), (2, 3), (1, 1)], queries=4, channels=4, points=3)
    value, shapes, starts, locations, weights = operands
    torch.testing.assert_close(emulated.ms_deform_attn(*operands, 64), call(operands))
    with pytest.raises(ValueError, match=r"expected value to have as many rows \(dimension 1, "
                                         r"30\)"):
        emulated.ms_deform_attn(value[:, :-1], shapes, starts, locations, weights, 64)
    starts[1] += 1
    with pytest.raises(ValueError, match=r"expected level_start_index\[1\] to be 24"):
        emulated.ms_deform_attn(*operands, 64)
    starts[1] -= 1
    emulated.ms_deform_attn(*operands, 64)
    valid_shapes, valid_starts = shapes.clone(), starts.clone()
    UNSEEN_CHANGES[change](shapes, starts)
    out = emulated.ms_deform_attn(*operands, 64)
    grad_output = torch.randn(out.shape, dtype=torch.float64)
    grads = emulated.ms_deform_attn_backward(grad_output, *operands, 64, [True, True, True])
    # Level 1 read as empty: the op on the valid levels with level 1's weights zero, and no
    # gradient for level 1's samples.
    without = weights.clone()
    without[:, :, :, 1] = 0
    reference = (value, valid_shapes, valid_starts, locations, without)
    torch.testing.assert_close(out, call(reference))
    expected = torch.ops.deformconv.ms_deform_attn_backward(grad_output, *reference, 64,
                                                            [True, True, True])
    torch.testing.assert_close(grads[0], expected[0])
    for grad, full in zip(grads[1:], expected[1:]):
        assert grad[:, :, :, 1].abs().max() == 0
        torch.testing.assert_close(grad[:, :, :, [0, 2]], full[:, :, :, [0, 2]])


def test_emulated_inference_tensors_are_checked_every_time(emulated):
    # Inference tensors keep no version counter: a change in place cannot be seen, so they are
    # never remembered.
    with torch.inference_mode():
        operands = make_operands([(4, 6), (2, 3)], channels=4)
        emulated.ms_deform_attn(*operands, 64)
        operands[2][1] += 1
        with pytest.raises(ValueError, match=r"expected level_start_index\[1\] to be 24"):
            emulated.ms_deform_attn(*operands, 64)


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
     TypeError, "expected spatial_shapes to have an integer dtype"),
    ("spatial_shapes of 3 columns",
     lambda o: (o[0], torch.zeros(2, 3, dtype=torch.int64), o[2], o[3], o[4]),
     ValueError, r"expected spatial_shapes to be of shape \(levels, 2\)"),
    ("value of 3 dimensions",
     lambda o: (o[0][0], o[1], o[2], o[3], o[4]),
     ValueError, "expected value to be a 4-D tensor"),
    ("locations of another dtype",
     lambda o: (o[0], o[1], o[2], o[3].float(), o[4]),
     TypeError, "expected sampling_locations to have the dtype of value"),
    ("locations of another level count",
     lambda o: (o[0], o[1], o[2], o[3][:, :, :, :1], o[4]),
     ValueError, "expected sampling_locations of shape"),
    ("weights of another point count",
     lambda o: (o[0], o[1], o[2], o[3], o[4][..., :1]),
     ValueError, "expected attention_weights of shape"),
    ("integer value",
     lambda o: (o[0].long(), o[1], o[2], o[3], o[4]),
     TypeError, "expected value to have a floating point dtype"),
]


@pytest.mark.parametrize("case,change,error,pattern", BAD, ids=[b[0] for b in BAD])
def test_bad_arguments_raise(case, change, error, pattern):
    operands = make_operands([(4, 6), (1, 5)])
    with pytest.raises(error, match=pattern):
        call(change(operands))


def test_bad_im2col_step_raises():
    with pytest.raises(ValueError, match="expected im2col_step to be at least 0"):
        call(make_operands([(2, 2)]), -1)


def test_opcheck():
    operands = make_operands([(4, 5), (2, 2)], dtype=torch.float32)
    floating = [t.requires_grad_() if t.is_floating_point() else t for t in operands]
    torch.library.opcheck(torch.ops.deformconv.ms_deform_attn.default, (*floating, 64))


def test_torch_compile_fullgraph_and_export():
    operands = make_operands([(4, 5), (2, 2)], dtype=torch.float32)

    def attend(value, shapes, starts, locations, weights):
        return deformconv.ms_deform_attn(value, shapes, starts, locations, weights).relu()

    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(*operands), attend(*operands))

    class Attend(torch.nn.Module):
        def forward(self, value, shapes, starts, locations, weights):
            return attend(value, shapes, starts, locations, weights)

    exported = torch.export.export(Attend(), tuple(operands))
    torch.testing.assert_close(exported.module()(*operands), attend(*operands))


def test_torchscript():
    operands = make_operands([(4, 5), (2, 2)], dtype=torch.float32)

    def attend(value: torch.Tensor, shapes: torch.Tensor, starts: torch.Tensor,
               locations: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return deformconv.ms_deform_attn(value, shapes, starts, locations, weights, 64)

    scripted = torch.jit.script(attend)
    assert torch.equal(scripted(*operands), attend(*operands))


def test_autocast_runs_in_float32():
    value, shapes, starts, locations, weights = make_operands([(4, 5)], dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = deformconv.ms_deform_attn(value.bfloat16(), shapes, starts, locations, weights)
    assert out.dtype == torch.float32
    expected = call([value.bfloat16().float(), shapes, starts, locations, weights])
    torch.testing.assert_close(out, expected)


# The CUDA launchers under the emulator (the emulated fixture), csrc/cuda/ms_deform_attn_cuda.cu.
def expected_cuda_branches(channels, dtype, samples, aligned, backward):
    """The paths of ms_deform_attn_cuda.cu's tiling for a shape (cuda_lane_paths): vectors of
    16 bytes of the dtype (forward) or of the float32/float64 sums (backward); a staged sample is
    SharedSample and a row step, 48 bytes in float32 arithmetic, 80 in float64."""
    staged_sample_bytes = 48 if opmath_bytes(dtype) == 4 else 80
    vectors, passes, rounds = cuda_lane_paths(channels, dtype, aligned, backward,
                                              staged_sample_bytes, samples)
    names = {"ms_deform_attn.cuda.channels.vectors" if vectors
             else "ms_deform_attn.cuda.channels.one_at_a_time"}
    if passes:
        names.add("ms_deform_attn.cuda.channels.several_passes")
    if rounds:
        names.add("ms_deform_attn.cuda.samples.several_rounds")
    return names


CUDA_BRANCHES = {"ms_deform_attn.cuda.channels.vectors",
                 "ms_deform_attn.cuda.channels.one_at_a_time",
                 "ms_deform_attn.cuda.channels.several_passes",
                 "ms_deform_attn.cuda.samples.several_rounds",
                 "ms_deform_attn.cuda.backward.value_gradient",
                 "ms_deform_attn.cuda.backward.location_weight_gradients"}

# (channels, value aligned to 16 bytes). 16: vectors in every dtype. 6: vectors of 2 in float64
# only, one channel at a time otherwise. 33: one channel at a time, two passes of a warp's
# lanes. 1: one lane an item, 256 items a block, the samples staged in several rounds. 16
# misaligned: one channel at a time.
CUDA_CASES = [(16, True), (6, True), (33, True), (1, True), (16, False)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels,aligned", CUDA_CASES,
                         ids=[f"D{D}-{'aligned' if a else 'misaligned'}" for D, a in CUDA_CASES])
def test_emulated_cuda_paths(emulated, channels, aligned, dtype):
    """The CUDA launchers under the emulator, each of their paths forced by the head's channels
    and the alignment of value, and checked to have run: the forward, and the backward kernel
    for every combination of requested gradients, against the float64 CPU op."""
    points = 5
    operands = make_operands([(5, 4), (3, 2), (1, 1)], batch=2, queries=6, heads=2,
                             channels=channels, points=points, seed=channels)
    floating = [operands[0], operands[3], operands[4]]
    rounded = [t.to(dtype) for t in floating]
    value = rounded[0] if aligned else misaligned(rounded[0])
    cuda_operands = [value, operands[1], operands[2], rounded[1], rounded[2]]
    exact = [rounded[0].double(), operands[1], operands[2], rounded[1].double(),
             rounded[2].double()]
    expected = call(exact)
    grad_output = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1),
                              dtype=torch.float64)
    expected_grads = torch.ops.deformconv.ms_deform_attn_backward(grad_output, *exact, 64,
                                                                  [True, True, True])
    samples = 3 * points
    with branch_trace(emulated) as taken:
        out = emulated.ms_deform_attn(*cuda_operands, 64)
    forward = expected_cuda_branches(channels, dtype, samples, aligned, backward=False)
    assert taken & CUDA_BRANCHES == forward, sorted(taken)
    assert_close_at(out, expected, dtype, "output")
    backward = expected_cuda_branches(channels, dtype, samples, aligned, backward=True)
    for requested in requested_subsets(3):
        with branch_trace(emulated) as taken:
            grads = emulated.ms_deform_attn_backward(grad_output.to(dtype), *cuda_operands, 64,
                                                     list(requested))
        kernel = {"ms_deform_attn.cuda.backward.value_gradient"} if requested[0] else set()
        if any(requested[1:]):
            kernel.add("ms_deform_attn.cuda.backward.location_weight_gradients")
        assert taken & CUDA_BRANCHES == backward | kernel, sorted(taken)
        assert_requested_gradients(requested, grads, expected_grads, dtype)
