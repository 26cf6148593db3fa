"""DCN v1/v2's CUDA launchers and kernels, executed on the CPU by emulation (tests/cuda_emulation,
built by tests/emulated_cuda.py; test_cuda_emulator.py tests the emulator itself): the real
csrc/cuda sources compiled as C++, every block and thread of every launch run in turn, lanes
meeting at warp shuffles and threads at block barriers.
Checked against the CPU op and the pure-PyTorch reference: forward and all gradients, dtypes,
several windows per block, block and thread orders, grid caps, memory layouts, every
output_mask, each path of im2col and of the columns gradient, and the launch bookkeeping
(current stream, device guard, launch check)."""

import itertools

import pytest
import torch

import deformconv  # noqa: F401  (registers torch.ops.deformconv, the CPU op compared against)
from branching import (assert_close_at, branch_trace, cuda_lane_paths, misaligned, opmath_bytes,
                       requested_subsets, shared_sample_bytes)
from deform_conv2d_cases import (GEOMETRIES, Geometry, forward_and_grads, make_operands,
                                 strided_copies)
from emulation import FORWARD, REVERSE, SHUFFLED, set_emulator
from deform_conv2d_reference import deform_conv2d_reference

pytestmark = pytest.mark.usefixtures("emulator_settings")


@pytest.fixture(params=["32-bit", "64-bit"])
def index_arithmetic(request, emulated):
    """Each kernel is built with 32-bit divisions, which the launchers take for launches below
    2^31 entries, and with 64-bit ones for larger launches: here both run on the same operands."""
    set_emulator(emulated, wide_indices=request.param == "64-bit")
    return request.param


def run_op(ops, operands, geometry, grad_output, *, im2col_step=0, output_mask=(True,) * 5):
    """Forward and backward of one op namespace: (output, [the five gradients or None])."""
    x, o, w, b, m = operands
    geometry_args = (list(geometry.stride), list(geometry.padding), list(geometry.dilation),
                     geometry.groups, geometry.offset_groups, im2col_step)
    out = ops.deform_conv2d(x, o, w, m, b, *geometry_args)
    grads = ops.deform_conv2d_backward(grad_output, x, o, w, m, *geometry_args,
                                       list(output_mask))
    return out, list(grads)


def grad_output_for(operands, geometry):
    batch = operands[0].shape[0]
    generator = torch.Generator().manual_seed(1)
    return torch.randn(batch, geometry.out_channels, *geometry.output_size(),
                       generator=generator, dtype=torch.float64).to(operands[0].dtype)


def assert_same_results(actual, expected, **tolerance):
    out, grads = actual
    expected_out, expected_grads = expected
    torch.testing.assert_close(out, expected_out, **tolerance)
    for name, a, e in zip(("input", "offset", "weight", "mask", "bias"), grads, expected_grads):
        if e is None:
            assert a is None, name
        else:
            torch.testing.assert_close(a, e, **tolerance, msg=lambda m, name=name: f"{name}: {m}")


def assert_launches_well_kept(emulated, *, expect_launches=True):
    launches, checks, off_stream, outside_guard, invalid, unchecked = emulated.take_bookkeeping()
    assert launches > 0 or not expect_launches
    assert checks == launches, "every launch must be followed by its launch check"
    assert off_stream == 0, "every launch must be on the current stream"
    assert outside_guard == 0, "every launch must be inside the device guard"
    assert invalid == 0 and unchecked == 0


# A slice of the geometry grid: every geometry of the CPU tests, v1 and v2, with and without
# bias, batches that no step divides, and an empty batch.
GRID = [(geometry, with_mask, with_bias, batch, step)
        for geometry in GEOMETRIES
        for with_mask, with_bias in ((False, False), (True, True), (True, False))
        for batch, step in ((None, 0), (3, 2))] + [
    (GEOMETRIES[1], True, True, 0, 0), (GEOMETRIES[4], True, True, 5, 3)]


