"""The PyTorch workflows: TorchScript, opcheck, torch.compile, torch.export, ONNX, autocast and
determinism."""

import io
import warnings

import pytest
import torch

import deformconv
from deform_conv2d_cases import GEOMETRIES, make_operands
from export_models import EXPORTERS, TwoLayerNet

pytestmark = pytest.mark.workflows

# (module class, number of forward inputs)
MODULES = [
    (deformconv.DeformConv2d, 2),
    (deformconv.ModulatedDeformConv2d, 3),
    (deformconv.DeformConv2dPack, 1),
    (deformconv.ModulatedDeformConv2dPack, 1),
]


def make_module(cls, seed=0):
    torch.manual_seed(seed)
    module = cls(4, 6, 3, stride=1, padding=1, groups=2, deform_groups=2).double()
    if hasattr(module, "conv_offset"):
        # Non-zero offsets, so that the deformable path is exercised.
        with torch.no_grad():
            module.conv_offset.weight.normal_(0, 0.3)
    return module


def module_inputs(n_inputs, batch=2, height=7, width=6, seed=1):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 4, height, width, generator=generator, dtype=torch.float64)
    offset = torch.randn(batch, 2 * 2 * 9, height, width, generator=generator,
                         dtype=torch.float64)
    mask = torch.rand(batch, 2 * 9, height, width, generator=generator, dtype=torch.float64)
    return [x, offset, mask][:n_inputs]


