"""Export to ONNX's standard DeformConv operator (opset 19).

    deformconv.export_onnx(model, (x,), "model.onnx")

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


def export_onnx(model: torch.nn.Module, args: tuple, path: str,
                opset_version: int = OPSET, **kwargs: Optional[Any]):
    """Exports ``model`` called on ``args`` to ``path`` with the deformconv ops as ONNX
    DeformConv nodes; extra keyword arguments go to ``torch.onnx.export``. Needs the onnx and
    onnxscript packages. Returns the ONNXProgram."""
    if opset_version < OPSET:
        raise ValueError(f"export_onnx(): ONNX DeformConv needs opset_version >= {OPSET}, "
                         f"but got {opset_version}")
    table = dict(kwargs.pop("custom_translation_table", None) or {})
    table.update(translation_table())
    return torch.onnx.export(model, args, path, dynamo=True, opset_version=opset_version,
                             custom_translation_table=table, **kwargs)
