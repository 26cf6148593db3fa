"""Every op in the inference runtimes that read core ATen graphs or ONNX, in float32 at two
shapes per op, against eager PyTorch: each op's decomposition (deformconv.decompositions)
leaves no deformconv node in an exported program; OpenVINO converts that program, and reads
the ONNX exports of every op, DCN v1/v2 in standard operators, as ONNX Runtime does;
ExecuTorch's portable runtime runs the program lowered to a .pte; ONNX Runtime runs DCN v1/v2's
two forms with dynamic sizes.
The tolerance is 1e-5 of the output's largest magnitude. And DCN v1/v2's form against the op
in float64 over the geometry grid and on the border (the other ops' forms: test_dcnv3_onnx.py,
test_ms_deform_attn_onnx.py)."""

import functools

import pytest
import torch

import deformconv
import deformconv.onnx
from dcnv3_reference import pack_offset_mask, random_operands
from deform_conv2d_cases import GEOMETRIES, make_operands
from export_models import EXPORTERS, Dcnv4Op, TwoLayerNet
from ms_deform_attn_reference import levels_of
from ms_deform_attn_reference import make_operands as attention_operands

pytestmark = pytest.mark.workflows

# Multi-scale deformable attention also in the forms of today's detectors: D-FINE's points per
# level with the softmax in the op, and nearest sampling (RT-DETRv2's method="discrete").
MSDA_VARIANTS = {"ms_deform_attn": {},
                 "ms_deform_attn-softmax-per-level": dict(points_per_level=[3, 6, 3],
                                                          softmax=True),
                 "ms_deform_attn-nearest": dict(points_per_level=[2, 1, 3], sampling="nearest")}
OPS = ["deform_conv2d", "dcnv3", "dcnv4", *MSDA_VARIANTS]
SHAPES = [0, 1]


class MsDeformAttnOp(torch.nn.Module):
    """The op over levels of fixed sizes, which the graph holds as constants, with the
    variant's options."""

    def __init__(self, levels, options):
        super().__init__()
        spatial_shapes, level_start_index, _ = levels_of(levels)
        self.register_buffer("spatial_shapes", spatial_shapes)
        self.register_buffer("level_start_index", level_start_index)
        self.options = options

    def forward(self, value, locations, weights):
        return deformconv.ms_deform_attn(value, self.spatial_shapes, self.level_start_index,
                                         locations, weights, **self.options)


def case(op, shape):
    """(model, args) of `op` at its shape number `shape`, float32, with random parameters so
    that the samples fall away from the initial zero offsets."""
    generator = torch.Generator().manual_seed(shape)
    if op == "deform_conv2d":
        model = TwoLayerNet()
        args = (torch.randn((2, 4, 9, 8) if shape == 0 else (1, 4, 12, 11), generator=generator),)
    elif op == "dcnv3":
        model = deformconv.DCNv3(32, group=4, center_feature_scale=True, offset_scale=0.5)
        args = (torch.randn((2, 5, 6, 32) if shape == 0 else (1, 8, 7, 32), generator=generator),)
    elif op == "dcnv4":
        model = Dcnv4Op()
        geometry = ((2, 3), (2, 1), (1, 2), (2, 1), 1, 2)  # as Dcnv4Op calls the op
        height, width = (5, 6) if shape == 0 else (9, 7)
        input, offset, mask = random_operands(2, height, width, geometry, True,
                                              dtype=torch.float32)
        args = (input, pack_offset_mask(offset, mask, 1, padding_value=0.0))
    else:
        options = MSDA_VARIANTS[op]
        levels = [(6, 5), (3, 3)] if shape == 0 and not options else [(8, 7), (4, 4), (2, 2)]
        model = MsDeformAttnOp(levels, options)
        value, _, _, locations, weights = attention_operands(
            levels, queries=7 + shape, heads=2, channels=4, points=3, spread=3.0,
            dtype=torch.float32, points_per_level=options.get("points_per_level"))
        args = (value, locations, weights)
    torch.manual_seed(1)
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    return model.eval(), args


def assert_close_to_eager(actual, model, args):
    expected = model(*args).detach()
    actual = torch.as_tensor(actual)
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=1e-5,
                               atol=1e-5 * expected.abs().max().item())


@functools.lru_cache(maxsize=None)
def decomposed_case(op, shape, sampling_form="grid_sample"):
    """(model, args, program): case(op, shape) and its exported program decomposed with
    deformconv's table in sampling_form, made once for the tests that read it."""
    model, args = case(op, shape)
    program = torch.export.export(model, args)
    return model, args, program.run_decompositions(
        deformconv.decompositions.table(sampling_form))