@pytest.mark.parametrize(
    "geometry,with_mask,with_bias,batch,step", GRID,
    ids=lambda v: str(v) if isinstance(v, Geometry) else repr(v))
def test_matches_cpu_op_and_reference(emulated, index_arithmetic, geometry, with_mask, with_bias,
                                      batch, step):
    operands = make_operands(geometry, with_mask=with_mask, with_bias=with_bias, batch=batch)
    grad_output = grad_output_for(operands, geometry)
    ours = run_op(emulated, operands, geometry, grad_output, im2col_step=step)
    assert_launches_well_kept(emulated, expect_launches=operands[0].shape[0] > 0)
    cpu = run_op(torch.ops.deformconv, operands, geometry, grad_output, im2col_step=step)
    assert_same_results(ours, cpu, atol=1e-12, rtol=1e-12)

    # The reference gives the gradients of the operands present, in (x, o, w, b, m) order.
    ref_out, ref_grads = forward_and_grads(deform_conv2d_reference, *operands, geometry)
    x, o, w, b, m = operands
    present = [ours[1][0], ours[1][1], ours[1][2]] + ([ours[1][4]] if b is not None else []) + (
        [ours[1][3]] if m is not None else [])
    torch.testing.assert_close(ours[0], ref_out, atol=1e-10, rtol=1e-10)
    for a, e in zip(present, ref_grads):
        torch.testing.assert_close(a, e, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_lower_precisions(emulated, dtype):
    # Error against the float64 result within a small multiple of what the CPU op makes at the
    # same precision (the two accumulate in different orders).
    geometry = GEOMETRIES[4]
    exact_operands = make_operands(geometry)
    grad_output = grad_output_for(exact_operands, geometry)
    exact = run_op(torch.ops.deformconv, exact_operands, geometry, grad_output)
    low = [None if t is None else t.to(dtype) for t in exact_operands]
    ours = run_op(emulated, low, geometry, grad_output.to(dtype))
    cpu = run_op(torch.ops.deformconv, low, geometry, grad_output.to(dtype))
    for a, c, e in zip([ours[0]] + ours[1], [cpu[0]] + cpu[1], [exact[0]] + exact[1]):
        assert a.dtype == dtype
        our_error = (a.double() - e).abs().max().item()
        cpu_error = (c.double() - e).abs().max().item()
        assert our_error <= 3 * cpu_error + 1e-6 * e.abs().max().item()


@pytest.mark.parametrize("launchers", ["cuda", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_input_gradient_sums_in_float32(emulated, dtype, launchers):
    # Every sample of a 3x3 kernel over a 16x16 output lands at (6.25, 6.25): each of the 4
    # corner pixels sums 2,304 contributions. Summed in 16 bits, each add would round the running
    # sum (to 11 or 8 bits); summed in float32, only the final value is rounded.
    geometry = Geometry("one-pixel", 1, 1, 1, 16, 16, (3, 3), padding=(1, 1))
    out_h, out_w = geometry.output_size()
    taps = torch.arange(9)
    base_y = (torch.arange(out_h).view(1, -1, 1) - 1 + (taps // 3).view(-1, 1, 1)).double()
    base_x = (torch.arange(out_w).view(1, 1, -1) - 1 + (taps % 3).view(-1, 1, 1)).double()
    offset = torch.stack([(6.25 - base_y).expand(9, out_h, out_w),
                          (6.25 - base_x).expand(9, out_h, out_w)], dim=1).reshape(1, 18, out_h,
                                                                                     out_w)
    generator = torch.Generator().manual_seed(3)
    input = torch.randn(1, 1, 16, 16, generator=generator, dtype=torch.float64)
    weight = torch.rand(1, 1, 3, 3, generator=generator, dtype=torch.float64) + 0.5
    grad_output = torch.rand(1, 1, out_h, out_w, generator=generator, dtype=torch.float64) + 0.5
    operands = (input, offset, weight, None, None)
    exact = run_op(torch.ops.deformconv, operands, geometry, grad_output,
                   output_mask=(True, False, False, False, False))[1][0]
    low = [None if t is None else t.to(dtype) for t in operands]
    ops = emulated if launchers == "cuda" else torch.ops.deformconv
    ours = run_op(ops, low, geometry, grad_output.to(dtype),
                  output_mask=(True, False, False, False, False))[1][0]
    assert_launches_well_kept(emulated, expect_launches=launchers == "cuda")
    corners = exact[0, 0, 6:8, 6:8]
    assert corners.min() > 100  # large sums of many terms
    # Operands rounded to 16 bits, products summed exactly, one final rounding: within a few
    # units in the last place of the result.
    unit = torch.finfo(dtype).eps
    error = ((ours.double() - exact) / exact.abs().clamp_min(1)).abs().max().item()
    assert error <= 4 * unit
    # What a 16-bit running sum of the same contributions loses, for scale: far more.
    contributions = (exact[0, 0, 6, 6] / 2304).to(dtype).repeat(2304)
    running = torch.zeros((), dtype=dtype)
    for value in contributions:
        running += value
    assert abs(running.item() - exact[0, 0, 6, 6].item()) / exact[0, 0, 6, 6].item() > 4 * unit


def test_several_windows_per_block(emulated, index_arithmetic):
    # With a window budget of one byte the driver tiles the 2,304 output pixels into windows of
    # its minimum, evened out: 1,024 pixels in the forward, 2 windows of 1,152 per block; 512
    # in the backward, 4 windows of 576.
    geometry = Geometry("windows", 3, 8, 6, 48, 48, (3, 3), padding=(1, 1), groups=2,
                        offset_groups=2)
    operands = make_operands(geometry)
    grad_output = grad_output_for(operands, geometry)
    whole = run_op(emulated, operands, geometry, grad_output, im2col_step=2)
    set_emulator(emulated, columns_tile_bytes=1, wide_indices=index_arithmetic == "64-bit")
    with branch_trace(emulated) as taken:
        tiled = run_op(emulated, operands, geometry, grad_output, im2col_step=2)
    index_builds = {"deform_conv2d.cuda.index.32bit", "deform_conv2d.cuda.index.64bit"}
    assert taken & index_builds == {
        "deform_conv2d.cuda.index." + index_arithmetic.replace("-", "")}, sorted(taken)
    assert_launches_well_kept(emulated)
    assert_same_results(tiled, whole, atol=1e-12, rtol=1e-12)
    cpu = run_op(torch.ops.deformconv, operands, geometry, grad_output, im2col_step=2)
    assert_same_results(tiled, cpu, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("block_order,thread_order,grid_cap", [
    (REVERSE, REVERSE, 0), (SHUFFLED, SHUFFLED, 0), (FORWARD, FORWARD, 1), (SHUFFLED, REVERSE, 3),
])
def test_results_do_not_depend_on_block_and_thread_order_or_grid_size(
        emulated, block_order, thread_order, grid_cap):
    geometry = GEOMETRIES[2]
    operands = make_operands(geometry, batch=3)
    grad_output = grad_output_for(operands, geometry)
    baseline = run_op(emulated, operands, geometry, grad_output)
    set_emulator(emulated, block_order=block_order, thread_order=thread_order, grid_cap=grid_cap,
                 seed=12345)
    varied = run_op(emulated, operands, geometry, grad_output)
    assert_launches_well_kept(emulated)
    # Each output, weight, offset and mask entry is made by one thread: bitwise the same. The
    # input gradient adds atomically, in an order that follows the threads.
    out, grads = varied
    assert torch.equal(out, baseline[0])
    for index in (1, 2, 3, 4):
        assert torch.equal(grads[index], baseline[1][index])
    torch.testing.assert_close(grads[0], baseline[1][0], atol=1e-13, rtol=1e-13)


def test_channels_last_and_non_contiguous_operands(emulated):
    geometry = GEOMETRIES[1]
    operands = make_operands(geometry)
    grad_output = grad_output_for(operands, geometry)
    expected = run_op(emulated, operands, geometry, grad_output)
    ours = run_op(emulated, strided_copies(*operands), geometry,
                  grad_output.to(memory_format=torch.channels_last))
    assert_launches_well_kept(emulated)
    assert_same_results(ours, expected, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("with_mask", [False, True], ids=["v1", "v2"])
def test_every_output_mask(emulated, with_mask):
    geometry = GEOMETRIES[2]
    operands = make_operands(geometry, with_mask=with_mask)
    grad_output = grad_output_for(operands, geometry)
    _, all_grads = run_op(emulated, operands, geometry, grad_output)
    for output_mask in itertools.product((False, True), repeat=5):
        _, grads = run_op(emulated, operands, geometry, grad_output, output_mask=output_mask)
        for index, (wanted, grad) in enumerate(zip(output_mask, grads)):
            if wanted and all_grads[index] is not None:
                torch.testing.assert_close(grad, all_grads[index], atol=1e-13, rtol=1e-13)
            else:
                assert grad is None
        assert_launches_well_kept(emulated, expect_launches=any(output_mask[:4]))


# In float64, the columns gradient's vectors of 2 channels where the groups allow.
@pytest.mark.parametrize("in_channels,groups,offset_groups", [
    (40, 1, 1),   # 20 vectors: a whole warp an item, 12 of its lanes idle
    (70, 2, 2),   # 35 channels a deform group, one at a time: 3 of 32 lanes take a second
    (12, 4, 1),   # conv groups of 3, one at a time: 16 lanes, 4 idle; 4 conv groups an item
    (6, 1, 6),    # one channel per deform group: items of one lane
])
def test_offset_and_mask_gradients_of_many_channels_per_deform_group(
        emulated, index_arithmetic, in_channels, groups, offset_groups):
    geometry = Geometry("channels", 2, in_channels, 4, 6, 5, (3, 3), padding=(1, 1),
                        groups=groups, offset_groups=offset_groups)
    operands = make_operands(geometry)
    grad_output = grad_output_for(operands, geometry)
    mask = (False, True, False, True, False)
    _, ours = run_op(emulated, operands, geometry, grad_output, output_mask=mask)
    assert_launches_well_kept(emulated)
    _, cpu = run_op(torch.ops.deformconv, operands, geometry, grad_output, output_mask=mask)
    torch.testing.assert_close(ours[1], cpu[1], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ours[3], cpu[3], atol=1e-12, rtol=1e-12)


# The driver's paths with the CUDA launchers (Note [Branch trace]): GEMMs by bmm always, every
# window and block in turn; one window and block, conv and deform groups, several windows
# (a window budget of one byte) and several blocks (im2col_step 2 of 3 images).
EMULATED_PATHS = {
    "one-window": (Geometry("one-window", 2, 8, 6, 7, 8, (3, 3), padding=(1, 1)), 0, 0, set()),
    "groups": (GEOMETRIES[2], 0, 0, set()),
    "windows-blocks": (Geometry("windows", 3, 2, 2, 46, 46, (3, 3), padding=(1, 1), groups=2,
                                offset_groups=2), 1, 2,
                       {"deform_conv2d.forward.windows", "deform_conv2d.forward.blocks",
                        "deform_conv2d.backward.windows", "deform_conv2d.backward.blocks"}),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16,
                                   torch.bfloat16], ids=str)
@pytest.mark.parametrize("path", sorted(EMULATED_PATHS))
def test_paths_with_every_combination_of_requested_gradients(emulated, path, dtype):
    geometry, tile_bytes, step, expect = EMULATED_PATHS[path]
    set_emulator(emulated, columns_tile_bytes=tile_bytes)
    exact = make_operands(geometry, offset_scale=2.0, seed=3)
    operands = [t.to(dtype) for t in exact]
    grad_output = grad_output_for(operands, geometry)
    rounded = [t.double() for t in operands]
    expected = run_op(torch.ops.deformconv, rounded, geometry, grad_output.double())
    with branch_trace(emulated) as taken:
        out, all_grads = run_op(emulated, operands, geometry, grad_output, im2col_step=step)
    expected_branches = {"deform_conv2d.forward.bmm", "deform_conv2d.forward.stages",
                         "deform_conv2d.backward.bmm", "deform_conv2d.cuda.index.32bit"} | expect
    assert expected_branches <= taken, sorted(taken)
    assert_launches_well_kept(emulated)
    assert_close_at(out, expected[0], dtype, "output")
    for name, grad, full in zip(("input", "offset", "weight", "mask", "bias"), all_grads,
                                expected[1]):
        assert_close_at(grad, full, dtype, name)
    x, o, w, b, m = operands
    geometry_args = (list(geometry.stride), list(geometry.padding), list(geometry.dilation),
                     geometry.groups, geometry.offset_groups, step)
    for output_mask in requested_subsets(5):
        with branch_trace(emulated) as taken:
            grads = emulated.deform_conv2d_backward(grad_output, x, o, w, m, *geometry_args,
                                                    list(output_mask))
        if any(output_mask[:4]):
            assert "deform_conv2d.backward.bmm" in taken, sorted(taken)
        for name, wanted, grad, full in zip(("input", "offset", "weight", "mask", "bias"),
                                            output_mask, grads, all_grads):
            if wanted:
                assert_close_at(grad, full, dtype, f"{name} of {output_mask}")
            else:
                assert grad is None, name


LANE_BRANCHES = {f"deform_conv2d.cuda.{kernel}.{path}"
                 for kernel in ("im2col", "column_gradients")
                 for path in ("vectors", "one_at_a_time", "several_passes", "several_rounds")} | {
    "deform_conv2d.cuda.column_gradients.input", "deform_conv2d.cuda.column_gradients.offset_mask"}
INDEX_BRANCHES = {"deform_conv2d.cuda.index.32bit", "deform_conv2d.cuda.index.64bit"}


def expected_lane_branches(kernel, geometry, dtype, aligned):
    """The paths of the tiling of `kernel`, im2col or column_gradients (cuda_lane_paths): items
    of one pixel's taps of a deform group, in vectors of 16 bytes (of the dtype in im2col, of
    the float32 or float64 input gradient sums in column_gradients) where the deform group's
    channels, the conv group's (a vector must not straddle two) and the alignment allow."""
    backward = kernel == "column_gradients"
    deform_group_channels = geometry.in_channels // geometry.offset_groups
    conv_group_channels = geometry.in_channels // geometry.groups
    width = 16 // (opmath_bytes(dtype) if backward else dtype.itemsize)
    taps = geometry.kernel[0] * geometry.kernel[1]
    vectors, passes, rounds = cuda_lane_paths(deform_group_channels, dtype,
                                              aligned and conv_group_channels % width == 0,
                                              backward, shared_sample_bytes(dtype), taps)
    prefix = f"deform_conv2d.cuda.{kernel}."
    names = {prefix + ("vectors" if vectors else "one_at_a_time")}
    if passes:
        names.add(prefix + "several_passes")
    if rounds:
        names.add(prefix + "several_rounds")
    return names


# (in_channels, groups, offset_groups, input aligned to 16 bytes), 3 x 3 taps. 16 channels:
# vectors in every dtype, 2 to 8 lanes an item, its taps staged in several rounds. 128: a warp
# of lanes (float32, float64) or half of one (16-bit types' im2col) and one round; two passes
# in float64. 16 in conv groups of 4: im2col's vectors of 8 half-precision channels would
# straddle two, one channel at a time there (the columns gradient's vectors of 4 float32 sums
# fit). 33: one at a time, two passes of a warp. 2 in deform groups of one channel: one lane an
# item, a tap a round. 16 misaligned: one at a time, but for the columns gradient when it reads
# no input (the input gradient alone).
LANE_CASES = [(16, 1, 1, True), (128, 1, 1, True), (16, 4, 1, True), (33, 1, 1, True),
              (2, 1, 2, True), (16, 1, 1, False)]


# Every dtype with 32-bit indices; the 64-bit build with float32's vectors of 4 channels and
# bfloat16's of 8 (4 in the columns gradient).
LANE_INDEX_WIDTHS_AND_DTYPES = [
    ("32bit", dtype) for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16)
] + [("64bit", torch.float32), ("64bit", torch.bfloat16)]


@pytest.mark.parametrize("index_width,dtype", LANE_INDEX_WIDTHS_AND_DTYPES,
                         ids=[f"{w}-{d}" for w, d in LANE_INDEX_WIDTHS_AND_DTYPES])
@pytest.mark.parametrize("in_channels,groups,offset_groups,aligned", LANE_CASES,
                         ids=[f"C{c}-G{g}-OG{og}-{'aligned' if a else 'misaligned'}"
                              for c, g, og, a in LANE_CASES])
def test_im2col_and_column_gradient_paths(emulated, in_channels, groups, offset_groups, aligned,
                                          index_width, dtype):
    """Each path of im2col and of the columns gradient forced by the channels, the input's
    alignment and the index width, and checked to have run: im2col in the forward and wherever
    the weight gradient (the only one that needs the columns) is asked for; the columns gradient
    with its input and its offset and mask parts wherever those are asked for; neither
    otherwise. Every combination of requested gradients, against the float64 CPU op."""
    set_emulator(emulated, wide_indices=index_width == "64bit")
    geometry = Geometry("lanes", 2, in_channels, 4, 3, 4, (3, 3), padding=(1, 1), groups=groups,
                        offset_groups=offset_groups)
    exact = make_operands(geometry, offset_scale=2.0, seed=in_channels)
    operands = [None if t is None else t.to(dtype) for t in exact]
    if not aligned:
        # channels-last and misaligned, so that the driver passes it to the kernels as it lies
        operands[0] = misaligned(operands[0].permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
    grad_output = grad_output_for(operands, geometry)
    rounded = [None if t is None else t.double() for t in operands]
    expected = run_op(torch.ops.deformconv, rounded, geometry, grad_output.double())
    index_build = {"deform_conv2d.cuda.index." + index_width}
    x, o, w, b, m = operands
    geometry_args = (list(geometry.stride), list(geometry.padding), list(geometry.dilation),
                     groups, offset_groups, 0)
    with branch_trace(emulated) as taken:
        out = emulated.deform_conv2d(x, o, w, m, b, *geometry_args)
    assert taken & LANE_BRANCHES == expected_lane_branches("im2col", geometry, dtype, aligned)
    assert taken & INDEX_BRANCHES == index_build, sorted(taken)
    assert_close_at(out, expected[0], dtype, "output")
    for output_mask in requested_subsets(5):
        want_input, want_offset, want_weight, want_mask, _ = output_mask
        paths = set()
        if want_weight:
            paths |= expected_lane_branches("im2col", geometry, dtype, aligned)
        if want_input or want_offset or want_mask:
            reads_input = want_offset or want_mask
            paths |= expected_lane_branches("column_gradients", geometry, dtype,
                                            aligned or not reads_input)
        if want_input:
            paths.add("deform_conv2d.cuda.column_gradients.input")
        if want_offset or want_mask:
            paths.add("deform_conv2d.cuda.column_gradients.offset_mask")
        with branch_trace(emulated) as taken:
            grads = emulated.deform_conv2d_backward(grad_output, x, o, w, m, *geometry_args,
                                                    list(output_mask))
        assert taken & LANE_BRANCHES == paths, (output_mask, sorted(taken))
        kernels_ran = any(output_mask[:4])
        assert taken & INDEX_BRANCHES == (index_build if kernels_ran else set()), sorted(taken)
        for name, wanted, grad, full in zip(("input", "offset", "weight", "mask", "bias"),
                                            output_mask, grads, expected[1]):
            if wanted:
                assert_close_at(grad, full, dtype, f"{name} of {output_mask}")
            else:
                assert grad is None, name
    assert_launches_well_kept(emulated)
