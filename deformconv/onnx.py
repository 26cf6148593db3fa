"""Export to ONNX's standard DeformConv operator (opset 19).

    import deformconv.onnx
    deformconv.onnx.export_onnx(model, (x,), "model.onnx")                 # torch.export based
    deformconv.onnx.export_onnx(model, (x,), "model.onnx", dynamo=False)   # TorchScript based

The op maps onto DeformConv(X, W, offset, B, mask) one to one: ONNX uses the same offset layout
(y, x per tap, deform groups outermost), the same zero-outside bilinear sampling and the same
mask, so the exported graph computes what PyTorch computes. im2col_step is an execution
detail and has no ONNX counterpart.
"""

from typing import Any, Dict, Optional

import torch

OPSET = 19


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
                opset_version: int = OPSET, dynamo: bool = True, **kwargs: Optional[Any]):
    """Exports ``model`` called on ``args`` to ``path`` with the deformconv ops as ONNX
    DeformConv nodes, through the torch.export-based exporter (``dynamo=True``, needs onnx and
    onnxscript) or the TorchScript-based one (``dynamo=False``). Extra keyword arguments go to
    ``torch.onnx.export``, whose result is returned."""
    if opset_version < OPSET:
        raise ValueError(f"export_onnx(): ONNX DeformConv needs opset_version >= {OPSET}, "
                         f"but got {opset_version}")
    if not dynamo:
        register_torchscript_symbolic(opset_version)
        return torch.onnx.export(model, args, path, dynamo=False, opset_version=opset_version,
                                 **kwargs)
    table = dict(kwargs.pop("custom_translation_table", None) or {})
    table.update(translation_table())
    return torch.onnx.export(model, args, path, dynamo=True, opset_version=opset_version,
                             custom_translation_table=table, **kwargs)
