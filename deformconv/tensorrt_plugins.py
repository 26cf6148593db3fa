"""TensorRT plugin nodes for the ONNX export (``export_onnx(..., tensorrt_plugins=...)``).

TensorRT's ONNX parser imports a node whose type it has no importer for as the plugin of that
name from its registry (attribute ``plugin_version``, default "1"), whatever the node's domain.
Two ops have such a plugin with a published interface:

- ms_deform_attn: ``MultiscaleDeformableAttnPlugin_TRT``, TensorRT's own plugin (version 2,
  TensorRT 10.11 on; version 1 has the same inputs and outputs). Inputs value (N, S, M, D),
  spatial_shapes (L, 2) int32, level_start_index (L,) int32, sampling_locations
  (N, Lq, M, L, P, 2), attention_weights (N, Lq, M, L, P), float32 or float16 alike; output
  (N, Lq, M, D), no attributes. The export reshapes it to the op's (N, Lq, M * D).
- dcnv3: ``TRTDCNv3``, InternImage's plugin for mmdeploy's TensorRT backend, written as
  InternImage's own export writes it (domain ``mmdeploy``). Inputs input, offset, mask in the
  op's channels-last layout, float32 only; output (N, H_out, W_out, group * group_channels);
  integer attributes kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h,
  dilation_w, group, group_channels, im2col_step and the float offset_scale. It has no
  remove_center.

deform_conv2d needs no plugin node: TensorRT's parser reads ONNX's DeformConv (10.1 on), the
default ``deform_conv2d_form``. DCNv4 has no TensorRT plugin with a published interface.

What the plugins cannot take is written around them in standard operators where that is exact:
a softmax in the op (DCNv4's FlashDeformAttn) becomes a Softmax before the plugin, points per
level become every level's largest count, the extra points with weight zero.
"""

from typing import Any, Dict, List, Tuple

import torch
from torch import Tensor

# Each op's plugin node: (domain, node type).
PLUGIN_NODES: Dict[str, Tuple[str, str]] = {
    "ms_deform_attn": ("trt", "MultiscaleDeformableAttnPlugin_TRT"),
    "dcnv3": ("mmdeploy", "TRTDCNv3"),
}
MS_DEFORM_ATTN_PLUGIN_VERSION = "2"
# InternImage's plugin runs batch // im2col_step chunks of im2col_step images and drops the
# rest, so only 1 is right for every batch size an engine may see.
DCNV3_PLUGIN_IM2COL_STEP = 1
_DCNV3_INTEGER_ATTRIBUTES = ("kernel_h", "kernel_w", "stride_h", "stride_w", "pad_h", "pad_w",
                             "dilation_h", "dilation_w", "group", "group_channels")


def ms_deform_attn_plugin_operands(sampling_locations: Tensor, attention_weights: Tensor,
                                   levels: int, points_per_level: List[int],
                                   softmax: bool) -> Tuple[Tensor, Tensor]:
    """Bilinear ms_deform_attn's locations and weights in the plugin's (N, Lq, M, L, P, 2) and
    (N, Lq, M, L, P), the weights normalised where the op would have (softmax=True)."""
    if softmax:
        # Over each (query, head)'s samples, in float32 as the op computes it.
        flat = attention_weights.flatten(3)
        attention_weights = torch.softmax(flat.float(), dim=-1).to(flat.dtype).view(
            attention_weights.shape)
    if not points_per_level:
        return sampling_locations, attention_weights
    N, Lq, M = attention_weights.shape[:3]
    most = max(points_per_level)
    if all(points == most for points in points_per_level):
        return (sampling_locations.reshape(N, Lq, M, levels, most, 2),
                attention_weights.reshape(N, Lq, M, levels, most))
    locations, weights = [], []
    for level_locations, level_weights in zip(
            sampling_locations.split(points_per_level, dim=3),
            attention_weights.split(points_per_level, dim=3)):
        missing = most - level_weights.shape[3]
        # The extra points sit inside the level (a finite sample) and weigh nothing.
        locations.append(torch.nn.functional.pad(level_locations, (0, 0, 0, missing),
                                                 value=0.5))
        weights.append(torch.nn.functional.pad(level_weights, (0, missing), value=0.0))
    return torch.stack(locations, dim=3), torch.stack(weights, dim=3)


