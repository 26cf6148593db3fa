"""The CUDA backwards under PyTorch's deterministic mode (Note [Gathered input gradients],
csrc/cuda/gathered_input_gradient.cuh), run by the emulator: under schedules that differ as a
GPU's may (blocks in a seeded random order, the warps of a block interleaved anew at each
synchronisation point), the atomic path's input gradient changes its bits, the gathered path's
gradients do not, and they equal the float64 references; each path forced by the backward op's
`deterministic` and seen in the branch trace, for every combination of requested gradients;
and a batch gathered in chunks of images gives the same bits as at once."""

from dataclasses import dataclass
from typing import Callable, Sequence, Tuple

import pytest
import torch

import dcnv3_reference
import deform_conv2d_cases
import ms_deform_attn_reference
from branching import assert_close_at, branch_trace, requested_subsets
from deform_conv2d_reference import deform_conv2d_reference
from emulation import FORWARD, REVERSE, SHUFFLED, set_emulator

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# Five schedules: (block order, thread order, seed).
ORDERS = [(FORWARD, FORWARD, 0), (REVERSE, REVERSE, 0), (SHUFFLED, SHUFFLED, 1),
          (SHUFFLED, SHUFFLED, 2), (SHUFFLED, SHUFFLED, 3)]


@dataclass
class Case:
    """An op's backward at a shape where many samples reach each input pixel: `backward(ops,
    dtype, requested, deterministic)` calls ops.<op>_backward on the operands rounded to dtype;
    `expected(dtype)` is the reference's gradients in float64 on those rounded operands;
    `chunks_branch` the launcher's record of a batch gathered in chunks of images; an image's
    samples and rows of the map, `map_per_image`."""
    gradients: Sequence[str]
    input_branch: str
    backward: Callable
    expected: Callable
    chunks_branch: str
    map_per_image: Tuple[int, int]


