"""Turn an existing model deformable in place: ``convert_to_deformable``."""

import fnmatch
from typing import Iterable, List, Union

import torch
from torch import nn

from .nn import DeformConv2d, DeformConv2dPack, ModulatedDeformConv2dPack


def _set_child(model: nn.Module, qualified_name: str, module: nn.Module) -> None:
    parent_name, _, child_name = qualified_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child_name, module)


def _from_conv2d(conv: nn.Conv2d, name: str, modulated: bool, deform_groups: int) -> nn.Module:
    if isinstance(conv.padding, str) or conv.padding_mode != "zeros":
        raise ValueError(f"convert_to_deformable(): layer {name!r} has padding "
                         f"{conv.padding!r} with padding_mode {conv.padding_mode!r}; only "
                         "explicit zero padding has a deformable equivalent")
    cls = ModulatedDeformConv2dPack if modulated else DeformConv2dPack
    return cls(conv.in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride,
               padding=conv.padding, dilation=conv.dilation, groups=conv.groups,
               deform_groups=deform_groups, bias=conv.bias is not None)


def _from_torchvision(module: nn.Module, deform_groups: int) -> nn.Module:
    return DeformConv2d(module.in_channels, module.out_channels, module.kernel_size,
                        stride=module.stride, padding=module.padding, dilation=module.dilation,
                        groups=module.groups, deform_groups=deform_groups,
                        bias=module.bias is not None)


def convert_to_deformable(model: nn.Module, patterns: Union[str, Iterable[str]], *,
                          modulated: bool = False, deform_groups: int = 1) -> List[str]:
    """Replaces layers of ``model`` in place and returns the qualified names replaced.

    - ``nn.Conv2d`` layers whose qualified name matches one of ``patterns`` (shell patterns,
      e.g. ``"layer[234].*.conv2"`` for the 3x3 convolutions of stages 2-4 of a torchvision
      ResNet) become ``DeformConv2dPack`` (or ``ModulatedDeformConv2dPack`` with
      ``modulated=True``) with the same geometry, weight and bias. The offset convolution
      starts at zero, so a v1 layer computes exactly what the convolution did until training
      moves it; a v2 layer starts at half (mask sigmoid(0) = 0.5), as mmcv's does.
    - ``torchvision.ops.DeformConv2d`` layers whose name matches become ``DeformConv2d``
      (same ``forward(x, offset, mask=None)``), weights copied. torchvision's module reads the
      number of offset groups off the offset it is given; ours is told: ``deform_groups``.
    """
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    try:
        from torchvision.ops import DeformConv2d as TorchvisionDeformConv2d
    except ImportError:
        TorchvisionDeformConv2d = None
    replaced = []
    for name, module in list(model.named_modules()):
        if not any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            continue
        if TorchvisionDeformConv2d is not None and isinstance(module, TorchvisionDeformConv2d):
            layer = _from_torchvision(module, deform_groups)
        elif isinstance(module, nn.Conv2d):
            layer = _from_conv2d(module, name, modulated, deform_groups)
        else:
            continue
        with torch.no_grad():
            layer.weight.copy_(module.weight)
            if module.bias is not None:
                layer.bias.copy_(module.bias)
        layer.to(device=module.weight.device, dtype=module.weight.dtype)
        layer.train(module.training)
        _set_child(model, name, layer)
        replaced.append(name)
    if not replaced:
        raise ValueError(f"convert_to_deformable(): no nn.Conv2d or torchvision DeformConv2d "
                         f"layer matches {patterns}")
    return replaced
