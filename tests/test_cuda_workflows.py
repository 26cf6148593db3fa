"""What GPU users do with the ops beyond one call: float64 gradcheck on the device, a stream other
than the default, a whole training step captured in a CUDA graph and replayed, torch.compile,
autocast, deterministic algorithms, a tensor past 2^31 elements, any im2col_step. Skipped where
no GPU is present, which is every machine of this project's CI; tools/gpu_check.sh runs them on
a machine with one."""

import copy

import pytest
import torch

import dcnv3_reference
import deformconv
import ms_deform_attn_reference
from deform_conv2d_cases import (GEOMETRIES, check_indices_past_two_to_the_31, differentiable,
                                 forward_and_grads, make_operands)

needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and deformconv.cuda_compiled()),
    reason="needs a CUDA device and deformconv built with its CUDA kernels")
pytestmark = [pytest.mark.cuda, pytest.mark.workflows, needs_cuda]


def on_gpu(operands, dtype=None):
    return [None if t is None else t.to(device="cuda", dtype=dtype or t.dtype)
            for t in operands]


@pytest.mark.parametrize("with_mask", [False, True], ids=["v1", "v2"])
def test_gradcheck_on_the_gpu(with_mask):
    geometry = GEOMETRIES[2]
    operands = make_operands(geometry, with_mask=with_mask, batch=1)
    leaves = [t for t in differentiable(*on_gpu(operands)) if t is not None]

    def fn(*args):
        x, o, w, b = args[:4]
        m = args[4] if with_mask else None
        return deformconv.deform_conv2d(x, o, w, b, geometry.stride, geometry.padding,
                                        geometry.dilation, m)

    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-6)


def test_a_stream_other_than_the_default():
    # The launches go to the current stream: the results computed on a side stream, whose
    # operands were made on it, equal those of the default stream.
    geometry = GEOMETRIES[4]
    operands = on_gpu(make_operands(geometry, dtype=torch.float32))
    expected, expected_grads = forward_and_grads(deformconv.deform_conv2d, *operands, geometry)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fresh = [None if t is None else t * 1 for t in operands]
        out, grads = forward_and_grads(deformconv.deform_conv2d, *fresh, geometry)
    side.synchronize()
    torch.testing.assert_close(out, expected)
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b)


def small_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        deformconv.ModulatedDeformConv2dPack(4, 8, 3, padding=1, deform_groups=2),
        torch.nn.ReLU(),
        deformconv.DeformConv2dPack(8, 4, 3, padding=1),
    )
    with torch.no_grad():
        for layer in (model[0], model[2]):
            layer.conv_offset.weight.normal_(0, 0.1)
    return model.cuda()


def training_batches(count):
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 4, 9, 9, generator=generator).cuda(),
             torch.randn(4, 4, 9, 9, generator=generator).cuda()) for _ in range(count)]


