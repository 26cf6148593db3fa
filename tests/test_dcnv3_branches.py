"""Every path of the DCNv3/DCNv4 CPU launchers, forced (by group_channels, batch and thread count)
and checked to have run through the branch trace (Note [Branch trace]): the instance for 16
channels a group and the general one; the backward in one pass over the images, or as an input
pass and an offset/mask pass apart (at most half as many images as threads); the channel loops
of every vector width and their tails. On each, in four dtypes: the forward and the gradients
against the float64 reference, and every combination of operands that need a gradient through
autograd against the gradients computed with all of them; each under every copy of the CPU
kernels that this CPU runs (the cpu_copy fixture). The list of branches and the tests that
force them is in docs/testing.md."""

import pytest
import torch

import deformconv
from branching import (assert_close_at, branch_trace, channel_loops, cuda_lane_paths,
                       misaligned, opmath_bytes, requested_subsets, shared_sample_bytes, threads,
                       vector_bytes)
from dcnv3_reference import dcnv3_reference, pack_offset_mask, random_operands

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
LANES = 8  # kLanes of csrc/cpu/cpu_loops.h
# 3 x 3 kernel, stride 1, padding 1, dilation 1, two groups of `group_channels` each.
KERNEL = ((3, 3), (1, 1), (1, 1), (1, 1))
# 16: the specialised instance. 5: below one vector. 12 and 24: a vector of 8 and a tail, or
# two (AVX-512: a register of 16 floats and 8 lanes). 40: two registers' width, one register, 8
# lanes (AVX2 in float32: 16 + 16 + 8). 33: every width and one channel more.
GROUP_CHANNELS = [16, 5, 12, 24, 40, 33]
# (batch, threads): the backward's passes. 2 images on 2 threads: one pass for everything;
# 1 image on 2 threads: the input gradient by images and the offset and mask gradients apart.
PASSES = {"one-pass": (2, 2), "two-passes": (1, 2)}
# Images of 5 x 6 and 5 x 7 output pixels: the passes' tasks of one pixel, or of every pixel of
# an image, over even and odd counts.
SIZES = [(5, 6), (5, 7)]


def geometry_of(group_channels):
    return KERNEL + (2, group_channels)


def arguments(geometry, scale=0.75):
    (kh, kw), (sh, sw), (ph, pw), (dh, dw), G, D = geometry
    return (kh, kw, sh, sw, ph, pw, dh, dw, G, D, scale)


def expected_branches(geometry, dtype, batch, thread_count, wanted):
    """What the CPU launchers run for `wanted` = (input, offset or mask) gradients."""
    D = geometry[5]
    width = vector_bytes() // opmath_bytes(dtype)
    names = {"dcnv3.cpu.group_channels_16" if D == 16 else "dcnv3.cpu.group_channels_any"}
    names |= channel_loops("dcnv3.cpu.forward", D, [2 * width, width, LANES])
    want_input, want_offset_or_mask = wanted
    if want_input:
        names |= channel_loops("dcnv3.cpu.scatter", D, [max(width, LANES), LANES])
    if want_offset_or_mask:
        names |= channel_loops("dcnv3.cpu.dots", D, [LANES])
    if want_input and want_offset_or_mask and 2 * batch > thread_count:
        names.add("dcnv3.cpu.backward.one_pass")
    else:
        if want_input:
            names.add("dcnv3.cpu.backward.input_pass")
        if want_offset_or_mask:
            names.add("dcnv3.cpu.backward.offset_mask_pass")
    return names


BACKWARD_PASSES = {"dcnv3.cpu.backward.one_pass", "dcnv3.cpu.backward.input_pass",
                   "dcnv3.cpu.backward.offset_mask_pass"}


def assert_ran_exactly(expected, taken):
    assert expected <= taken, f"expected {sorted(expected - taken)} to run; ran {sorted(taken)}"
    assert taken & BACKWARD_PASSES == expected & BACKWARD_PASSES, sorted(taken)


