"""The original InternImage, FlashInternImage and Deformable DETR model files, unchanged, on
deformconv.

Their model files import the originals' compiled op packages at import time:

- InternImage (``classification/models/intern_image.py``, ``intern_image_meta_former.py``, and
  the detection and segmentation backbones): ``from ops_dcnv3 import modules as opsm``, then
  ``getattr(opsm, core_op)`` with ``core_op`` ``'DCNv3'`` or ``'DCNv3_pytorch'``;
- FlashInternImage (``classification/models/flash_intern_image.py``): ``import DCNv4``, then
  ``getattr(DCNv4, core_op)`` with ``core_op='DCNv4'``; detectors on DCNv4's flash deformable
  attention: ``from DCNv4 import FlashDeformAttn`` (or ``FlashDeformAttnFunction``);
- Deformable DETR (``models/ops/functions/ms_deform_attn_func.py``, and the copies of that
  folder in DINO, DN-DETR and their descendants): ``import MultiScaleDeformableAttention as
  MSDA``, whose ``ms_deform_attn_forward`` and ``ms_deform_attn_backward`` its autograd
  function calls.

Those packages need their CUDA extensions (and DCNv4 a GPU at import), so on a machine without
them the import of the model file fails. :func:`use_for` puts stand-ins for them into
``sys.modules``, whose classes are deformconv's, before the model file is imported::

    import deformconv.integrations
    deformconv.integrations.use_for("internimage")   # or "flash_internimage", "deformable_detr"
    from models.intern_image import InternImage       # builds deformconv.DCNv3

The stand-ins hold what the model files and the originals' ``functions`` use: ``ops_dcnv3``
with ``modules.DCNv3`` and ``modules.DCNv3_pytorch`` (both deformconv's DCNv3: the original's
pure-PyTorch module has the same parameters and keys), ``functions.DCNv3Function.apply`` and
``functions.dcnv3_core_pytorch``; ``DCNv4`` with ``DCNv4``, ``FlashDeformAttn``,
``modules.DCNv4``, ``modules.FlashDeformAttn``, ``functions.DCNv4Function.apply`` and
``functions.FlashDeformAttnFunction.apply``; ``MultiScaleDeformableAttention`` with
``ms_deform_attn_forward`` and ``ms_deform_attn_backward`` (the extension's functions, on
deformconv's ops: the model's own module and autograd function run unchanged, on the CPU too).
"""

import sys
import types
from typing import Dict, List

import torch
from torch import Tensor

from .nn import DCNv3, DCNv4, FlashDeformAttn
from .ops import dcnv3, dcnv4, flash_deform_attn


class DCNv3Function:
    """The original's ``DCNv3Function``: ``apply`` takes the same positional arguments."""

    apply = staticmethod(dcnv3)


class DCNv4Function:
    """The original's ``DCNv4Function``: ``apply`` takes the same positional arguments."""

    apply = staticmethod(dcnv4)


class FlashDeformAttnFunction:
    """The original's ``FlashDeformAttnFunction``: ``apply`` takes the same positional
    arguments."""

    apply = staticmethod(flash_deform_attn)


def dcnv3_core_pytorch(input, offset, mask, kernel_h, kernel_w, stride_h, stride_w, pad_h,
                       pad_w, dilation_h, dilation_w, group, group_channels, offset_scale,
                       remove_center=False):
    """The original's pure-PyTorch DCNv3 core (the same arguments, no ``im2col_step``)."""
    return dcnv3(input, offset, mask, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w,
                 dilation_h, dilation_w, group, group_channels, offset_scale, 0, remove_center)


def ms_deform_attn_forward(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor,
                           sampling_locations: Tensor, attention_weights: Tensor,
                           im2col_step: int) -> Tensor:
    """The Deformable DETR extension's forward: deformconv's op, called from the original's
    autograd function (so on operands that record no graph)."""
    return torch.ops.deformconv.ms_deform_attn(value, spatial_shapes, level_start_index,
                                               sampling_locations, attention_weights,
                                               im2col_step)


def ms_deform_attn_backward(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor,
                            sampling_locations: Tensor, attention_weights: Tensor,
                            grad_output: Tensor, im2col_step: int) -> List[Tensor]:
    """The Deformable DETR extension's backward, in its argument order (grad_output after the
    operands): the gradients of value, sampling_locations and attention_weights, the same bits
    from run to run under PyTorch's deterministic mode."""
    return list(torch.ops.deformconv.ms_deform_attn_backward(
        grad_output, value, spatial_shapes, level_start_index,
        sampling_locations, attention_weights, im2col_step, [], "bilinear", False,
        [True, True, True],
        torch.are_deterministic_algorithms_enabled()))


def _package(name: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name, f"deformconv's stand-in for {name} "
                                    "(deformconv.integrations)")
    module.__path__ = []  # a package, so that `from name.sub import x` finds the submodules
    for key, value in attributes.items():
        setattr(module, key, value)
    return module


def _stand_ins(codebase: str) -> Dict[str, types.ModuleType]:
    if codebase == "deformable_detr":
        extension = types.ModuleType(
            "MultiScaleDeformableAttention",
            "deformconv's stand-in for MultiScaleDeformableAttention (deformconv.integrations)")
        extension.ms_deform_attn_forward = ms_deform_attn_forward
        extension.ms_deform_attn_backward = ms_deform_attn_backward
        return {"MultiScaleDeformableAttention": extension}
    if codebase == "internimage":
        modules = _package("ops_dcnv3.modules", DCNv3=DCNv3, DCNv3_pytorch=DCNv3)
        functions = _package("ops_dcnv3.functions", DCNv3Function=DCNv3Function,
                             dcnv3_core_pytorch=dcnv3_core_pytorch)
        return {"ops_dcnv3": _package("ops_dcnv3", modules=modules, functions=functions),
                "ops_dcnv3.modules": modules, "ops_dcnv3.functions": functions}
    classes = dict(DCNv4=DCNv4, FlashDeformAttn=FlashDeformAttn)
    function_classes = dict(DCNv4Function=DCNv4Function,
                            FlashDeformAttnFunction=FlashDeformAttnFunction)
    modules = _package("DCNv4.modules", **classes)
    functions = _package("DCNv4.functions", **function_classes)
    return {"DCNv4": _package("DCNv4", **classes, **function_classes, modules=modules,
                              functions=functions),
            "DCNv4.modules": modules, "DCNv4.functions": functions}


CODEBASES = ("internimage", "flash_internimage", "deformable_detr")


def use_for(codebase: str) -> None:
    """Makes the model files of ``codebase`` ("internimage", "flash_internimage" or
    "deformable_detr") build their core op from deformconv: registers the stand-ins of the module docstring in
    ``sys.modules``, in place of any original package. Call it before the model file is
    imported; a model file imported earlier keeps what it imported."""
    if codebase not in CODEBASES:
        raise ValueError(f"deformconv.integrations.use_for: codebase must be one of "
                         f"{', '.join(repr(c) for c in CODEBASES)}, got {codebase!r}")
    sys.modules.update(_stand_ins(codebase))