# The checks run where both exporters translate the op (the translation, the symbolic): the
# torch.export-based exporter retries a failed capture in other ways, so an error raised
# while the model runs would not reach the user.
def _check_floating_type(op: str, argument: str, onnx_type: int, allowed: Tuple[int, ...],
                         advice: str = "") -> None:
    import onnx

    if onnx_type not in allowed:
        def name(t):
            return onnx.helper.tensor_dtype_to_np_dtype(t).name
        raise ValueError(f"export_onnx(): {PLUGIN_NODES[op][1]} takes "
                         f"{' or '.join(name(t) for t in allowed)}, but {op}'s {argument} is "
                         f"{name(onnx_type)}{advice}")


def _check_ms_deform_attn_call(value_type: int, points_per_level, sampling: str,
                               softmax: bool) -> None:
    import onnx

    name = PLUGIN_NODES["ms_deform_attn"][1]
    if sampling != "bilinear":
        raise ValueError(f"export_onnx(): {name} samples bilinearly, but ms_deform_attn got "
                         f"sampling={sampling!r}; leave 'ms_deform_attn' out of "
                         f"tensorrt_plugins to export it in standard operators")
    # deformconv.ms_deform_attn writes these around the plugin; a direct torch.ops call with
    # them would be computed wrongly by it.
    if points_per_level or softmax:
        raise ValueError(f"export_onnx(): {name} takes torch.ops.deformconv.ms_deform_attn "
                         f"with its default points_per_level and softmax only; call "
                         f"deformconv.ms_deform_attn, which writes those around the plugin")
    _check_floating_type("ms_deform_attn", "value", value_type,
                         (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16))


def _check_dcnv3_call(input_type: int, remove_center: bool) -> None:
    import onnx

    _check_floating_type("dcnv3", "input", input_type, (onnx.TensorProto.FLOAT,),
                         " (InternImage's plugin); export the model in float32 (a TensorRT "
                         "fp16 engine keeps the plugin in float32)")
    if remove_center:
        raise ValueError(f"export_onnx(): {PLUGIN_NODES['dcnv3'][1]} has no remove_center, but "
                         f"dcnv3 got remove_center=True; leave 'dcnv3' out of "
                         f"tensorrt_plugins to export it in standard operators")


def _dcnv3_attributes(kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h,
                      dilation_w, group, group_channels) -> Dict[str, int]:
    return dict(zip(_DCNV3_INTEGER_ATTRIBUTES,
                    (kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h,
                     dilation_w, group, group_channels)))


def _node(op: str, schema_inputs: List[Tuple[str, str]], type_strs: List[str],
          attributes: List[Tuple[str, Any]]):
    """The onnxscript callable writing op's plugin node. onnxscript sorts a call's inputs from
    its attributes by the node's schema, which a plugin does not have in ONNX: this one states
    the plugin's interface."""
    import onnx
    from onnxscript import values

    domain, name = PLUGIN_NODES[op]
    schema = onnx.defs.OpSchema(
        name, domain, 1,
        inputs=[onnx.defs.OpSchema.FormalParameter(input, type_str)
                for input, type_str in schema_inputs],
        outputs=[onnx.defs.OpSchema.FormalParameter("output", "T")],
        type_constraints=[("T", type_strs, "the plugin's floating types")],
        attributes=[onnx.defs.OpSchema.Attribute(attribute, kind, required=False)
                    for attribute, kind in attributes])
    return values.Op(values.Opset(domain, 1), name, schema)


def _ms_deform_attn_to_onnx(value, spatial_shapes, level_start_index, sampling_locations,
                            attention_weights, im2col_step=64, points_per_level=(),
                            sampling="bilinear", softmax=False):
    import onnx
    from onnxscript import ir
    from onnxscript import opset19 as op

    _check_ms_deform_attn_call(value.dtype, points_per_level, sampling, softmax)
    plugin = _node("ms_deform_attn",
                   [("value", "T"), ("spatial_shapes", "tensor(int32)"),
                    ("level_start_index", "tensor(int32)"), ("sampling_locations", "T"),
                    ("attention_weights", "T")],
                   ["tensor(float)", "tensor(float16)"],
                   [("plugin_version", onnx.defs.OpSchema.AttrType.STRING)])
    output = plugin(value, op.Cast(spatial_shapes, to=onnx.TensorProto.INT32),
                    op.Cast(level_start_index, to=onnx.TensorProto.INT32), sampling_locations,
                    attention_weights, plugin_version=MS_DEFORM_ATTN_PLUGIN_VERSION)
    # A node of a foreign domain gets no type from ONNX's inference: state the plugin's.
    output.type = value.type
    output.shape = ir.Shape([value.shape[0], sampling_locations.shape[1], value.shape[2],
                             value.shape[3]])
    # (N, Lq, M, D) -> (N, Lq, M * D): Reshape's 0 keeps a dimension.
    return op.Reshape(output, op.Constant(value_ints=[0, 0, -1]))