def dcnv3_call(op, geometry):
    def call(input, offset, mask):
        return op(input, offset, mask, *arguments(geometry), 0, False)
    return call


def dcnv4_call(geometry):
    def call(input, offset_mask):
        return deformconv.dcnv4(input, offset_mask, *arguments(geometry), 0, False)
    return call


def autograd_run(call, operands, requested, grad_output):
    leaves = [t.detach().clone().requires_grad_(wanted) for t, wanted in zip(operands, requested)]
    with branch_trace() as taken:
        out = call(*leaves)
        wanted = [t for t in leaves if t.requires_grad]
        computed = iter(torch.autograd.grad(out, wanted, grad_output))
    return out, [next(computed) if t.requires_grad else None for t in leaves], taken


def cases():
    return [pytest.param(D, passes, size, dtype,
                         id=f"D{D}-{passes}-{size[0]}x{size[1]}-"
                            f"{str(dtype).removeprefix('torch.')}")
            for D in GROUP_CHANNELS for passes in PASSES for size in SIZES for dtype in DTYPES]


@pytest.mark.parametrize("group_channels,passes,size,dtype", cases())
def test_dcnv3_paths(cpu_copy, group_channels, passes, size, dtype):
    geometry = geometry_of(group_channels)
    batch, thread_count = PASSES[passes]
    operands = random_operands(batch, *size, geometry, dtype=dtype, seed=group_channels)
    exact = [t.double().requires_grad_() for t in operands]
    expected = dcnv3_reference(*exact, *arguments(geometry))
    grad_output = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1),
                              dtype=torch.float64)
    expected_grads = torch.autograd.grad(expected, exact, grad_output)
    call = dcnv3_call(deformconv.dcnv3, geometry)
    with threads(thread_count):
        out, all_grads, taken = autograd_run(call, operands, (True,) * 3, grad_output.to(dtype))
        assert_ran_exactly(expected_branches(geometry, dtype, batch, thread_count, (True, True)),
                           taken)
        assert_close_at(out, expected, dtype, "output")
        for name, grad, full in zip(("input", "offset", "mask"), all_grads, expected_grads):
            assert grad.dtype == dtype
            assert_close_at(grad, full, dtype, name)
        for requested in requested_subsets(3):
            _, grads, taken = autograd_run(call, operands, requested, grad_output.to(dtype))
            wanted = (requested[0], requested[1] or requested[2])
            assert_ran_exactly(expected_branches(geometry, dtype, batch, thread_count, wanted),
                               taken)
            for name, want, grad, full in zip(("input", "offset", "mask"), requested, grads,
                                              all_grads):
                if want:
                    assert_close_at(grad, full, dtype, f"{name} of {requested}")


@pytest.mark.parametrize("group_channels,passes,size,dtype",
                         [case for case in cases() if case.values[0] in (16, 12)])
def test_dcnv4_paths(cpu_copy, group_channels, passes, size, dtype):
    geometry = geometry_of(group_channels)
    batch, thread_count = PASSES[passes]
    input, offset, mask = random_operands(batch, *size, geometry, dtype=torch.float64,
                                          seed=group_channels)
    offset_mask = pack_offset_mask(offset, mask, 2, padding_value=0.0)
    operands = [input.to(dtype), offset_mask.to(dtype)]
    exact = [t.double().requires_grad_() for t in operands]
    used = 3 * mask.shape[3]
    points = mask.shape[3] // 2
    packed = exact[1][..., :used].reshape(*mask.shape[:3], 2, 3 * points)
    expected = dcnv3_reference(exact[0],
                               packed[..., :2 * points].reshape(*offset.shape),
                               packed[..., 2 * points:].reshape(*mask.shape),
                               *arguments(geometry))
    grad_output = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1),
                              dtype=torch.float64)
    expected_grads = torch.autograd.grad(expected, exact, grad_output)
    call = dcnv4_call(geometry)
    with threads(thread_count):
        out, all_grads, taken = autograd_run(call, operands, (True, True), grad_output.to(dtype))
        assert_ran_exactly(expected_branches(geometry, dtype, batch, thread_count, (True, True)),
                           taken)
        assert_close_at(out, expected, dtype, "output")
        for name, grad, full in zip(("input", "offset_mask"), all_grads, expected_grads):
            assert_close_at(grad, full, dtype, name)
        for requested in requested_subsets(2):
            _, grads, taken = autograd_run(call, operands, requested, grad_output.to(dtype))
            assert_ran_exactly(expected_branches(geometry, dtype, batch, thread_count, requested),
                               taken)
            for name, want, grad, full in zip(("input", "offset_mask"), requested, grads,
                                              all_grads):
                if want:
                    assert_close_at(grad, full, dtype, f"{name} of {requested}")


