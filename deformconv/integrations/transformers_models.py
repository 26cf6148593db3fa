"""Hugging Face transformers' multi-scale deformable attention, routed to deformconv's op.

transformers computes MSDA in pure PyTorch (``grid_sample``) in three forms, each defined again
in every modeling module that uses it (``transformers/models/<family>/modeling_<family>.py``):

- the stateless module ``MultiScaleDeformableAttention`` (Deformable DETR, RT-DETR, LW-DETR,
  RF-DETR, Grounding DINO, MM Grounding DINO, OmDet-Turbo, PP-DocLayout v2 to v4), whose
  ``forward(value, value_spatial_shapes, value_spatial_shapes_list, level_start_index,
  sampling_locations, attention_weights, im2col_step)`` is replaced on the class, so modules
  built before the routing are routed too;
- the function ``multi_scale_deformable_attention_v2(value, value_spatial_shapes,
  sampling_locations, attention_weights, num_points_list, method)`` (RT-DETRv2, D-FINE,
  DEIMv2): points per level, and ``method="discrete"`` as nearest sampling. RT-DETRv2 looks it
  up at each call; D-FINE and DEIMv2 store it on each attention module when it is built
  (``self.ms_deformable_attn_core``), so their models must be built after the routing;
- the function ``multi_scale_deformable_attention(value, value_spatial_shapes,
  sampling_locations, attention_weights)`` (Mask2Former, OneFormer), looked up at each call.

A form is routed only where its signature is the one above, so that a renamed or reshaped
form in another release of transformers keeps its own code. The modeling modules imported
before the routing are routed at once; those imported later (transformers imports them lazily,
from its auto classes too) as they are imported, by a finder on ``sys.meta_path``.
"""

import inspect
import sys
import types
from typing import Dict, List, Sequence, Tuple, Union

import torch
from torch import Tensor

from .._after_import import AfterImport
from ..ops import ms_deform_attn


def _level_tensors(spatial_shapes: Union[Tensor, Sequence[Tuple[int, int]]],
                   device: torch.device) -> Tuple[Tensor, Tensor]:
    """The op's (L, 2) shapes and (L,) start offsets from transformers' spatial shapes: a
    Python list of (H, W) ints (the functions' callers pass those), or a tensor."""
    if isinstance(spatial_shapes, Tensor):
        shapes = spatial_shapes.to(device=device, dtype=torch.int64)
        areas = shapes[:, 0] * shapes[:, 1]
        return shapes, torch.cumsum(areas, 0) - areas
    pairs = [(int(height), int(width)) for height, width in spatial_shapes]
    starts, start = [], 0
    for height, width in pairs:
        starts.append(start)
        start += height * width
    return (torch.tensor(pairs, dtype=torch.int64, device=device),
            torch.tensor(starts, dtype=torch.int64, device=device))


def multi_scale_deformable_attention_forward(
        self, value: Tensor, value_spatial_shapes: Tensor,
        value_spatial_shapes_list: List[Tuple[int, int]], level_start_index: Tensor,
        sampling_locations: Tensor, attention_weights: Tensor, im2col_step: int) -> Tensor:
    """``MultiScaleDeformableAttention.forward``, on deformconv's op."""
    return ms_deform_attn(value, value_spatial_shapes.to(torch.int64),
                          level_start_index.to(torch.int64), sampling_locations,
                          attention_weights, im2col_step)


_SAMPLING = {"default": "bilinear", "discrete": "nearest"}


def multi_scale_deformable_attention_v2(
        value: Tensor, value_spatial_shapes: Union[Tensor, Sequence[Tuple[int, int]]],
        sampling_locations: Tensor, attention_weights: Tensor, num_points_list: List[int],
        method: str = "default") -> Tensor:
    """RT-DETRv2's, D-FINE's and DEIMv2's function, on deformconv's op: locations (N, Lq, M,
    sum(num_points_list), 2) and weights (N, Lq, M, sum(num_points_list)), level 0's points
    first; ``method`` "default" (bilinear) or "discrete" (nearest)."""
    if method not in _SAMPLING:
        raise ValueError(f"multi_scale_deformable_attention_v2: method must be 'default' or "
                         f"'discrete', got {method!r}")
    shapes, starts = _level_tensors(value_spatial_shapes, value.device)
    return ms_deform_attn(value, shapes, starts, sampling_locations, attention_weights, 64,
                          [int(points) for points in num_points_list], _SAMPLING[method])


def multi_scale_deformable_attention(
        value: Tensor, value_spatial_shapes: Union[Tensor, Sequence[Tuple[int, int]]],
        sampling_locations: Tensor, attention_weights: Tensor) -> Tensor:
    """Mask2Former's and OneFormer's function, on deformconv's op."""
    shapes, starts = _level_tensors(value_spatial_shapes, value.device)
    return ms_deform_attn(value, shapes, starts, sampling_locations, attention_weights)


# Each routed name of a modeling module: the parameters its original must have, and what
# replaces it (for the class, its forward).
_ROUTES = {
    "MultiScaleDeformableAttention": (
        ("self", "value", "value_spatial_shapes", "value_spatial_shapes_list",
         "level_start_index", "sampling_locations", "attention_weights", "im2col_step"),
        multi_scale_deformable_attention_forward),
    "multi_scale_deformable_attention_v2": (
        ("value", "value_spatial_shapes", "sampling_locations", "attention_weights",
         "num_points_list", "method"),
        multi_scale_deformable_attention_v2),
    "multi_scale_deformable_attention": (
        ("value", "value_spatial_shapes", "sampling_locations", "attention_weights"),
        multi_scale_deformable_attention),
}

# The routed names, which a modeling module holds where it computes MSDA.
FORMS = tuple(_ROUTES)

# (module name, routed name) -> the original function (for the class, its forward).
_originals: Dict[Tuple[str, str], types.FunctionType] = {}


def is_modeling_module(name: str) -> bool:
    parts = name.split(".")
    return (len(parts) == 4 and parts[:2] == ["transformers", "models"]
            and parts[3].startswith("modeling_"))


def _parameters(function) -> Tuple[str, ...]:
    try:
        return tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return ()


def route_module(module: types.ModuleType) -> None:
    """Routes the forms of one modeling module that have the expected signatures."""
    for name, (parameters, replacement) in _ROUTES.items():
        target = vars(module).get(name)
        if target is None or (module.__name__, name) in _originals:
            continue
        if isinstance(target, type) and issubclass(target, torch.nn.Module):
            original = vars(target).get("forward")
            if original is not None and _parameters(original) == parameters:
                _originals[(module.__name__, name)] = original
                target.forward = replacement
        elif inspect.isfunction(target) and _parameters(target) == parameters:
            _originals[(module.__name__, name)] = target
            setattr(module, name, replacement)


# Routes each modeling module as it is imported, while route() holds.
_IMPORTED_LATER = AfterImport(is_modeling_module, route_module)


def route() -> None:
    """Routes the modeling modules imported so far and those imported from now on."""
    _IMPORTED_LATER.install()
    for name, module in list(sys.modules.items()):
        if is_modeling_module(name) and isinstance(module, types.ModuleType):
            route_module(module)


def unroute() -> None:
    """Undoes route(): the finder leaves sys.meta_path and every routed original goes back
    (modules built meanwhile keep what they stored)."""
    _IMPORTED_LATER.uninstall()
    for (module_name, name), original in list(_originals.items()):
        module = sys.modules.get(module_name)
        if module is not None:
            target = vars(module).get(name)
            if isinstance(target, type):
                target.forward = original
            else:
                setattr(module, name, original)
        del _originals[(module_name, name)]
