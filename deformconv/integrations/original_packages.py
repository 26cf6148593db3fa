"""Stand-ins for the originals' compiled op packages, whose classes and functions are
deformconv's (deformconv.integrations.use_for registers them in ``sys.modules``):

- ``ops_dcnv3`` (InternImage) with ``modules.DCNv3`` and ``modules.DCNv3_pytorch`` (both
  deformconv's DCNv3: the original's pure-PyTorch module has the same parameters and keys),
  ``functions.DCNv3Function.apply`` and ``functions.dcnv3_core_pytorch``;
- ``DCNv4`` (FlashInternImage) with ``DCNv4``, ``FlashDeformAttn``, ``modules.DCNv4``,
  ``modules.FlashDeformAttn``, ``functions.DCNv4Function.apply`` and
  ``functions.FlashDeformAttnFunction.apply``;
- ``MultiScaleDeformableAttention`` (Deformable DETR's extension) with
  ``ms_deform_attn_forward`` and ``ms_deform_attn_backward``, on deformconv's ops: the model's
  own module and autograd function run unchanged, on the CPU too.
"""

import types
from typing import Dict, List

import torch
from torch import Tensor

from ..nn import DCNv3, DCNv4, FlashDeformAttn
from ..ops import dcnv3, dcnv4, flash_deform_attn


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


def _stand_in(name: str, package: bool = True, **attributes) -> types.ModuleType:
    module = types.ModuleType(name, f"deformconv's stand-in for {name} "
                                    "(deformconv.integrations)")
    if package:
        module.__path__ = []  # so that `from name.sub import x` finds the submodules
    module.__deformconv_stand_in__ = True
    for key, value in attributes.items():
        setattr(module, key, value)
    return module


def is_stand_in(module) -> bool:
    return getattr(module, "__deformconv_stand_in__", False) is True


def stand_ins(codebase: str) -> Dict[str, types.ModuleType]:
    """The stand-ins of `codebase`'s op packages, by their names in ``sys.modules``."""
    if codebase == "deformable_detr":
        return {"MultiScaleDeformableAttention": _stand_in(
            "MultiScaleDeformableAttention", package=False,
            ms_deform_attn_forward=ms_deform_attn_forward,
            ms_deform_attn_backward=ms_deform_attn_backward)}
    if codebase == "internimage":
        modules = _stand_in("ops_dcnv3.modules", DCNv3=DCNv3, DCNv3_pytorch=DCNv3)
        functions = _stand_in("ops_dcnv3.functions", DCNv3Function=DCNv3Function,
                             dcnv3_core_pytorch=dcnv3_core_pytorch)
        return {"ops_dcnv3": _stand_in("ops_dcnv3", modules=modules, functions=functions),
                "ops_dcnv3.modules": modules, "ops_dcnv3.functions": functions}
    classes = dict(DCNv4=DCNv4, FlashDeformAttn=FlashDeformAttn)
    function_classes = dict(DCNv4Function=DCNv4Function,
                            FlashDeformAttnFunction=FlashDeformAttnFunction)
    modules = _stand_in("DCNv4.modules", **classes)
    functions = _stand_in("DCNv4.functions", **function_classes)
    return {"DCNv4": _stand_in("DCNv4", **classes, **function_classes, modules=modules,
                              functions=functions),
            "DCNv4.modules": modules, "DCNv4.functions": functions}