def expected_cuda_branches(group_channels, dtype, points, aligned, backward):
    """The paths of csrc/cuda/dcnv3_cuda.cu's tiling for a shape (cuda_lane_paths): the
    forward's channel vectors are 16 bytes of the dtype, the backward's 16 bytes of its input
    gradient's sums (float32 in half precision): kForwardVector, kBackwardVector."""
    vectors, passes, rounds = cuda_lane_paths(group_channels, dtype, aligned, backward,
                                              shared_sample_bytes(dtype), points)
    names = {"dcnv3.cuda.channels.vectors" if vectors else "dcnv3.cuda.channels.one_at_a_time"}
    if passes:
        names.add("dcnv3.cuda.channels.several_passes")
    if rounds:
        names.add("dcnv3.cuda.points.several_rounds")
    return names


CUDA_BRANCHES = {"dcnv3.cuda.channels.vectors", "dcnv3.cuda.channels.one_at_a_time",
                 "dcnv3.cuda.channels.several_passes", "dcnv3.cuda.points.several_rounds",
                 "dcnv3.cuda.index.32bit", "dcnv3.cuda.index.64bit",
                 "dcnv3.cuda.backward.input_gradient",
                 "dcnv3.cuda.backward.input_gradient_in_shared_memory",
                 "dcnv3.cuda.backward.offset_mask_gradients"}


def cpu_expectations(op, operands, tail, seed):
    """The CPU op's output on `operands`, an output gradient drawn from `seed`, and every
    gradient of the op for it."""
    expected = getattr(torch.ops.deformconv, op)(*operands, *tail)
    grad_output = torch.randn(expected.shape, generator=torch.Generator().manual_seed(seed),
                              dtype=torch.float64)
    grads = getattr(torch.ops.deformconv, op + "_backward")(grad_output, *operands, *tail,
                                                            [True] * len(operands))
    return expected, grad_output, grads


@pytest.fixture
def index_width(request, emulated):
    """The kernels' index arithmetic (parametrised indirectly): 32-bit divisions, which the
    launchers take when every dividend of a launch is below 2^31, or 64-bit ones, forced here by
    the emulator lowering that limit. Settings as the emulator starts, but for the limit;
    restored afterwards."""
    emulated.configure(0, 0, 0, 0, 0, 0, request.param == "64bit")
    yield request.param
    emulated.configure(0, 0, 0, 0, 0, 0, False)


# (group channels, input aligned to 16 bytes). 16: vectors in every dtype. 12: a vector lane of
# four idle in float32 and in half precision's backward (vectors of 4 channels), one channel at
# a time in half precision's forward (vectors of 8). 5: one channel
# at a time. 33: two passes of a warp's lanes. 1: one lane an item, 256 items a block, the
# points staged in several rounds. 16 misaligned: one channel at a time.
CUDA_CASES = [(16, True), (12, True), (5, True), (33, True), (1, True), (16, False)]


# Every dtype with 32-bit indices; the 64-bit build, whose index arithmetic is the same for
# every dtype, with two vector widths (float32's 4 channels, bfloat16's 8 in the forward).
INDEX_WIDTHS_AND_DTYPES = [("32bit", dtype) for dtype in DTYPES] + [
    ("64bit", torch.float32), ("64bit", torch.bfloat16)]


