"""Multi-scale deformable attention's branches: the CPU backward's channel loops (under every
copy of the CPU kernels that this CPU runs), and the CUDA
launchers' paths and level checks under the emulator, each forced and checked through the
branch trace."""

import pytest
import torch

import deformconv
from branching import (assert_close_at, branch_trace, channel_loops, cuda_lane_paths, misaligned,
                       opmath_bytes, requested_subsets, vector_bytes)
from ms_deform_attn_reference import (DEFAULT_OPTIONS, DTYPES, assert_requested_gradients, call,
                                      make_operands, ms_deform_attn_reference)

LANES = 8  # kLanes of csrc/cpu/cpu_loops.h
CPU_BRANCHES = ("ms_deform_attn.cpu.scatter.", "ms_deform_attn.cpu.dots.")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("channels", [3, 8, 32, 33])
def test_cpu_backward_channel_loops(cpu_copy, channels, dtype):
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
                rounded[2], *DEFAULT_OPTIONS, list(requested))
        names = set()
        if requested[0]:
            names |= channel_loops("ms_deform_attn.cpu.scatter", channels,
                                   [max(width, LANES), LANES])
        if any(requested[1:]):
            names |= channel_loops("ms_deform_attn.cpu.dots", channels, [LANES])
        assert {name for name in taken if name.startswith(CPU_BRANCHES)} == names, sorted(taken)
        assert_requested_gradients(requested, grads, expected, dtype)


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
    grads = emulated.ms_deform_attn_backward(grad_output, *operands, *DEFAULT_OPTIONS,
                                             [True, True, True])
    # Level 1 read as empty: the op on the valid levels with level 1's weights zero, and no
    # gradient for level 1's samples.
    without = weights.clone()
    without[:, :, :, 1] = 0
    reference = (value, valid_shapes, valid_starts, locations, without)
    torch.testing.assert_close(out, call(reference))
    expected = torch.ops.deformconv.ms_deform_attn_backward(grad_output, *reference,
                                                            *DEFAULT_OPTIONS, [True, True, True])
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
    expected_grads = torch.ops.deformconv.ms_deform_attn_backward(
        grad_output, *exact, *DEFAULT_OPTIONS, [True, True, True])
    samples = 3 * points
    with branch_trace(emulated) as taken:
        out = emulated.ms_deform_attn(*cuda_operands, 64)
    forward = expected_cuda_branches(channels, dtype, samples, aligned, backward=False)
    assert taken & CUDA_BRANCHES == forward, sorted(taken)
    assert_close_at(out, expected, dtype, "output")
    backward = expected_cuda_branches(channels, dtype, samples, aligned, backward=True)
    for requested in requested_subsets(3):
        with branch_trace(emulated) as taken:
            grads = emulated.ms_deform_attn_backward(grad_output.to(dtype), *cuda_operands,
                                                     *DEFAULT_OPTIONS, list(requested))
        kernel = {"ms_deform_attn.cuda.backward.value_gradient"} if requested[0] else set()
        if any(requested[1:]):
            kernel.add("ms_deform_attn.cuda.backward.location_weight_gradients")
        assert taken & CUDA_BRANCHES == backward | kernel, sorted(taken)
        assert_requested_gradients(requested, grads, expected_grads, dtype)
