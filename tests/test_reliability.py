"""Property tests against the reference, threads and large tensors (distributed training is in
test_distributed_training.py)."""

import threading

import pytest
import torch

import deformconv
from deform_conv2d_cases import (Geometry, check_indices_past_two_to_the_31, forward_and_grads,
                                 make_operands)
from deform_conv2d_reference import deform_conv2d_reference

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

# A fixed, derandomised profile: CI sees the same examples on every run.
settings.register_profile("deformconv", max_examples=40, deadline=None, derandomize=True)
settings.load_profile("deformconv")


@st.composite
def geometries(draw):
    groups = draw(st.integers(1, 3))
    offset_groups = draw(st.integers(1, 3))
    in_channels = groups * offset_groups * draw(st.integers(1, 2))
    kernel = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    padding = (draw(st.integers(0, 2)), draw(st.integers(0, 2)))
    dilation = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    height = draw(st.integers(max(1, dilation[0] * (kernel[0] - 1) + 1 - 2 * padding[0]), 7))
    width = draw(st.integers(max(1, dilation[1] * (kernel[1] - 1) + 1 - 2 * padding[1]), 7))
    return Geometry("hypothesis", draw(st.integers(0, 3)), in_channels,
                    groups * draw(st.integers(1, 2)), height, width, kernel, stride, padding,
                    dilation, groups, offset_groups)


def one_and_two_thread_runs(geometry):
    """(output, gradients) of one float32 run on one thread, then of one on two."""
    operands = make_operands(geometry, dtype=torch.float32)
    previous = torch.get_num_threads()
    try:
        runs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            runs.append(forward_and_grads(deformconv.deform_conv2d, *operands, geometry))
    finally:
        torch.set_num_threads(previous)
    return runs


def test_forward_of_whole_images_per_thread_equals_one_thread(im2col_forward):
    # Two threads and at least two images each: the CPU forward gives each thread whole images
    # in one parallel region (Note [Whole images per thread]), with the float32 GEMMs on
    # oneDNN run by that thread alone. Each image's output and the gradients through it are
    # those of a one-thread run, bit for bit.
    geometry = Geometry("images", 8, 16, 12, 9, 10, (3, 3), padding=(1, 1), offset_groups=2)
    (out_1, grads_1), (out_2, grads_2) = one_and_two_thread_runs(geometry)
    assert torch.equal(out_1, out_2)
    assert all(torch.equal(a, b) for a, b in zip(grads_1, grads_2))


def test_forward_of_windows_per_thread_equals_one_thread(im2col_forward):
    # One image of 9,216 output pixels and 64 channels makes seven windows of pixels (the CPU's
    # 4 MiB of columns and plans per window), which two threads share out in one parallel
    # region (Note [Whole images per thread]), each running its windows' GEMMs on oneDNN alone.
    # The output is that of a one-thread run, bit for bit, and so are the gradients through it
    # but the weight's: the backward of a one-image batch runs oneDNN's weight-gradient GEMM on
    # every thread, which sums over the pixels in an order that depends on the thread count.
    geometry = Geometry("windows", 1, 64, 24, 96, 96, (3, 3), padding=(1, 1), offset_groups=2)
    (out_1, grads_1), (out_2, grads_2) = one_and_two_thread_runs(geometry)
    assert torch.equal(out_1, out_2)
    input_1, offset_1, weight_1, bias_1, mask_1 = grads_1
    input_2, offset_2, weight_2, bias_2, mask_2 = grads_2
    for one_thread, two_threads in ((input_1, input_2), (offset_1, offset_2), (bias_1, bias_2),
                                    (mask_1, mask_2)):
        assert torch.equal(one_thread, two_threads)
    torch.testing.assert_close(weight_2, weight_1, rtol=1e-5, atol=1e-4)


@given(geometry=geometries(), with_mask=st.booleans(), with_bias=st.booleans(),
       offset_scale=st.sampled_from([0.5, 2.0, 8.0]), seed=st.integers(0, 2**16),
       im2col_step=st.integers(0, 4))
def test_property_matches_reference(geometry, with_mask, with_bias, offset_scale, seed,
                                    im2col_step):
    operands = make_operands(geometry, with_mask=with_mask, with_bias=with_bias,
                             offset_scale=offset_scale, seed=seed)
    out, grads = forward_and_grads(deformconv.deform_conv2d, *operands, geometry,
                                   im2col_step=im2col_step)
    ref_out, ref_grads = forward_and_grads(deform_conv2d_reference, *operands, geometry)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-10)
    for ours, theirs in zip(grads, ref_grads):
        torch.testing.assert_close(ours, theirs, atol=1e-10, rtol=1e-10)


GEOMETRY = Geometry("threads", 4, 8, 8, 12, 11, (3, 3), padding=(1, 1), groups=2,
                    offset_groups=2)
# One conv group in float32: the GEMMs run as oneDNN convolutions, whose backward results the
# CPU launchers keep from one window to the next, across calls and threads.
ONE_GROUP_GEOMETRY = Geometry("threads, one group", 4, 8, 8, 12, 11, (3, 3), padding=(1, 1),
                              offset_groups=2)


def run_once(operands, geometry=GEOMETRY):
    return forward_and_grads(deformconv.deform_conv2d, *operands, geometry, im2col_step=2)


@pytest.mark.parametrize("geometry", [GEOMETRY, ONE_GROUP_GEOMETRY], ids=lambda g: g.name)
def test_concurrent_python_threads_agree_with_serial_runs(geometry):
    inputs = [make_operands(geometry, dtype=torch.float32, seed=seed) for seed in range(6)]
    serial = [run_once(operands, geometry) for operands in inputs]
    results = [None] * len(inputs)

    def work(index):
        results[index] = run_once(inputs[index], geometry)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for (out, grads), (serial_out, serial_grads) in zip(results, serial):
        assert torch.equal(out, serial_out)
        assert all(torch.equal(a, b) for a, b in zip(grads, serial_grads))


def test_results_do_not_depend_on_thread_count():
    operands = make_operands(GEOMETRY)
    previous = torch.get_num_threads()
    try:
        runs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            runs.append(run_once(operands))
    finally:
        torch.set_num_threads(previous)
    for out, grads in runs[1:]:
        torch.testing.assert_close(out, runs[0][0], atol=1e-12, rtol=1e-12)
        for a, b in zip(grads, runs[0][1]):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_indices_past_two_to_the_31():
    check_indices_past_two_to_the_31("cpu")
