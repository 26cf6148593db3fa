"""Export to ONNX (opset 19).

    import deformconv.onnx
    deformconv.onnx.export_onnx(model, (x,), "model.onnx")                 # torch.export based
    deformconv.onnx.export_onnx(model, (x,), "model.onnx", dynamo=False)   # TorchScript based
    deformconv.onnx.export_onnx(model, (x,), "model.onnx", deform_conv2d_form="standard")

deform_conv2d maps onto DeformConv(X, W, offset, B, mask) one to one: ONNX uses the same offset
layout (y, x per tap, deform groups outermost), the same zero-outside bilinear sampling and the
same mask, so the exported graph computes what PyTorch computes. im2col_step is an execution
detail and has no ONNX counterpart. For the runtimes without DeformConv (OpenVINO),
deform_conv2d_form="standard" writes it in standard operators instead: GridSample, Mul and
MatMul, deformconv.decompositions.deform_conv2d.

ONNX has no DCNv3, DCNv4 or multi-scale deformable attention operator. While an export runs,
deformconv.dcnv3, deformconv.dcnv4 and deformconv.ms_deform_attn compute through their forms in
standard operators instead (deformconv.decompositions: GridSample, which samples bilinearly with
zeros outside as the ops do, then Mul and ReduceSum), which both exporters translate. The
torch.export-based exporter reads the levels' sizes of multi-scale deformable attention from
spatial_shapes in the graph; the TorchScript-based one, a tracer, records the sizes it saw as
constants.

With ``tensorrt_plugins``, ms_deform_attn and dcnv3 are written instead as the TensorRT plugin
nodes of deformconv.tensorrt_plugins, for TensorRT's parser (which reads deform_conv2d's
DeformConv itself).
"""

import contextlib
from typing import Any, Dict, FrozenSet, Iterator, Optional, Sequence, Union

import torch

from . import tensorrt_plugins as _plugins
from .decompositions import SAMPLING_FORMS

OPSET = 19
# GridSample, the first opset of the standard-operator forms.
STANDARD_FORM_OPSET = 16
DEFORM_CONV2D_FORMS = ("DeformConv", "standard")

_deform_conv2d_in_standard_ops = False
_sampling_form = "grid_sample"
_tensorrt_plugins: FrozenSet[str] = frozenset()


def deform_conv2d_in_standard_ops() -> bool:
    """Whether an export_onnx under way writes deform_conv2d in standard operators."""
    return _deform_conv2d_in_standard_ops


def sampling_form() -> str:
    """The sampling form (decompositions.SAMPLING_FORMS) of the export_onnx under way."""
    return _sampling_form


def tensorrt_plugin(op: str) -> bool:
    """Whether the export_onnx under way writes ``op`` as its TensorRT plugin node."""
    return op in _tensorrt_plugins


@contextlib.contextmanager
def _export_forms(deform_conv2d_form: str, sampling: str,
                  plugins: FrozenSet[str]) -> Iterator[None]:
    global _deform_conv2d_in_standard_ops, _sampling_form, _tensorrt_plugins
    outer = _deform_conv2d_in_standard_ops, _sampling_form, _tensorrt_plugins
    _deform_conv2d_in_standard_ops = deform_conv2d_form == "standard"
    _sampling_form = sampling
    _tensorrt_plugins = plugins
    try:
        yield
    finally:
        _deform_conv2d_in_standard_ops, _sampling_form, _tensorrt_plugins = outer


@contextlib.contextmanager
def _torchscript_plugin_symbolics(plugins: FrozenSet[str], opset_version: int) -> Iterator[None]:
    # Registered for this export only: another export of the same ops writes no plugin node.
    for op in plugins:
        torch.onnx.register_custom_op_symbolic(f"deformconv::{op}",
                                               _plugins.TORCHSCRIPT_SYMBOLICS[op], opset_version)
    try:
        yield
    finally:
        for op in plugins:
            torch.onnx.unregister_custom_op_symbolic(f"deformconv::{op}", opset_version)


def _requested_plugins(tensorrt_plugins: Union[str, Sequence[str]]) -> FrozenSet[str]:
    requested = ([tensorrt_plugins] if isinstance(tensorrt_plugins, str)
                 else list(tensorrt_plugins))
    with_plugins = tuple(_plugins.PLUGIN_NODES)
    for op in requested:
        if op == "deform_conv2d":
            raise ValueError("export_onnx(): tensorrt_plugins: deform_conv2d needs no plugin "
                             "node, TensorRT reads ONNX's DeformConv (deform_conv2d_form="
                             f"'DeformConv', the default); the ops with one are {with_plugins}")
        if op not in _plugins.PLUGIN_NODES:
            raise ValueError(f"export_onnx(): tensorrt_plugins: {op!r} has no TensorRT plugin "
                             f"node; the ops with one are {with_plugins}")
    return frozenset(requested)


def _deform_conv2d_to_onnx(input, offset, weight, mask, bias, stride, padding, dilation,
                           groups, offset_groups, im2col_step):
    from onnxscript import opset19 as op

    return op.DeformConv(
        input, weight, offset, bias, mask,
        dilations=list(dilation),
        group=groups,
        offset_group=offset_groups,
        # ONNX pads: [y_begin, x_begin, y_end, x_end]; ours are symmetric.
        pads=[padding[0], padding[1], padding[0], padding[1]],
        strides=list(stride),
    )


