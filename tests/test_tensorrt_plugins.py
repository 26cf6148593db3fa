"""The TensorRT plugin nodes of the ONNX export (export_onnx(..., tensorrt_plugins=...)). TensorRT
does not run here: each exported graph is checked against the plugin's published interface
(TensorRT's MultiscaleDeformableAttnPlugin_TRT README and sources, InternImage's TRTDCNv3
plugin: inputs in order, ranks, dtypes, attributes, the output's shape), and then run end to end
by ONNX's reference evaluator, with each plugin node computed by the readable references of
the tests, against the op in eager mode."""

import numpy as np
import pytest
import torch

import deformconv
import deformconv.onnx
from dcnv3_reference import GEOMETRIES, dcnv3_reference, output_length, random_operands
from export_models import EXPORTERS
from ms_deform_attn_reference import levels_of, make_operands, ms_deform_attn_reference

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxscript")
from onnx.reference import ReferenceEvaluator  # noqa: E402
from onnx.reference.op_run import OpRun  # noqa: E402

pytestmark = pytest.mark.workflows

FLOAT, INT32 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT32


class MultiscaleDeformableAttnPlugin_TRT(OpRun):
    """The plugin's computation: (N, S, M, D) value, int32 levels, (N, Lq, M, L, P, 2)
    locations and (N, Lq, M, L, P) weights give (N, Lq, M, D)."""
    op_domain = "trt"

    def _run(self, value, spatial_shapes, level_start_index, sampling_locations,
             attention_weights, plugin_version=None):
        assert spatial_shapes.dtype == level_start_index.dtype == np.int32
        N, _, M, D = value.shape
        out = ms_deform_attn_reference(
            *(torch.from_numpy(array) for array in (value, spatial_shapes.astype(np.int64),
                                                    level_start_index.astype(np.int64),
                                                    sampling_locations, attention_weights)))
        return (out.reshape(N, -1, M, D).numpy(),)


class TRTDCNv3(OpRun):
    """InternImage's plugin: the op's channels-last operands and its attributes."""
    op_domain = "mmdeploy"

    def _run(self, input, offset, mask, kernel_h=None, kernel_w=None, stride_h=None,
             stride_w=None, pad_h=None, pad_w=None, dilation_h=None, dilation_w=None,
             group=None, group_channels=None, offset_scale=None, im2col_step=None):
        out = dcnv3_reference(torch.from_numpy(input), torch.from_numpy(offset),
                              torch.from_numpy(mask), kernel_h, kernel_w, stride_h, stride_w,
                              pad_h, pad_w, dilation_h, dilation_w, group, group_channels,
                              offset_scale)
        return (out.numpy(),)


def export(model, args, path, dynamo, plugins, **kwargs):
    deformconv.onnx.export_onnx(model, tuple(args), str(path), dynamo=dynamo,
                                tensorrt_plugins=plugins,
                                input_names=[f"input{i}" for i in range(len(args))], **kwargs)
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    return onnx.shape_inference.infer_shapes(proto, strict_mode=True)


def tensor_types(proto):
    """Each value's (element type, shape) in the graph, the shape's symbols as None."""
    def described(value_info):
        tensor = value_info.type.tensor_type
        return tensor.elem_type, [d.dim_value if d.HasField("dim_value") else None
                                  for d in tensor.shape.dim]
    return {v.name: described(v)
            for v in [*proto.graph.input, *proto.graph.value_info, *proto.graph.output]}


def plugin_nodes(proto, op_type):
    nodes = [node for node in proto.graph.node if node.op_type == op_type]
    assert not any(node.op_type in ("GridSample", "GatherElements")
                   for node in proto.graph.node)
    return nodes


def run_in_reference_evaluator(proto, args):
    evaluator = ReferenceEvaluator(proto, new_ops=[MultiscaleDeformableAttnPlugin_TRT, TRTDCNv3])
    feeds = {i.name: args[int(i.name[len("input"):])].numpy() for i in proto.graph.input}
    return torch.from_numpy(evaluator.run(None, feeds)[0])