@pytest.mark.parametrize("index_width,dtype", INDEX_WIDTHS_AND_DTYPES, indirect=["index_width"],
                         ids=[f"{w}-{d}" for w, d in INDEX_WIDTHS_AND_DTYPES])
@pytest.mark.parametrize("group_channels,aligned", CUDA_CASES,
                         ids=[f"D{D}-{'aligned' if a else 'misaligned'}" for D, a in CUDA_CASES])
@pytest.mark.parametrize("op", ["dcnv3", "dcnv4"])
def test_emulated_cuda_paths(emulated, index_width, op, group_channels, aligned, dtype):
    """The CUDA launchers under the emulator, each of their paths forced by the group's channels,
    the input's alignment and the index width, and checked to have run: the forward, and the
    backward kernel for every combination of requested gradients, against the float64 CPU op
    with every gradient. Bands of these images' rows fit a block's shared memory: with the input
    gradient, the banded kernel."""
    geometry = geometry_of(group_channels)
    input, offset, mask = random_operands(2, 5, 7, geometry, seed=group_channels)
    if op == "dcnv3":
        exact = [input, offset, mask]
    else:
        exact = [input, pack_offset_mask(offset, mask, 2, padding_value=0.0)]
    operands = [t.to(dtype) for t in exact]
    if not aligned:
        operands[0] = misaligned(operands[0])
    rounded = [t.double() for t in operands]
    cuda_forward = getattr(emulated, op)
    cuda_backward = getattr(emulated, op + "_backward")
    tail = (*arguments(geometry), 0, False)
    expected, grad_output, expected_grads = cpu_expectations(op, rounded, tail, seed=1)
    index = {f"dcnv3.cuda.index.{index_width}"}
    paths = expected_cuda_branches(group_channels, dtype, 9, aligned, backward=False) | index
    with branch_trace(emulated) as taken:
        out = cuda_forward(*operands, *tail)
    assert taken & CUDA_BRANCHES == paths, sorted(taken)
    paths = expected_cuda_branches(group_channels, dtype, 9, aligned, backward=True) | index
    assert_close_at(out, expected, dtype, "output")
    for requested in requested_subsets(len(exact)):
        with branch_trace(emulated) as taken:
            grads = cuda_backward(grad_output.to(dtype), *operands, *tail, list(requested))
        kernel = set()
        if requested[0]:
            kernel |= {"dcnv3.cuda.backward.input_gradient",
                       "dcnv3.cuda.backward.input_gradient_in_shared_memory"}
        if any(requested[1:]):
            kernel.add("dcnv3.cuda.backward.offset_mask_gradients")
        assert taken & CUDA_BRANCHES == paths | kernel, sorted(taken)
        for index, (want, grad, full) in enumerate(zip(requested, grads, expected_grads)):
            if want:
                assert_close_at(grad, full, dtype, f"gradient {index} of {requested}")
            else:
                assert grad is None