def _dcnv3_to_onnx(input, offset, mask, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w,
                   dilation_h, dilation_w, group, group_channels, offset_scale, im2col_step=0,
                   remove_center=False):
    import onnx
    from onnxscript import ir

    _check_dcnv3_call(input.dtype, remove_center)
    plugin = _node("dcnv3", [("input", "T"), ("offset", "T"), ("mask", "T")],
                   ["tensor(float)"],
                   [(attribute, onnx.defs.OpSchema.AttrType.INT)
                    for attribute in _DCNV3_INTEGER_ATTRIBUTES + ("im2col_step",)]
                   + [("offset_scale", onnx.defs.OpSchema.AttrType.FLOAT)])
    output = plugin(input, offset, mask, offset_scale=float(offset_scale),
                    im2col_step=DCNV3_PLUGIN_IM2COL_STEP,
                    **_dcnv3_attributes(kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w,
                                        dilation_h, dilation_w, group, group_channels))
    output.type = input.type
    # The output's pixels are the offset's.
    output.shape = ir.Shape([offset.shape[0], offset.shape[1], offset.shape[2],
                             group * group_channels])
    return output


def translation_table(ops) -> Dict:
    """The torch.export-based exporter's translations writing ``ops``' plugin nodes."""
    translations = {"ms_deform_attn": (torch.ops.deformconv.ms_deform_attn.default,
                                       _ms_deform_attn_to_onnx),
                    "dcnv3": (torch.ops.deformconv.dcnv3.default, _dcnv3_to_onnx)}
    return dict(translations[op] for op in ops)


def _ms_deform_attn_symbolic(g, value, spatial_shapes, level_start_index, sampling_locations,
                             attention_weights, im2col_step, points_per_level, sampling,
                             softmax):
    from torch.onnx import symbolic_helper

    _check_ms_deform_attn_call(symbolic_helper._try_get_scalar_type(value).onnx_type(),
                               symbolic_helper._maybe_get_const(points_per_level, "is"),
                               symbolic_helper._maybe_get_const(sampling, "s"),
                               symbolic_helper._maybe_get_const(softmax, "b"))
    domain, name = PLUGIN_NODES["ms_deform_attn"]
    int32 = torch.onnx.TensorProtoDataType.INT32
    output = g.op(f"{domain}::{name}", value, g.op("Cast", spatial_shapes, to_i=int32),
                  g.op("Cast", level_start_index, to_i=int32), sampling_locations,
                  attention_weights, plugin_version_s=MS_DEFORM_ATTN_PLUGIN_VERSION)
    # A node of a foreign domain gets no type from ONNX's inference: state the plugin's.
    N, _, M, D = symbolic_helper._get_tensor_sizes(value)
    queries = symbolic_helper._get_tensor_sizes(sampling_locations)[1]
    output.setType(value.type().with_sizes([N, queries, M, D]))
    return g.op("Reshape", output,
                g.op("Constant", value_t=torch.tensor([0, 0, -1], dtype=torch.int64)))


def _dcnv3_symbolic(g, input, offset, mask, kernel_h, kernel_w, stride_h, stride_w, pad_h,
                    pad_w, dilation_h, dilation_w, group, group_channels, offset_scale,
                    im2col_step, remove_center):
    from torch.onnx import symbolic_helper

    _check_dcnv3_call(symbolic_helper._try_get_scalar_type(input).onnx_type(),
                      symbolic_helper._maybe_get_const(remove_center, "b"))
    integers = [symbolic_helper._get_const(argument, "i", attribute) for argument, attribute in
                zip((kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h,
                     dilation_w, group, group_channels), _DCNV3_INTEGER_ATTRIBUTES)]
    attributes = {f"{attribute}_i": value
                  for attribute, value in _dcnv3_attributes(*integers).items()}
    domain, name = PLUGIN_NODES["dcnv3"]
    output = g.op(f"{domain}::{name}", input, offset, mask,
                  offset_scale_f=symbolic_helper._get_const(offset_scale, "f", "offset_scale"),
                  im2col_step_i=DCNV3_PLUGIN_IM2COL_STEP, **attributes)
    # The output's pixels are the offset's.
    N, Ho, Wo, _ = symbolic_helper._get_tensor_sizes(offset)
    output.setType(input.type().with_sizes([N, Ho, Wo, integers[8] * integers[9]]))
    return output


TORCHSCRIPT_SYMBOLICS = {"ms_deform_attn": _ms_deform_attn_symbolic, "dcnv3": _dcnv3_symbolic}