SAMPLING_FORMS = deformconv.decompositions.SAMPLING_FORMS


@pytest.mark.parametrize("sampling_form", SAMPLING_FORMS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("op", OPS)
def test_decomposition_leaves_no_deformconv_node(op, shape, sampling_form):
    """No deformconv node; grid_sampler_2d only in the grid_sample form, where the variant
    samples bilinearly (nearest gathers in both)."""
    model, args, program = decomposed_case(op, shape, sampling_form)
    targets = [str(node.target) for node in program.graph.nodes if node.op == "call_function"]
    assert not [target for target in targets if "deformconv" in target]
    bilinear = MSDA_VARIANTS.get(op, {}).get("sampling") != "nearest"
    sampled = "aten.grid_sampler_2d.default" in targets
    assert sampled == (bilinear and sampling_form == "grid_sample"), targets
    if sampling_form == "gather" or not bilinear:
        assert "aten.gather.default" in targets, targets
    assert_close_to_eager(program.module()(*args), model, args)


def test_an_unknown_sampling_form_is_refused_by_name():
    with pytest.raises(ValueError, match="expected sampling_form to be one of "
                                         r"\('grid_sample', 'gather'\), but got 'bicubic'"):
        deformconv.decompositions.table("bicubic")


def openvino_in_float32(model):
    ov = pytest.importorskip("openvino")
    # OpenVINO's CPU plugin computes in bfloat16 where the CPU has it, unless told otherwise.
    return ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})