def translation_table() -> Dict[Any, Any]:
    """The custom translation table for ``torch.onnx.export(..., dynamo=True)``, for users who
    call the exporter themselves."""
    return {torch.ops.deformconv.deform_conv2d.default: _deform_conv2d_to_onnx}


def _deform_conv2d_symbolic(g, input, offset, weight, mask, bias, stride, padding, dilation,
                            groups, offset_groups, im2col_step):
    """The same mapping for the TorchScript-based exporter."""
    from torch.onnx import symbolic_helper

    stride = symbolic_helper._get_const(stride, "is", "stride")
    padding = symbolic_helper._get_const(padding, "is", "padding")
    dilation = symbolic_helper._get_const(dilation, "is", "dilation")
    inputs = [input, weight, offset]
    if not symbolic_helper._is_none(mask):
        if symbolic_helper._is_none(bias):
            # B sits before mask in DeformConv's inputs: a mask needs an explicit zero bias.
            out_channels = symbolic_helper._get_tensor_sizes(weight)[0]
            if out_channels is None:
                raise ValueError("export_onnx(): a mask without a bias needs a weight of "
                                 "static shape, to build the zero bias ONNX requires")
            dtype = symbolic_helper._try_get_scalar_type(input).dtype()
            bias = g.op("Constant", value_t=torch.zeros(out_channels, dtype=dtype))
        inputs += [bias, mask]
    elif not symbolic_helper._is_none(bias):
        inputs.append(bias)
    return g.op(
        "DeformConv", *inputs,
        dilations_i=dilation,
        group_i=symbolic_helper._get_const(groups, "i", "groups"),
        offset_group_i=symbolic_helper._get_const(offset_groups, "i", "offset_groups"),
        pads_i=[padding[0], padding[1], padding[0], padding[1]],
        strides_i=stride,
    )


def register_torchscript_symbolic(opset_version: int = OPSET) -> None:
    """Registers the DeformConv mapping with the TorchScript-based exporter
    (``torch.onnx.export(..., dynamo=False)``)."""
    torch.onnx.register_custom_op_symbolic("deformconv::deform_conv2d",
                                           _deform_conv2d_symbolic, opset_version)


def export_onnx(model: torch.nn.Module, args: tuple, path: str,
                opset_version: int = OPSET, dynamo: bool = True,
                deform_conv2d_form: str = "DeformConv", sampling_form: str = "grid_sample",
                tensorrt_plugins: Union[str, Sequence[str]] = (), **kwargs: Optional[Any]):
    """Exports ``model`` called on ``args`` to ``path`` through the torch.export-based exporter
    (``dynamo=True``, needs onnx and onnxscript) or the TorchScript-based one
    (``dynamo=False``). deform_conv2d becomes ONNX's DeformConv node (opset 19 on), or with
    ``deform_conv2d_form="standard"`` standard operators (opset 16 on), which every runtime
    reads; the other ops are always written in standard operators. Those sample bilinearly with
    GridSample, or with ``sampling_form="gather"`` by GatherElements of the four corners
    (deformconv.decompositions), for the runtimes that lack or miscompile GridSample. The ops
    named in ``tensorrt_plugins`` ("ms_deform_attn", "dcnv3") become TensorRT plugin nodes
    instead (deformconv.tensorrt_plugins). Extra keyword arguments go to
    ``torch.onnx.export``, whose result is returned."""
    if deform_conv2d_form not in DEFORM_CONV2D_FORMS:
        raise ValueError(f"export_onnx(): deform_conv2d_form must be one of "
                         f"{DEFORM_CONV2D_FORMS}, but got {deform_conv2d_form!r}")
    if sampling_form not in SAMPLING_FORMS:
        raise ValueError(f"export_onnx(): sampling_form must be one of {SAMPLING_FORMS}, but "
                         f"got {sampling_form!r}")
    if opset_version < STANDARD_FORM_OPSET:
        raise ValueError(f"export_onnx(): the ops' standard-operator forms need GridSample, "
                         f"opset_version >= {STANDARD_FORM_OPSET}, but got {opset_version}")
    if deform_conv2d_form == "DeformConv" and opset_version < OPSET:
        raise ValueError(f"export_onnx(): ONNX DeformConv needs opset_version >= {OPSET}, but "
                         f"got {opset_version}; deform_conv2d_form='standard' writes "
                         f"deform_conv2d from opset {STANDARD_FORM_OPSET} on")
    plugins = _requested_plugins(tensorrt_plugins)
    with _export_forms(deform_conv2d_form, sampling_form, plugins):
        if not dynamo:
            if deform_conv2d_form == "DeformConv":
                register_torchscript_symbolic(opset_version)
            with _torchscript_plugin_symbolics(plugins, opset_version):
                return torch.onnx.export(model, args, path, dynamo=False,
                                         opset_version=opset_version, **kwargs)
        table = dict(kwargs.pop("custom_translation_table", None) or {})
        if deform_conv2d_form == "DeformConv":
            table.update(translation_table())
        table.update(_plugins.translation_table(plugins))
        return torch.onnx.export(model, args, path, dynamo=True, opset_version=opset_version,
                                 custom_translation_table=table, **kwargs)
