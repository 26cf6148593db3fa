"""Multi-scale deformable attention on a GPU against the CPU op: forward and every gradient, in
four dtypes, over levels, heads, channels and points of every launcher path; gradcheck;
devices; the levels checked once per pair of index tensors (no synchronisation after the
first call, so a CUDA graph captures the op). Skipped where no GPU is present, which is every machine of this project's CI;
tools/gpu_check.sh runs them on a machine with one."""

import pytest
import torch

import deformconv
from branching import assert_close_at
from ms_deform_attn_reference import DEFAULT_OPTIONS, GRID, make_operands

needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and deformconv.cuda_compiled()),
    reason="needs a CUDA device and deformconv built with its CUDA kernels")
pytestmark = [pytest.mark.cuda, needs_cuda]

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shapes,heads,channels,points", GRID)
def test_cuda_matches_cpu(shapes, heads, channels, points, dtype):
    value, spatial_shapes, starts, locations, weights = make_operands(
        shapes, heads=heads, channels=channels, points=points)
    low = [value.to(dtype), locations.to(dtype), weights.to(dtype)]
    # The CPU op in float64 on the same rounded operands.
    exact = [low[0].double(), spatial_shapes, starts, low[1].double(), low[2].double()]
    expected = deformconv.ms_deform_attn(*exact)
    grad_output = torch.randn(expected.shape, generator=torch.Generator().manual_seed(2),
                              dtype=torch.float64)
    expected_grads = torch.ops.deformconv.ms_deform_attn_backward(
        grad_output, *exact, *DEFAULT_OPTIONS, [True, True, True])
    on_gpu = [low[0].cuda(), spatial_shapes.cuda(), starts.cuda(), low[1].cuda(),
              low[2].cuda()]
    out = deformconv.ms_deform_attn(*on_gpu)
    grads = torch.ops.deformconv.ms_deform_attn_backward(grad_output.to(dtype).cuda(), *on_gpu,
                                                         *DEFAULT_OPTIONS, [True, True, True])
    assert out.dtype == dtype and out.is_cuda
    assert_close_at(out.cpu(), expected, dtype, "output")
    for name, grad, full in zip(("value", "sampling_locations", "attention_weights"), grads,
                                expected_grads):
        assert grad.dtype == dtype
        assert_close_at(grad.cpu(), full, dtype, name)


def test_cuda_gradcheck():
    value, shapes, starts, locations, weights = [
        t.cuda() for t in make_operands([(3, 4), (2, 2)], batch=1, queries=3, heads=2,
                                        channels=4, points=2)]

    def op(value, locations, weights):
        return deformconv.ms_deform_attn(value, shapes, starts, locations, weights)

    assert torch.autograd.gradcheck(op, [t.requires_grad_() for t in (value, locations,
                                                                     weights)])


def test_operands_on_another_device_raise():
    value, shapes, starts, locations, weights = make_operands([(3, 4)])
    with pytest.raises(ValueError, match="expected sampling_locations to be on the device of "
                                         "value"):
        deformconv.ms_deform_attn(value.cuda(), shapes.cuda(), starts.cuda(), locations,
                                  weights.cuda())


def test_levels_read_once_so_that_a_cuda_graph_captures_the_op():
    # Forward and backward of the op with index tensors the driver has checked before: no copy
    # to the host while the stream captures. The replays compute what eager calls do.
    value, shapes, starts, locations, weights = [
        t.cuda() for t in make_operands([(6, 5), (3, 3), (1, 2)], queries=7, heads=2,
                                        channels=8, points=3, dtype=torch.float32)]
    static = [t.clone().requires_grad_() for t in (value, locations, weights)]

    def step():
        for t in static:
            t.grad = None
        out = deformconv.ms_deform_attn(static[0], shapes, starts, static[1], static[2])
        out.square().sum().backward()
        return out

    warmup = torch.cuda.Stream()
    warmup.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warmup):
        step()
    torch.cuda.current_stream().wait_stream(warmup)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    for seed in range(2):
        generator = torch.Generator().manual_seed(seed)
        fresh = [torch.rand(t.shape, generator=generator).cuda() for t in static]
        with torch.no_grad():
            for t, new in zip(static, fresh):
                t.copy_(new)
        graph.replay()
        leaves = [t.clone().requires_grad_() for t in fresh]
        expected = deformconv.ms_deform_attn(leaves[0], shapes, starts, leaves[1], leaves[2])
        expected.square().sum().backward()
        torch.testing.assert_close(static_out, expected)
        for t, leaf in zip(static, leaves):
            torch.testing.assert_close(t.grad, leaf.grad)


def test_levels_changed_in_place_on_the_gpu_are_checked_again():
    operands = [t.cuda() for t in make_operands([(4, 6), (2, 3)])]
    deformconv.ms_deform_attn(*operands)
    operands[2][1] += 1
    with pytest.raises(ValueError, match=r"expected level_start_index\[1\] to be 24"):
        deformconv.ms_deform_attn(*operands)