def outputs_and_grads(module, inputs):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = module(*leaves)
    out.pow(2).sum().backward()
    grads = [t.grad for t in leaves] + [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    return out.detach(), grads


def assert_same(actual, expected, **tolerance):
    out, grads = actual
    expected_out, expected_grads = expected
    torch.testing.assert_close(out, expected_out, **tolerance)
    assert len(grads) == len(expected_grads)
    for a, e in zip(grads, expected_grads):
        torch.testing.assert_close(a, e, **tolerance)


@pytest.fixture(autouse=True)
def quiet_deprecations():
    # torch.jit is deprecated in favour of torch.export, but still what C++ deployments load.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


@pytest.mark.parametrize("cls,n_inputs", MODULES, ids=lambda v: getattr(v, "__name__", ""))
@pytest.mark.parametrize("mode", ["script", "trace"])
def test_torchscript_round_trip(cls, n_inputs, mode):
    module = make_module(cls)
    inputs = module_inputs(n_inputs)
    expected = outputs_and_grads(module, inputs)
    compiled = (torch.jit.script(module) if mode == "script"
                else torch.jit.trace(module, tuple(inputs)))
    buffer = io.BytesIO()
    torch.jit.save(compiled, buffer)
    buffer.seek(0)
    loaded = torch.jit.load(buffer)
    assert_same(outputs_and_grads(loaded, inputs), expected)


def deform_conv2d_in_user_code(x: torch.Tensor, offset: torch.Tensor, weight: torch.Tensor,
                               bias: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # Every form of the geometry arguments TorchScript can pass: an int, a tuple, a list;
    # positional and keyword; v2 then v1; im2col_step given and left out.
    v2 = deformconv.deform_conv2d(x, offset, weight, bias, 1, (1, 1), [1, 1], mask, 1)
    v1 = deformconv.deform_conv2d(x, offset, weight, padding=1)
    return v2 + v1


def test_torchscript_scripts_a_function_calling_deform_conv2d():
    geometry = GEOMETRIES[1]  # 3x3, padding 1
    x, o, w, b, m = make_operands(geometry)
    scripted = torch.jit.script(deform_conv2d_in_user_code)
    buffer = io.BytesIO()
    torch.jit.save(scripted, buffer)
    buffer.seek(0)
    loaded = torch.jit.load(buffer)
    expected = deform_conv2d_in_user_code(x, o, w, b, m)
    torch.testing.assert_close(scripted(x, o, w, b, m), expected, rtol=0, atol=0)
    torch.testing.assert_close(loaded(x, o, w, b, m), expected, rtol=0, atol=0)


def test_torchscript_rejects_a_pair_of_the_wrong_length():
    @torch.jit.script
    def three_strides(x: torch.Tensor, offset: torch.Tensor, weight: torch.Tensor):
        return deformconv.deform_conv2d(x, offset, weight, stride=[1, 1, 1])

    x, o, w, _, _ = make_operands(GEOMETRIES[0])
    with pytest.raises(torch.jit.Error, match="expected stride to be an int or a pair"):
        three_strides(x, o, w)


@pytest.mark.parametrize("with_mask", [False, True])
def test_double_backward_is_refused_by_name(with_mask):
    geometry = GEOMETRIES[1]
    x, o, w, b, m = make_operands(geometry, with_mask=with_mask)
    leaves = [t.requires_grad_() for t in (x, o, w, b, m) if t is not None]
    out = deformconv.deform_conv2d(x, o, w, b, 1, 1, 1, m)
    # create_graph=True alone is fine: the first-order gradients are the usual ones.
    first = torch.autograd.grad(out.pow(2).sum(), leaves, create_graph=True)
    usual = torch.autograd.grad(deformconv.deform_conv2d(x, o, w, b, 1, 1, 1, m).pow(2).sum(),
                                leaves)
    for with_graph, without in zip(first, usual):
        torch.testing.assert_close(with_graph, without, rtol=0, atol=0)
    # Differentiating them again is what is not supported.
    with pytest.raises(NotImplementedError,
                       match="deform_conv2d: double backward is not supported"):
        torch.autograd.grad(sum(g.sum() for g in first), leaves)


def opcheck_samples():
    geometry = GEOMETRIES[2]
    for with_mask in (False, True):
        for with_bias in (False, True):
            for requires_grad in (False, True):
                x, o, w, b, m = make_operands(geometry, with_mask=with_mask,
                                              with_bias=with_bias)
                tensors = [t if t is None else t.requires_grad_(requires_grad)
                           for t in (x, o, w, m, b)]
                yield (*tensors, list(geometry.stride), list(geometry.padding),
                       list(geometry.dilation), geometry.groups, geometry.offset_groups, 1)


@pytest.mark.parametrize("args", list(opcheck_samples()))
def test_opcheck_forward(args):
    torch.library.opcheck(torch.ops.deformconv.deform_conv2d.default, args)


@pytest.mark.parametrize("output_mask", [[True] * 5, [True, False, True, False, False],
                                         [False, True, False, True, True]])
@pytest.mark.parametrize("with_mask", [False, True])
def test_opcheck_backward(output_mask, with_mask):
    geometry = GEOMETRIES[2]
    x, o, w, _, m = make_operands(geometry, with_mask=with_mask)
    grad_output = torch.randn(geometry.batch, geometry.out_channels, *geometry.output_size(),
                              dtype=torch.float64)
    torch.library.opcheck(
        torch.ops.deformconv.deform_conv2d_backward.default,
        (grad_output, x, o, w, m, list(geometry.stride), list(geometry.padding),
         list(geometry.dilation), geometry.groups, geometry.offset_groups, 0, output_mask))


def test_opcheck_backward_strided_operands():
    # The gradients' memory formats must be what the fake kernel says: grad_input and
    # grad_weight keep the (channels-last) format of input and weight, grad_offset and
    # grad_mask are contiguous whatever the offset and mask strides.
    geometry = GEOMETRIES[2]
    x, o, w, _, m = make_operands(geometry)
    grad_output = torch.randn(geometry.batch, geometry.out_channels, *geometry.output_size(),
                              dtype=torch.float64)
    args = (grad_output, x.to(memory_format=torch.channels_last),
            o.transpose(2, 3).contiguous().transpose(2, 3),
            w.to(memory_format=torch.channels_last),
            m.transpose(2, 3).contiguous().transpose(2, 3),
            list(geometry.stride), list(geometry.padding), list(geometry.dilation),
            geometry.groups, geometry.offset_groups, 0, [True] * 5)
    torch.library.opcheck(torch.ops.deformconv.deform_conv2d_backward.default, args)
    grad_input, grad_offset, grad_weight, grad_mask, _ = (
        torch.ops.deformconv.deform_conv2d_backward(*args))
    assert grad_input.is_contiguous(memory_format=torch.channels_last)
    assert grad_weight.is_contiguous(memory_format=torch.channels_last)
    assert grad_offset.is_contiguous() and grad_mask.is_contiguous()


@pytest.mark.parametrize("cls,n_inputs", MODULES, ids=lambda v: getattr(v, "__name__", ""))
def test_torch_compile_fullgraph_dynamic(cls, n_inputs):
    torch._dynamo.reset()
    module = make_module(cls)
    compiled = torch.compile(module, fullgraph=True, dynamic=True)
    for batch, height, width in ((2, 7, 6), (3, 5, 8)):  # a second shape: no recompile needed
        inputs = module_inputs(n_inputs, batch, height, width)
        assert_same(outputs_and_grads(compiled, inputs), outputs_and_grads(module, inputs))


@pytest.mark.parametrize("cls,n_inputs", MODULES, ids=lambda v: getattr(v, "__name__", ""))
def test_torch_export(cls, n_inputs):
    module = make_module(cls)
    inputs = module_inputs(n_inputs)
    program = torch.export.export(module, tuple(inputs))
    targets = [node.target for node in program.graph.nodes if node.op == "call_function"]
    assert torch.ops.deformconv.deform_conv2d.default in targets
    torch.testing.assert_close(program.module()(*inputs), module(*inputs))


@pytest.mark.parametrize("dynamo", EXPORTERS)
def test_onnx_export_to_standard_deform_conv(tmp_path, dynamo):
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    from onnx.reference import ReferenceEvaluator

    import deformconv.onnx

    model = TwoLayerNet().eval()
    x = torch.randn(2, 4, 9, 8)
    path = tmp_path / "model.onnx"
    deformconv.onnx.export_onnx(model, (x,), str(path), dynamo=dynamo)

    proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    deform_nodes = [node for node in proto.graph.node if node.op_type == "DeformConv"]
    assert len(deform_nodes) == 2 and all(node.domain == "" for node in deform_nodes)
    assert any(o.domain == "" and o.version >= 19 for o in proto.opset_import)

    expected = model(x).detach().numpy()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    from_ort = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    from_reference = ReferenceEvaluator(proto).run(None, {proto.graph.input[0].name: x.numpy()})[0]
    torch.testing.assert_close(torch.from_numpy(from_ort), torch.from_numpy(expected),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.from_numpy(from_reference), torch.from_numpy(expected),
                               atol=1e-5, rtol=1e-5)


def test_onnx_export_rejects_old_opsets():
    import deformconv.onnx

    with pytest.raises(ValueError, match="opset_version >= 19"):
        deformconv.onnx.export_onnx(TwoLayerNet(), (torch.randn(1, 4, 5, 5),), "unused.onnx",
                                    opset_version=18)


def test_cpu_autocast_computes_in_float32():
    geometry = GEOMETRIES[1]
    x, o, w, b, m = make_operands(geometry, dtype=torch.float32)
    expected = deformconv.deform_conv2d(x, o, w, b, 1, 1, 1, m)
    leaves = [t.bfloat16().requires_grad_() for t in (x, o, w, b, m)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = deformconv.deform_conv2d(leaves[0], leaves[1], leaves[2], leaves[3], 1, 1, 1,
                                       leaves[4])
    assert out.dtype == torch.float32
    # The same float32 computation on the bfloat16-rounded operands.
    rounded = [t.detach().float() for t in leaves]
    torch.testing.assert_close(out, deformconv.deform_conv2d(*rounded[:4], 1, 1, 1, rounded[4]))
    assert (out - expected).abs().max() < 0.1 * expected.abs().max()
    out.sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 for t in leaves)


def test_cpu_is_bitwise_deterministic():
    geometry = GEOMETRIES[4]
    operands = make_operands(geometry, dtype=torch.float32, batch=5)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = []
        for _ in range(3):
            leaves = [t.detach().clone().requires_grad_() for t in operands]
            x, o, w, b, m = leaves
            out = deformconv.deform_conv2d(x, o, w, b, geometry.stride, geometry.padding,
                                           geometry.dilation, m, im2col_step=2)
            out.pow(2).sum().backward()
            runs.append([out.detach()] + [t.grad for t in leaves])
    finally:
        torch.use_deterministic_algorithms(previous)
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run, runs[0]))