def test_training_step_captured_in_a_cuda_graph():
    # Forward, backward and an SGD step of a DCN model, captured once and replayed on new
    # batches: capture fails if any launch leaves the capturing stream, synchronises with the
    # host or allocates outside the caching allocator. The replays must train the model as
    # eager steps do.
    eager, graphed = small_model(), small_model()
    graphed.load_state_dict(eager.state_dict())
    batches = training_batches(6)
    static_x = batches[0][0].clone()
    static_target = batches[0][1].clone()

    def step(model, x, target):
        # Plain SGD, its update written out: tensor operations only, which a graph replays.
        for parameter in model.parameters():
            if parameter.grad is not None:
                parameter.grad.zero_()
        loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        with torch.no_grad():
            parameters = list(model.parameters())
            torch._foreach_add_(parameters, [p.grad for p in parameters], alpha=-0.05)
        return loss

    # Warm-up on a side stream, as torch.cuda.graphs asks, then capture.
    warmup = torch.cuda.Stream()
    warmup.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warmup):
        for x, target in batches[:2]:
            step(eager, x, target)
            step(graphed, x, target)
    torch.cuda.current_stream().wait_stream(warmup)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step(graphed, static_x, static_target)
    # The capture itself ran nothing: the graph's first replay makes the third step.
    for x, target in batches[2:]:
        static_x.copy_(x)
        static_target.copy_(target)
        graph.replay()
        eager_loss = step(eager, x, target)
        torch.testing.assert_close(static_loss, eager_loss, rtol=1e-4, atol=1e-5)
    for a, b in zip(graphed.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_torch_compile_fullgraph():
    geometry = GEOMETRIES[1]
    x, o, w, b, m = on_gpu(make_operands(geometry, dtype=torch.float32))

    def fn(x, o, w, b, m):
        return deformconv.deform_conv2d(x, o, w, b, geometry.stride, geometry.padding,
                                        geometry.dilation, m).relu()

    compiled = torch.compile(fn, fullgraph=True)
    torch.testing.assert_close(compiled(x, o, w, b, m), fn(x, o, w, b, m))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_autocast(dtype):
    # The op runs in float32 under autocast (deformconv/ops/_autograd.py), its operands cast
    # up from whatever dtype they came in.
    geometry = GEOMETRIES[1]
    x, o, w, b, m = on_gpu(make_operands(geometry, dtype=torch.float32))
    with torch.autocast("cuda", dtype=dtype):
        out = deformconv.deform_conv2d(x.to(dtype), o.to(dtype), w, b, 1, 1, 1, m)
    assert out.dtype == torch.float32
    expected = deformconv.deform_conv2d(x.to(dtype).float(), o.to(dtype).float(), w, b, 1, 1,
                                        1, m)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("op", ["deform_conv2d", "dcnv3", "dcnv4", "ms_deform_attn"])
def test_deterministic_algorithms(op, monkeypatch):
    # Under deterministic mode the backwards gather the input gradient (Note [Gathered input
    # gradients]): no alert, and the same bits from one backward to the next. DCN's GEMMs are
    # cuBLAS's, which deterministic mode allows only with a fixed workspace, as for torch's own.
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        generator = torch.Generator().manual_seed(0)
        if op == "deform_conv2d":
            leaves = [t.requires_grad_() for t in on_gpu(make_operands(GEOMETRIES[1]))]
            x, o, w, b, m = leaves

            def forward():
                return deformconv.deform_conv2d(x, o, w, b, 1, 1, 1, m)
        elif op == "ms_deform_attn":
            value, shapes, starts, locations, weights = ms_deform_attn_reference.make_operands(
                [(6, 7), (3, 4)], queries=40, channels=32, points=4)
            leaves = [t.cuda().float().requires_grad_() for t in (value, locations, weights)]
            shapes, starts = shapes.cuda(), starts.cuda()

            def forward():
                return deformconv.ms_deform_attn(leaves[0], shapes, starts, leaves[1],
                                                 leaves[2])
        else:
            x = torch.randn(2, 9, 10, 32, generator=generator).cuda().requires_grad_()
            o = (torch.randn(2, 9, 10, 36, generator=generator) * 2).cuda()
            m = torch.rand(2, 9, 10, 18, generator=generator).cuda()
            if op == "dcnv3":
                leaves = [x, o.requires_grad_(), m.requires_grad_()]

                def forward():
                    return deformconv.dcnv3(x, o, m, 3, 3, 1, 1, 1, 1, 1, 1, 2, 16, 1.0)
            else:
                offset_mask = dcnv3_reference.pack_offset_mask(o, m, 2, padding_value=0.0)
                leaves = [x, offset_mask.requires_grad_()]

                def forward():
                    return deformconv.dcnv4(x, offset_mask, 3, 3, 1, 1, 1, 1, 1, 1, 2, 16, 1.0)
        grad_output = torch.randn(forward().shape, generator=generator).cuda()
        runs = [torch.autograd.grad(forward(), leaves, grad_output) for _ in range(3)]
        for first, *others in zip(*runs):
            assert all(torch.equal(first, other) for other in others)
    finally:
        torch.use_deterministic_algorithms(previous)


def test_indices_past_two_to_the_31():
    free, _ = torch.cuda.mem_get_info()
    # The input and its gradient in float16, the gradient's float32 sums: about 17 GB.
    if free < 24 << 30:
        pytest.skip(f"needs 24 GiB of free GPU memory, {free >> 30} GiB free")
    check_indices_past_two_to_the_31("cuda")


@pytest.mark.parametrize("im2col_step", [0, 1, 2, 3, 7, 64])
def test_any_im2col_step(im2col_step):
    geometry = GEOMETRIES[4]
    operands = make_operands(geometry, batch=7)
    expected, expected_grads = forward_and_grads(deformconv.deform_conv2d, *operands, geometry)
    out, grads = forward_and_grads(deformconv.deform_conv2d, *on_gpu(operands), geometry,
                                   im2col_step=im2col_step)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-10, rtol=1e-10)
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a.cpu(), b, atol=1e-10, rtol=1e-10)


def test_model_copies_to_the_gpu_and_back():
    # state_dict round trip between devices: the same numbers on both.
    model = small_model().double()
    x = torch.randn(2, 4, 9, 9, dtype=torch.float64, device="cuda")
    on_cpu = copy.deepcopy(model).cpu()
    torch.testing.assert_close(model(x).cpu(), on_cpu(x.cpu()), atol=1e-10, rtol=1e-10)