@pytest.mark.parametrize("sampling_form", SAMPLING_FORMS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("op", OPS)
def test_openvino_converts_the_decomposed_program(op, shape, sampling_form):
    ov = pytest.importorskip("openvino")
    model, args, program = decomposed_case(op, shape, sampling_form)
    compiled = openvino_in_float32(ov.convert_model(program))
    assert_close_to_eager(compiled([a.numpy() for a in args])[0], model, args)


@pytest.mark.parametrize("sampling_form", SAMPLING_FORMS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("op", OPS)
def test_onnx_runtime_and_openvino_run_the_onnx_export(tmp_path, op, shape, sampling_form):
    ov = pytest.importorskip("openvino")
    ort = pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    model, args = case(op, shape)
    path = tmp_path / "model.onnx"
    deformconv.onnx.export_onnx(model, args, str(path), deform_conv2d_form="standard",
                                sampling_form=sampling_form)
    nodes = {node.op_type for node in onnx.load(str(path)).graph.node}
    bilinear = MSDA_VARIANTS.get(op, {}).get("sampling") != "nearest"
    assert ("GridSample" in nodes) == (bilinear and sampling_form == "grid_sample"), nodes
    feeds = [a.numpy() for a in args]
    compiled = openvino_in_float32(ov.Core().read_model(str(path)))
    assert_close_to_eager(compiled(feeds)[0], model, args)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    assert_close_to_eager(session.run(None, dict(zip(names, feeds)))[0], model, args)


# ExecuTorch plans its memory from static sizes; multi-scale deformable attention's levels are
# data of the graph (spatial_shapes), sizes unknown until it runs, which its planning refuses.
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("op", ["deform_conv2d", "dcnv3", "dcnv4"])
def test_executorch_runs_the_decomposed_program(op, shape):
    exir = pytest.importorskip("executorch.exir")
    runtime = pytest.importorskip("executorch.runtime")
    model, args, program = decomposed_case(op, shape)
    lowered = exir.to_edge(program).to_executorch()
    method = runtime.Runtime.get().load_program(lowered.buffer).load_method("forward")
    assert_close_to_eager(method.execute(list(args))[0], model, args)


@pytest.mark.parametrize("dynamo", EXPORTERS)
@pytest.mark.parametrize("form", deformconv.onnx.DEFORM_CONV2D_FORMS)
def test_deform_conv2d_in_both_forms_runs_in_onnxruntime(tmp_path, form, dynamo):
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    model, args = case("deform_conv2d", 0)
    path = tmp_path / "model.onnx"
    # Batch and spatial sizes dynamic: one file for both shapes.
    if dynamo:
        batch, height, width = (torch.export.Dim(name) for name in ("batch", "height", "width"))
        sizes = dict(dynamic_shapes=({0: batch, 2: height, 3: width},))
    else:
        sizes = dict(input_names=["x"],
                     dynamic_axes={"x": {0: "batch", 2: "height", 3: "width"}})
    deformconv.onnx.export_onnx(model, args, str(path), dynamo=dynamo,
                                deform_conv2d_form=form, **sizes)
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    operators = {node.op_type for node in proto.graph.node}
    if form == "DeformConv":
        assert "DeformConv" in operators and "GridSample" not in operators
    else:
        assert "DeformConv" not in operators and "GridSample" in operators
    assert all(node.domain == "" for node in proto.graph.node)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for shape in SHAPES:
        _, args = case("deform_conv2d", shape)
        output = session.run(None, {session.get_inputs()[0].name: args[0].numpy()})[0]
        assert_close_to_eager(output, model, args)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_deform_conv2d_in_standard_operators_keeps_the_dtype(tmp_path, dtype):
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")

    class Op(torch.nn.Module):
        def forward(self, input, offset, weight, mask, bias):
            return deformconv.deform_conv2d(input, offset, weight, bias, (2, 1), (1, 0), (1, 2),
                                            mask)

    generator = torch.Generator().manual_seed(0)
    input = torch.randn(2, 6, 9, 8, generator=generator)
    offset = 2 * torch.randn(2, 2 * 3 * 6, 5, 4, generator=generator)
    args = [t.to(dtype) for t in (input, offset, torch.randn(4, 3, 2, 3, generator=generator),
                                  torch.rand(2, 3 * 6, 5, 4, generator=generator),
                                  torch.randn(4, generator=generator))]
    path = tmp_path / "model.onnx"
    deformconv.onnx.export_onnx(Op().eval(), tuple(args), str(path), deform_conv2d_form="standard")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    output = session.run(None, {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)})[0]
    assert output.dtype == args[0].numpy().dtype
    # The form samples and sums half-precision operands in float32, as the op does.
    expected = Op()(*args).float()
    torch.testing.assert_close(torch.from_numpy(output).float(), expected, rtol=0,
                               atol=(1e-5 if dtype == torch.float32 else 2e-3)
                               * expected.abs().max().item())


@pytest.mark.parametrize("form,opset,message", [
    ("DeformConv", 18, "ONNX DeformConv needs opset_version >= 19, but got 18; "
                       "deform_conv2d_form='standard' writes deform_conv2d from opset 16 on"),
    ("standard", 15, "need GridSample, opset_version >= 16, but got 15"),
    ("gather", 19, "deform_conv2d_form must be one of"),
])
def test_export_refuses_what_a_form_cannot_write(form, opset, message):
    model, args = case("deform_conv2d", 0)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        deformconv.onnx.export_onnx(model, args, "unused.onnx", opset_version=opset,
                                    deform_conv2d_form=form)


def test_export_refuses_an_unknown_sampling_form():
    model, args = case("dcnv3", 0)
    with pytest.raises(ValueError, match=r"export_onnx\(\): sampling_form must be one of "
                                         r"\('grid_sample', 'gather'\), but got 'bicubic'"):
        deformconv.onnx.export_onnx(model, args, "unused.onnx", sampling_form="bicubic")


def assert_form_matches_the_op(geometry, x, o, w, b, m, sampling_form):
    g = geometry
    form = deformconv.decompositions.deform_conv2d(x, o, w, m, b, list(g.stride),
                                                   list(g.padding), list(g.dilation), g.groups,
                                                   g.offset_groups, sampling_form=sampling_form)
    expected = deformconv.deform_conv2d(x, o, w, b, g.stride, g.padding, g.dilation, m)
    torch.testing.assert_close(form, expected, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("sampling_form", SAMPLING_FORMS)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
@pytest.mark.parametrize("with_mask", [True, False], ids=["v2", "v1"])
def test_deform_conv2d_form_matches_the_op(geometry, with_mask, sampling_form):
    # Offsets of 3 pixels: many samples near or past the border.
    x, o, w, b, m = make_operands(geometry, with_mask=with_mask, offset_scale=3.0)
    assert_form_matches_the_op(geometry, x, o, w, b, m, sampling_form)


@pytest.mark.parametrize("sampling_form", SAMPLING_FORMS)
def test_deform_conv2d_form_on_the_border(sampling_form):
    # Offsets of whole and half pixels from -3 to 3: every sample on a pixel or half-way
    # between two, many on, beside and past the border, where grid_sample's zero padding and
    # the op's zero-outside convention meet.
    geometry = GEOMETRIES[1]
    x, o, w, b, m = make_operands(geometry)
    steps = torch.arange(-6, 7, dtype=torch.float64) / 2
    o = steps[torch.randint(0, len(steps), o.shape, generator=torch.Generator().manual_seed(0))]
    assert_form_matches_the_op(geometry, x, o, w, b, m, sampling_form)