def assert_matches_eager(proto, model, args):
    expected = model(*args).detach()
    assert expected.abs().max() > 0.1
    torch.testing.assert_close(run_in_reference_evaluator(proto, args), expected, rtol=1e-5,
                               atol=1e-5 * expected.abs().max().item())


class MsDeformAttnOp(torch.nn.Module):
    def __init__(self, **options):
        super().__init__()
        self.options = options

    def forward(self, value, spatial_shapes, level_start_index, locations, weights):
        return deformconv.ms_deform_attn(value, spatial_shapes, level_start_index, locations,
                                         weights, **self.options)


class FlashDeformAttnOp(torch.nn.Module):
    def forward(self, value, spatial_shapes, level_start_index, packed):
        return deformconv.flash_deform_attn(value, spatial_shapes, level_start_index, packed,
                                            64, 2)


LEVELS = [(6, 5), (3, 3), (2, 1), (1, 1)]
OTHER_LEVELS = [(4, 7), (2, 2)]


def ms_deform_attn_case(case):
    """(model, args, levels, the plugin's points per level)."""
    levels = OTHER_LEVELS if case == "op-other-shape" else LEVELS
    spatial_shapes, level_start_index, S = levels_of(levels)
    generator = torch.Generator().manual_seed(3)
    if case == "MSDeformAttn":
        model = deformconv.MSDeformAttn(d_model=16, n_levels=len(levels), n_heads=2, n_points=3)
        torch.manual_seed(1)
        for parameter in model.parameters():
            torch.nn.init.normal_(parameter, std=0.3)
        args = (torch.randn(2, 7, 16, generator=generator),
                torch.rand(2, 7, len(levels), 2, generator=generator),
                torch.randn(2, S, 16, generator=generator), spatial_shapes, level_start_index)
        return model.eval(), args, len(levels), 3
    if case == "flash_deform_attn":
        value, *_ = make_operands(levels, heads=2, channels=4, dtype=torch.float32)
        packed = torch.rand(2, 5, 2, 3 * len(levels) * 2, generator=generator) * 1.4 - 0.2
        return (FlashDeformAttnOp().eval(), (value, spatial_shapes, level_start_index, packed),
                len(levels), 2)
    options, points, most = {}, 3, 3
    if case.startswith("points_per_level"):
        per_level = [3, 3, 3, 3] if case.endswith("equal") else [2, 4, 1, 3]
        options, points, most = dict(points_per_level=per_level), None, max(per_level)
    operands = make_operands(levels, queries=6, heads=2, channels=3, points=points,
                             spread=3.0, dtype=torch.float32,
                             points_per_level=options.get("points_per_level"))
    return MsDeformAttnOp(**options).eval(), operands, len(levels), most


# The TorchScript tracer warns at flash_deform_attn's check of the packed operand's width, a
# shape it records as a constant anyway.
@pytest.mark.filterwarnings("ignore:Converting a tensor to a Python boolean"
                            ":torch.jit.TracerWarning")
@pytest.mark.parametrize("dynamo", EXPORTERS)
@pytest.mark.parametrize("case", ["op", "op-other-shape", "MSDeformAttn",
                                  "points_per_level-equal", "points_per_level-unequal",
                                  "flash_deform_attn"])