def deform_conv2d_case(groups=1, offset_groups=2, channels=4, with_mask=True):
    """DCN v2 (v1 without the mask) of 2 images of 6 x 6 pixels, 3 x 3 taps, `channels` in and
    out in `groups` conv groups and `offset_groups` deform groups. From 32 channels on
    (ResNeXt-DCN's 32 groups), images of 4 x 4: the groups make that case, and its channels
    make it the costliest under the emulator, several times over under the sanitizers."""
    size = 4 if channels >= 32 else 6
    g = deform_conv2d_cases.Geometry("overlapping", 2, channels, channels, size, size, (3, 3),
                                      padding=(1, 1), groups=groups, offset_groups=offset_groups)
    input, offset, weight, _, mask = deform_conv2d_cases.make_operands(g, with_bias=False,
                                                                        with_mask=with_mask)
    operands = (input, offset, weight, mask)
    grad_output = torch.randn(2, channels, *g.output_size(),
                              generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    arguments = (list(g.stride), list(g.padding), list(g.dilation), g.groups, g.offset_groups)
    # The places of the case's gradients among the backward's five (v1 has no mask).
    places = (0, 1, 2, 3, 4) if with_mask else (0, 1, 2, 4)

    def rounded(dtype):
        return [None if t is None else t.to(dtype) for t in operands]

    def backward(ops, dtype, requested, deterministic):
        output_mask = [False] * 5
        for place, want in zip(places, requested):
            output_mask[place] = want
        grads = ops.deform_conv2d_backward(grad_output.to(dtype), *rounded(dtype), *arguments,
                                           0, output_mask, deterministic)
        return [grads[place] for place in places]

    def expected(dtype):
        input, offset, weight, mask = (None if t is None else t.double().requires_grad_()
                                       for t in rounded(dtype))
        output = deform_conv2d_reference(input, offset, weight, None, g.stride, g.padding,
                                         g.dilation, mask)
        bias = torch.zeros(channels, dtype=torch.float64, requires_grad=True)
        output = output + bias[None, :, None, None]
        leaves = [t for t in (input, offset, weight, mask, bias) if t is not None]
        return torch.autograd.grad(output, leaves, grad_output.to(dtype).double())

    gradients = ("input", "offset", "weight", "mask", "bias")
    return Case(tuple(gradients[place] for place in places),
                "deform_conv2d.cuda.column_gradients.input", backward, expected,
                "deform_conv2d.cuda.column_gradients.input.image_chunks",
                (size * size * offset_groups * 9, size * size * offset_groups))


def dcnv3_case(op, group=2, group_channels=8):
    geometry = ((3, 3), (1, 1), (1, 1), (1, 1), group, group_channels)
    input, offset, mask = dcnv3_reference.random_operands(2, 5, 6, geometry, spread=1.5)
    (kh, kw), (sh, sw), (ph, pw), (dh, dw), group, group_channels = geometry
    others = (kh, kw, sh, sw, ph, pw, dh, dw, group, group_channels, 1.0, 0, False)
    grad_output = torch.randn(2, 5, 6, group * group_channels,
                              generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    # 5 x 6 output pixels of 9 points a group; 5 x 6 input pixels.
    map_per_image = (30 * group * 9, 30 * group)

    def rounded(dtype):
        return [t.to(dtype) for t in (input, offset, mask)]

    if op == "dcnv3":
        def backward(ops, dtype, requested, deterministic):
            return ops.dcnv3_backward(grad_output.to(dtype), *rounded(dtype), *others,
                                      list(requested), deterministic)

        def expected(dtype):
            leaves = [t.double().requires_grad_() for t in rounded(dtype)]
            output = dcnv3_reference.dcnv3_reference(*leaves, *others[:-3], others[-3])
            return torch.autograd.grad(output, leaves, grad_output.to(dtype).double())

        return Case(("input", "offset", "mask"), "dcnv3.cuda.backward.input_gradient",
                    backward, expected, "dcnv3.cuda.backward.input_gradient.image_chunks",
                    map_per_image)

    def packed(dtype):
        x, o, m = rounded(dtype)
        return x, dcnv3_reference.pack_offset_mask(o, m, group, padding_value=0.0)

    def backward(ops, dtype, requested, deterministic):
        return ops.dcnv4_backward(grad_output.to(dtype), *packed(dtype), *others,
                                  list(requested), deterministic)

    def expected(dtype):
        x, offset_mask = (t.double().requires_grad_() for t in packed(dtype))
        points = kh * kw
        o, m, _ = dcnv3_reference.unpack_offset_mask(offset_mask, group, points)
        output = dcnv3_reference.dcnv3_reference(x, o, m, *others[:-3], others[-3])
        return torch.autograd.grad(output, (x, offset_mask), grad_output.to(dtype).double())

    return Case(("input", "offset_mask"), "dcnv3.cuda.backward.input_gradient", backward,
                expected, "dcnv3.cuda.backward.input_gradient.image_chunks", map_per_image)


def ms_deform_attn_case(heads=2, channels=8, points_per_level=None, sampling="bilinear",
                        softmax=False):
    # 24 queries, 4 points in each of two small levels (or points_per_level's): about 30
    # corners a pixel.
    value, shapes, starts, locations, weights = ms_deform_attn_reference.make_operands(
        [(4, 5), (2, 3)], batch=2, queries=24, heads=heads, channels=channels, points=4,
        points_per_level=points_per_level)
    grad_output = torch.randn(2, 24, heads * channels, generator=torch.Generator().manual_seed(1),
                              dtype=torch.float64)
    points = [] if points_per_level is None else points_per_level

    def rounded(dtype):
        return [t.to(dtype) for t in (value, locations, weights)]

    def backward(ops, dtype, requested, deterministic):
        v, loc, w = rounded(dtype)
        return ops.ms_deform_attn_backward(grad_output.to(dtype), v, shapes, starts, loc, w, 64,
                                           points, sampling, softmax, list(requested),
                                           deterministic)

    def expected(dtype):
        leaves = [t.double().detach().requires_grad_() for t in rounded(dtype)]
        if sampling == "nearest":
            # The pixels chosen in the locations' own dtype; no part in the graph.
            leaves[1] = rounded(dtype)[1].detach()
        output = ms_deform_attn_reference.ms_deform_attn_reference(
            leaves[0], shapes, starts, leaves[1], leaves[2], points_per_level, sampling, softmax)
        differentiated = [leaf for leaf in leaves if leaf.requires_grad]
        grads = iter(torch.autograd.grad(output, differentiated,
                                         grad_output.to(dtype).double()))
        return [next(grads) if leaf.requires_grad else torch.zeros_like(leaf, dtype=torch.float64)
                for leaf in leaves]

    samples = 2 * 4 if points_per_level is None else sum(points_per_level)
    return Case(("value", "sampling_locations", "attention_weights"),
                "ms_deform_attn.cuda.backward.value_gradient", backward, expected,
                "ms_deform_attn.cuda.backward.value_gradient.image_chunks",
                (24 * heads * samples, (20 + 6) * heads))


# Two deform groups in one conv group; conv groups within one deform group (ResNeXt-DCN: 32
# conv groups, one deform group); deform groups that straddle conv groups (3 conv groups of 2
# channels, 2 deform groups of 3).
CASES = {"deform_conv2d": deform_conv2d_case,
         "deform_conv2d-groups32": lambda: deform_conv2d_case(32, 1, 32),
         "deform_conv2d-groups3-offset2": lambda: deform_conv2d_case(3, 2, 6),
         "dcnv3": lambda: dcnv3_case("dcnv3"), "dcnv4": lambda: dcnv3_case("dcnv4"),
         "ms_deform_attn": ms_deform_attn_case,
         "ms_deform_attn-points-per-level": lambda: ms_deform_attn_case(points_per_level=[6, 3]),
         "ms_deform_attn-nearest": lambda: ms_deform_attn_case(sampling="nearest"),
         "ms_deform_attn-softmax": lambda: ms_deform_attn_case(softmax=True)}


def under_each_order(emulated, run, orders=ORDERS, **settings):
    """run()'s results under each of `orders`, the emulator's other `settings` beside them."""
    results = []
    try:
        for block_order, thread_order, seed in orders:
            set_emulator(emulated, block_order=block_order, thread_order=thread_order, seed=seed,
                         **settings)
            results.append(run())
    finally:
        set_emulator(emulated)
    return results


@pytest.mark.parametrize("op", list(CASES))
def test_the_atomic_input_gradient_changes_its_bits_with_the_schedule(emulated, op):
    """Shows that the order test below can fail: the atomic path's float32 input gradient is
    not the same bits under the five schedules."""
    case = CASES[op]()
    requested = [True] + [False] * (len(case.gradients) - 1)
    grads = under_each_order(emulated,
                             lambda: case.backward(emulated, torch.float32, requested, False)[0])
    assert any(not torch.equal(grads[0], other) for other in grads[1:])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", list(CASES))
def test_the_gathered_gradients_keep_their_bits_under_every_schedule(emulated, op, dtype):
    """Every gradient of the gathered path: the same bits under the five schedules, and close to
    the float64 reference at dtype's precision."""
    case = CASES[op]()
    requested = [True] * len(case.gradients)
    runs = under_each_order(emulated, lambda: case.backward(emulated, dtype, requested, True))
    for name, first, *others in zip(case.gradients, *runs):
        for other in others:
            assert torch.equal(first, other), name
    for name, grad, expected in zip(case.gradients, runs[0], case.expected(dtype)):
        assert_close_at(grad, expected, dtype, name)


@pytest.mark.parametrize("dtype", [torch.float64, *DTYPES], ids=str)
@pytest.mark.parametrize("op", list(CASES))
def test_deterministic_takes_the_gathered_path_for_every_requested_subset(emulated, op, dtype):
    """deterministic=True takes the gathered input gradient, False the atomic adds, whatever else
    is asked, in every dtype; the gradients of both agree with the reference."""
    case = CASES[op]()
    expected = case.expected(dtype)
    for requested in requested_subsets(len(case.gradients)):
        for deterministic in (True, False):
            with branch_trace(emulated) as taken:
                grads = case.backward(emulated, dtype, requested, deterministic)
            paths = {name for name in taken if name.startswith(case.input_branch + ".")}
            if requested[0]:
                path = "gathered" if deterministic else "atomic_adds"
                assert paths == {f"{case.input_branch}.{path}"}, sorted(taken)
            else:
                assert paths == set(), sorted(taken)
            for name, want, grad, full in zip(case.gradients, requested, grads, expected):
                if want:
                    assert_close_at(grad, full, dtype, f"{name} of {requested}")
                else:
                    assert grad is None, name


@pytest.mark.parametrize("op", list(CASES))
def test_a_batch_gathered_in_chunks_of_images_keeps_its_bits(emulated, op):
    """Where a batch's map would pass DEFORMCONV_GATHER_MAP_BYTES (lowered here below one
    image's), the launcher gathers image by image: every gradient the same bits as the whole
    batch's at once, in the samples' order either way."""
    case = CASES[op]()
    requested = [True] * len(case.gradients)
    with branch_trace(emulated) as taken:
        whole = case.backward(emulated, torch.float32, requested, True)
    assert case.chunks_branch not in taken
    emulated.set_gather_map_bytes(1)
    try:
        with branch_trace(emulated) as taken:
            chunked = case.backward(emulated, torch.float32, requested, True)
    finally:
        set_emulator(emulated)
    assert case.chunks_branch in taken
    for name, at_once, by_image in zip(case.gradients, whole, chunked):
        assert torch.equal(at_once, by_image), name


@pytest.mark.parametrize("op", list(CASES))
def test_the_map_bound_counts_every_byte_of_the_map(emulated, op):
    """DEFORMCONV_GATHER_MAP_BYTES bounds what Note [Gathered input gradients] counts: 120 bytes
    a sample in float32, 8 a row, and the list starts' entry past the last row. A batch of two
    images whose map is one byte over the bound is gathered image by image; at the bound, at
    once."""
    case = CASES[op]()
    samples, rows = case.map_per_image
    batch_bytes = 2 * (120 * samples + 8 * rows) + 8
    requested = [True] * len(case.gradients)
    for bound, chunked in ((batch_bytes, False), (batch_bytes - 1, True)):
        emulated.set_gather_map_bytes(bound)
        try:
            with branch_trace(emulated) as taken:
                case.backward(emulated, torch.float32, requested, True)
        finally:
            set_emulator(emulated)
        assert (case.chunks_branch in taken) == chunked, bound


def test_deform_conv2d_gathers_over_several_blocks_and_windows(emulated):
    """DCN v1/v2 gathers a window at a time, each adding into its block's input gradient: two
    blocks (im2col_step 1) of 1,089 output pixels in two windows (of at least 512), against the
    reference, the same bits under a shuffled schedule as in order."""
    g = deform_conv2d_cases.Geometry("windows", 2, 2, 2, 33, 33, (3, 3), padding=(1, 1))
    input, offset, weight, _, mask = deform_conv2d_cases.make_operands(g, with_bias=False)
    # Positions a quarter off the grid: among 19,602 samples some would otherwise fall within
    # float32's rounding of an integer, where the offset's derivative is one-sided.
    offset = torch.round(offset * 2) / 2 + 0.25
    grad_output = torch.randn(2, 2, 33, 33, generator=torch.Generator().manual_seed(1),
                              dtype=torch.float64)
    leaves = [t.float().double().requires_grad_() for t in (input, offset, weight, mask)]
    reference = deform_conv2d_reference(leaves[0], leaves[1], leaves[2], None, g.stride,
                                        g.padding, g.dilation, leaves[3])
    expected = torch.autograd.grad(reference, leaves, grad_output.float().double())
    arguments = (list(g.stride), list(g.padding), list(g.dilation), g.groups, g.offset_groups)

    def backward():
        with branch_trace(emulated) as taken:
            grads = emulated.deform_conv2d_backward(
                grad_output.float(), input.float(), offset.float(), weight.float(), mask.float(),
                *arguments, 1, [True, True, True, True, False], True)
        assert {"deform_conv2d.backward.blocks", "deform_conv2d.backward.windows",
                "deform_conv2d.cuda.column_gradients.input.gathered"} <= taken, sorted(taken)
        return grads[:4]

    runs = under_each_order(emulated, backward, orders=(ORDERS[0], ORDERS[2]),
                            columns_tile_bytes=1)
    for name, first, *others in zip(("input", "offset", "weight", "mask"), *runs):
        assert all(torch.equal(first, other) for other in others), name
    for name, grad, full in zip(("input", "offset", "weight", "mask"), runs[0], expected):
        assert_close_at(grad, full, torch.float32, name)


def assert_gathered_gradients_for_every_subset(emulated, case, dtype):
    """For every combination of requested gradients, deterministic=True takes the gathered path
    where the input gradient is asked for, and every gradient asked for equals the float64
    reference at dtype's precision."""
    expected = case.expected(dtype)
    for requested in requested_subsets(len(case.gradients)):
        with branch_trace(emulated) as taken:
            grads = case.backward(emulated, dtype, requested, True)
        assert (f"{case.input_branch}.gathered" in taken) == requested[0], sorted(taken)
        for name, want, grad, full in zip(case.gradients, requested, grads, expected):
            if want:
                assert_close_at(grad, full, dtype, f"{name} of {requested}")
            else:
                assert grad is None, name


# (groups, offset_groups, channels): each within the other, equal, one alone, and neither
# within the other ((2, 3) and (3, 2) of 6 channels: a deform group's channels straddle a
# conv group's end). The columns gradient is laid out by conv group, so a deform group's run
# of channels is split there.
GROUPINGS = [(1, 1, 4), (2, 1, 4), (4, 2, 8), (2, 2, 4), (1, 2, 4), (3, 1, 6), (32, 1, 32),
             (2, 3, 6), (3, 2, 6)]


@pytest.mark.parametrize("dtype", [torch.float64, *DTYPES], ids=str)
@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("groups,offset_groups,channels", GROUPINGS,
                         ids=[f"groups{g}-offset{o}" for g, o, _ in GROUPINGS])
def test_deform_conv2d_gathered_gradients_over_conv_and_deform_groups(
        emulated, groups, offset_groups, channels, version, dtype):
    case = deform_conv2d_case(groups, offset_groups, channels, with_mask=version == "v2")
    assert_gathered_gradients_for_every_subset(emulated, case, dtype)


# DCNv3/DCNv4's groups and MSDA's heads, of 1 to 8 channels (a run of one channel, runs of
# vectors, and runs that no vector width divides).
GROUP_CHANNELS = [(1, 8), (2, 8), (3, 4), (4, 2), (8, 1), (2, 3)]


@pytest.mark.parametrize("dtype", [torch.float64, *DTYPES], ids=str)
@pytest.mark.parametrize("op", ["dcnv3", "dcnv4"])
@pytest.mark.parametrize("group,group_channels", GROUP_CHANNELS,
                         ids=[f"group{g}x{c}" for g, c in GROUP_CHANNELS])
def test_dcnv3_gathered_gradients_over_groups(emulated, group, group_channels, op, dtype):
    assert_gathered_gradients_for_every_subset(emulated, dcnv3_case(op, group, group_channels),
                                               dtype)


@pytest.mark.parametrize("dtype", [torch.float64, *DTYPES], ids=str)
@pytest.mark.parametrize("heads,channels", GROUP_CHANNELS,
                         ids=[f"heads{h}x{c}" for h, c in GROUP_CHANNELS])
def test_ms_deform_attn_gathered_gradients_over_heads(emulated, heads, channels, dtype):
    assert_gathered_gradients_for_every_subset(emulated, ms_deform_attn_case(heads, channels),
                                               dtype)


@pytest.mark.parametrize("groups,offset_groups,channels", GROUPINGS,
                         ids=[f"groups{g}-offset{o}" for g, o, _ in GROUPINGS])
def test_deform_conv2d_gathers_over_windows_at_every_grouping(emulated, groups, offset_groups,
                                                              channels):
    """The gathered input gradient of a block in two windows of its 1,089 output pixels, each
    window's columns laid out by conv group, against the reference."""
    g = deform_conv2d_cases.Geometry("windows", 1, channels, channels, 33, 33, (3, 3),
                                      padding=(1, 1), groups=groups, offset_groups=offset_groups)
    input, offset, weight, _, mask = deform_conv2d_cases.make_operands(g, with_bias=False)
    offset = torch.round(offset * 2) / 2 + 0.25
    grad_output = torch.randn(1, channels, 33, 33, generator=torch.Generator().manual_seed(1),
                              dtype=torch.float64)
    leaves = [t.float().double().requires_grad_() for t in (input, offset, weight, mask)]
    reference = deform_conv2d_reference(leaves[0], leaves[1], leaves[2], None, g.stride,
                                        g.padding, g.dilation, leaves[3])
    (expected,) = torch.autograd.grad(reference, leaves[0], grad_output.float().double())
    arguments = (list(g.stride), list(g.padding), list(g.dilation), g.groups, g.offset_groups)
    set_emulator(emulated, columns_tile_bytes=1)
    try:
        with branch_trace(emulated) as taken:
            grad_input = emulated.deform_conv2d_backward(
                grad_output.float(), input.float(), offset.float(), weight.float(), mask.float(),
                *arguments, 1, [True, False, False, False, False], True)[0]
    finally:
        set_emulator(emulated)
    assert {"deform_conv2d.backward.windows",
            "deform_conv2d.cuda.column_gradients.input.gathered"} <= taken, sorted(taken)
    assert_close_at(grad_input, expected, torch.float32, "input")