@pytest.mark.parametrize("op", ["dcnv3", "dcnv4"])
def test_cpu_autocast_runs_dcnv3_and_dcnv4_in_float32(op):
    # Operands of mixed dtypes, as autocast makes them (a bfloat16 projection's offsets, a
    # float32 softmax's mask): outside autocast the op refuses them, under it it runs in float32.
    from dcnv3_reference import pack_offset_mask, random_operands
    geometry = ((3, 3), (1, 1), (1, 1), (1, 1), 2, 8)
    input, offset, mask = [t.float() for t in random_operands(2, 5, 6, geometry)]
    tail = (3, 3, 1, 1, 1, 1, 1, 1, 2, 8, 1.0, 0, False)
    if op == "dcnv3":
        operands = [input.bfloat16(), offset.bfloat16(), mask]
    else:
        operands = [input.bfloat16(), pack_offset_mask(offset, mask, 2, padding_value=0.0)]
    function = getattr(deformconv, op)
    with pytest.raises(ValueError, match="to have the dtype of input"):
        function(*operands, *tail)
    leaves = [t.clone().requires_grad_() for t in operands]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = function(*leaves, *tail)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, function(*[t.detach().float() for t in leaves], *tail))
    out.sum().backward()
    assert [t.grad.dtype for t in leaves] == [t.dtype for t in operands]


def test_dcnv3_module_trains_under_cpu_autocast():
    module = deformconv.DCNv3(16, group=2)
    x = torch.randn(2, 6, 7, 16)
    expected = module(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = module(x)
    assert (out.float() - expected).abs().max() < 0.05 * expected.abs().max()
    out.float().sum().backward()
    assert all(p.grad is not None for p in module.parameters())