def test_ms_deform_attn_plugin_node(tmp_path, dynamo, case):
    model, args, L, points = ms_deform_attn_case(case)
    proto = export(model, args, tmp_path / "model.onnx", dynamo, ("ms_deform_attn",))
    assert ("trt", 1) in [(o.domain, o.version) for o in proto.opset_import]
    [node] = plugin_nodes(proto, "MultiscaleDeformableAttnPlugin_TRT")
    assert node.domain == "trt"
    assert {a.name: a.s for a in node.attribute} == {"plugin_version": b"2"}

    # The interface of TensorRT's README: value (N, S, M, D), spatial_shapes (L, 2) and
    # level_start_index (L,) int32, sampling_locations (N, Lq, M, L, P, 2), attention_weights
    # (N, Lq, M, L, P), all floating ones of one type; the output (N, Lq, M, D).
    types = tensor_types(proto)
    (value_type, value), (shapes_type, shapes), (starts_type, starts), \
        (locations_type, locations), (weights_type, weights) = \
        [types[name] for name in node.input]
    N, S, M, D = value
    expected = model(*args)
    Lq = expected.shape[1]
    assert [N, M * D] == [expected.shape[0], expected.shape[2]]
    assert (shapes_type, shapes, starts_type, starts) == (INT32, [L, 2], INT32, [L])
    assert locations == [N, Lq, M, L, points, 2] and weights == [N, Lq, M, L, points]
    assert value_type == locations_type == weights_type == FLOAT
    assert types[node.output[0]] == (FLOAT, [N, Lq, M, D])
    assert_matches_eager(proto, model, args)


def test_ms_deform_attn_plugin_is_asked_for_by_name(tmp_path):
    # One op name as a string, as tensorrt_plugins=("ms_deform_attn",).
    model, args, _, _ = ms_deform_attn_case("op")
    proto = export(model, args, tmp_path / "model.onnx", True, "ms_deform_attn")
    assert len(plugin_nodes(proto, "MultiscaleDeformableAttnPlugin_TRT")) == 1


class Dcnv3Op(torch.nn.Module):
    def __init__(self, geometry):
        super().__init__()
        self.geometry = geometry

    def forward(self, input, offset, mask):
        (kh, kw), (sh, sw), (ph, pw), (dh, dw), G, D = self.geometry
        return deformconv.dcnv3(input, offset, mask, kh, kw, sh, sw, ph, pw, dh, dw, G, D, 0.5,
                                64)


def dcnv3_case(case):
    """(model, args, the node's attributes)."""
    if case == "DCNv3":
        torch.manual_seed(0)
        model = deformconv.DCNv3(32, group=4, center_feature_scale=True, offset_scale=0.5)
        for parameter in model.parameters():
            torch.nn.init.normal_(parameter, std=0.3)
        attributes = dict(kernel_h=3, kernel_w=3, stride_h=1, stride_w=1, pad_h=1, pad_w=1,
                          dilation_h=1, dilation_w=1, group=4, group_channels=8)
        return model.eval(), (torch.randn(2, 5, 6, 32),), attributes, 0.5
    # Non-square kernel, stride 2, unequal padding, dilation (GEOMETRIES[2]), several groups.
    geometry = GEOMETRIES[2][:4] + (3, 2)
    (kh, kw), (sh, sw), (ph, pw), (dh, dw), G, D = geometry
    attributes = dict(kernel_h=kh, kernel_w=kw, stride_h=sh, stride_w=sw, pad_h=ph, pad_w=pw,
                      dilation_h=dh, dilation_w=dw, group=G, group_channels=D)
    return (Dcnv3Op(geometry).eval(), random_operands(3, 7, 5, geometry, dtype=torch.float32,
                                               spread=3.0), attributes, 0.5)


@pytest.mark.parametrize("dynamo", EXPORTERS)
@pytest.mark.parametrize("case", ["DCNv3", "op"])
def test_dcnv3_plugin_node(tmp_path, dynamo, case):
    model, args, attributes, offset_scale = dcnv3_case(case)
    proto = export(model, args, tmp_path / "model.onnx", dynamo, ("dcnv3",))
    assert ("mmdeploy", 1) in [(o.domain, o.version) for o in proto.opset_import]
    [node] = plugin_nodes(proto, "TRTDCNv3")
    assert node.domain == "mmdeploy"
    written = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    # im2col_step 1: InternImage's plugin drops the images past a multiple of it.
    assert written == dict(attributes, im2col_step=1,
                           offset_scale=pytest.approx(offset_scale))

    # InternImage's interface: input (N, H, W, C), offset (N, Ho, Wo, G * P * 2), mask
    # (N, Ho, Wo, G * P), float32; output (N, Ho, Wo, G * group_channels).
    types = tensor_types(proto)
    (input_type, (N, H, W, _)), (offset_type, offset), (mask_type, mask) = \
        [types[name] for name in node.input]
    Ho = output_length(H, attributes["kernel_h"], attributes["stride_h"], attributes["pad_h"],
                       attributes["dilation_h"])
    Wo = output_length(W, attributes["kernel_w"], attributes["stride_w"], attributes["pad_w"],
                       attributes["dilation_w"])
    G, P = attributes["group"], attributes["kernel_h"] * attributes["kernel_w"]
    assert offset == [N, Ho, Wo, G * P * 2] and mask == [N, Ho, Wo, G * P]
    assert input_type == offset_type == mask_type == FLOAT
    assert types[node.output[0]] == (FLOAT, [N, Ho, Wo, G * attributes["group_channels"]])
    assert_matches_eager(proto, model, args)