# (batch, height, width, offset spread, DEFORMCONV_INPUT_GRADIENT_BANDS, whether the input
# gradient is summed in bands of shared memory), 3 x 3 kernel, padding 1, two groups of 16
# channels. "beyond-the-band": images of 30 rows, bands of at most 18 (in float32: a strip's 8
# output rows of 10 pixels, the footprint's reach, the margin) and offsets of up to 8 pixels:
# corners in the band and outside it, bands clipped at the images' first and last rows, 5
# strips an image. "bands-off": the same, the environment turning bands off. "rows-too-wide": a
# band of 200-pixel rows would not fit 24 KiB. Without bands, the input gradient adds to global
# memory directly.
BAND_CASES = {"beyond-the-band": (2, 30, 10, 8.0, None, True),
              "bands-off": (2, 30, 10, 8.0, "0", False),
              "rows-too-wide": (1, 3, 200, 2.0, None, False)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", BAND_CASES)
def test_emulated_cuda_input_gradient_in_bands_or_directly(emulated, monkeypatch, case, dtype):
    """The backward's two kernels with the input gradient (Note [Input gradient in a band of
    shared memory] in csrc/cuda/dcnv3_cuda.cu), each forced by the image's width or the
    environment and checked to have run, for every combination of requested gradients, against
    the float64 CPU op, on a grid of 3 blocks, which take several strips (or items) each."""
    batch, height, width, spread, setting, banded = BAND_CASES[case]
    if setting is None:
        monkeypatch.delenv("DEFORMCONV_INPUT_GRADIENT_BANDS", raising=False)
    else:
        monkeypatch.setenv("DEFORMCONV_INPUT_GRADIENT_BANDS", setting)
    geometry = geometry_of(16)
    exact = random_operands(batch, height, width, geometry, spread=spread, seed=height)
    operands = [t.to(dtype) for t in exact]
    rounded = [t.double() for t in operands]
    tail = (*arguments(geometry), 0, False)
    _, grad_output, expected_grads = cpu_expectations("dcnv3", rounded, tail, seed=3)
    emulated.configure(0, 0, 3, 0, 0, 0, False)
    try:
        for requested in requested_subsets(3):
            with branch_trace(emulated) as taken:
                grads = emulated.dcnv3_backward(grad_output.to(dtype), *operands, *tail,
                                                list(requested))
            assert ("dcnv3.cuda.backward.input_gradient" in taken) == requested[0], sorted(taken)
            assert ("dcnv3.cuda.backward.input_gradient_in_shared_memory" in taken) == (
                requested[0] and banded), sorted(taken)
            for index, (want, grad, full) in enumerate(zip(requested, grads, expected_grads)):
                if want:
                    assert_close_at(grad, full, dtype, f"gradient {index} of {requested}")
                else:
                    assert grad is None
    finally:
        emulated.configure(0, 0, 0, 0, 0, 0, False)


# (padding, the largest element index the kernels form): with padding 1 the input's, with its
# far corners past the last pixel; with padding 3 the output's (2 images of 9 x 11 pixels).
LARGEST_INDEX_CASES = {"input": (1, (2 * 5 * 7 + 7 + 1) * 8), "output": (3, 2 * 9 * 11 * 8)}


@pytest.mark.parametrize("case", LARGEST_INDEX_CASES)
def test_emulated_cuda_index_width_follows_the_largest_element_index(emulated, case):
    """The 32-bit build indexes the input's and the output's elements in 32 bits, so the
    launchers take it only where every element index that its kernels form is within the limit,
    as well as every dividend: at a limit of the largest index, the 32-bit build; one below it,
    the 64-bit build, though every dividend (items, kernel taps) is still within it. Both
    against the CPU op, forward and every gradient."""
    padding, largest = LARGEST_INDEX_CASES[case]
    geometry = ((3, 3), (1, 1), (padding, padding), (1, 1), 2, 4)
    operands = random_operands(2, 5, 7, geometry, seed=padding)
    tail = (*arguments(geometry), 0, False)
    expected, grad_output, expected_grads = cpu_expectations("dcnv3", operands, tail, seed=2)
    items = expected.shape[0] * expected.shape[1] * expected.shape[2] * 2
    assert max(items, 9) < largest - 1
    for limit, width in [(largest, "32bit"), (largest - 1, "64bit")]:
        emulated.configure(0, 0, 0, 0, 0, 0, False)
        emulated.set_narrow_index_limit(limit)
        with branch_trace(emulated) as taken:
            out = emulated.dcnv3(*operands, *tail)
            grads = emulated.dcnv3_backward(grad_output, *operands, *tail, [True] * 3)
        emulated.configure(0, 0, 0, 0, 0, 0, False)
        assert taken & {"dcnv3.cuda.index.32bit", "dcnv3.cuda.index.64bit"} == {
            f"dcnv3.cuda.index.{width}"}, (limit, sorted(taken))
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
        for grad, full in zip(grads, expected_grads):
            torch.testing.assert_close(grad, full, rtol=1e-12, atol=1e-12)