class DirectOpCall(torch.nn.Module):
    """torch.ops.deformconv.ms_deform_attn called with the op's softmax, past the wrapper that
    writes it around the plugin."""

    def forward(self, value, spatial_shapes, level_start_index, locations, weights):
        return torch.ops.deformconv.ms_deform_attn(value, spatial_shapes, level_start_index,
                                                   locations, weights, 64, [], "bilinear", True)


@pytest.mark.parametrize("dynamo", EXPORTERS)
def test_a_variant_the_plugin_cannot_take_is_refused(tmp_path, dynamo):
    _, args, _, _ = ms_deform_attn_case("op")
    with pytest.raises(Exception, match="sampling='nearest'.*leave 'ms_deform_attn' out"):
        export(MsDeformAttnOp(sampling="nearest").eval(), args, tmp_path / "m.onnx", dynamo,
               ("ms_deform_attn",))
    with pytest.raises(Exception, match="with its default points_per_level and softmax only"):
        export(DirectOpCall().eval(), args, tmp_path / "m.onnx", dynamo, ("ms_deform_attn",))
    double = [t.double() if t.is_floating_point() else t for t in args]
    # The torch.export-based exporter reports the translation's ValueError inside its own.
    with pytest.raises(Exception, match="takes float32 or float16, but ms_deform_attn's value "
                                        "is float64"):
        export(MsDeformAttnOp().eval(), double, tmp_path / "m.onnx", dynamo, ("ms_deform_attn",))

    model, args, _, _ = dcnv3_case("op")
    with pytest.raises(Exception, match=r"takes float32, but dcnv3's input is float64 "
                                        r"\(InternImage's plugin\)"):
        export(model, [t.double() for t in args], tmp_path / "m.onnx", dynamo, ("dcnv3",))
    geometry = model.geometry
    input, offset, mask = random_operands(1, 5, 5, geometry, remove_center=True,
                                          dtype=torch.float32)

    class RemoveCenter(torch.nn.Module):
        def forward(self, input, offset, mask):
            (kh, kw), (sh, sw), (ph, pw), (dh, dw), G, D = geometry
            return deformconv.dcnv3(input, offset, mask, kh, kw, sh, sw, ph, pw, dh, dw, G, D,
                                    1.0, 0, True)

    with pytest.raises(Exception, match="has no remove_center, but dcnv3 got "
                                        "remove_center=True"):
        export(RemoveCenter().eval(), (input, offset, mask), tmp_path / "m.onnx", dynamo,
               ("dcnv3",))


@pytest.mark.parametrize("plugins,message", [
    (("dcnv4",), r"'dcnv4' has no TensorRT plugin node; the ops with one are "
                 r"\('ms_deform_attn', 'dcnv3'\)"),
    (("deform_conv2d",), "deform_conv2d needs no plugin node, TensorRT reads ONNX's DeformConv"),
    ("dcnv", "'dcnv' has no TensorRT plugin node"),
])
def test_an_op_without_a_plugin_is_refused(tmp_path, plugins, message):
    model, args, _, _ = ms_deform_attn_case("op")
    with pytest.raises(ValueError, match=message):
        export(model, args, tmp_path / "m.onnx", True, plugins)
    assert not (tmp_path / "m.onnx").exists()
