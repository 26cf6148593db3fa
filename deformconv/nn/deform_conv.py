"""nn.Modules with mmcv's names, constructor keywords and parameter names, so that mmcv/mmdet
checkpoints load: DeformConv2d (v1), ModulatedDeformConv2d (v2), and the *Pack variants that
own the convolution predicting their offsets (and mask)."""

import math
import warnings
from typing import Optional, Tuple, Union

import torch
from torch import Tensor, nn
from torch.nn.modules.utils import _pair

from ..ops.deform_conv2d import deform_conv2d_with_groups

IntOrPair = Union[int, Tuple[int, int]]


def _deform_groups(cls_name: str, deform_groups: int, deformable_groups: Optional[int]) -> int:
    """mmcv's deprecated keyword ``deformable_groups``, still found in many configs."""
    if deformable_groups is None:
        return deform_groups
    warnings.warn(f"{cls_name}: 'deformable_groups' is deprecated, use 'deform_groups'",
                  DeprecationWarning, stacklevel=3)
    return deformable_groups


class _DeformConvBase(nn.Module):
    """Parameters, initialisation and checks shared by the four modules."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: IntOrPair,
        stride: IntOrPair,
        padding: IntOrPair,
        dilation: IntOrPair,
        groups: int,
        deform_groups: int,
        bias: bool,
        im2col_step: int,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        for arg, value in (("in_channels", in_channels), ("out_channels", out_channels),
                           ("groups", groups), ("deform_groups", deform_groups)):
            if value < 1:
                raise ValueError(f"{name}: expected {arg} to be at least 1, but got {value}")
        if in_channels % groups:
            raise ValueError(f"{name}: expected in_channels ({in_channels}) to be divisible by "
                             f"groups ({groups})")
        if out_channels % groups:
            raise ValueError(f"{name}: expected out_channels ({out_channels}) to be divisible "
                             f"by groups ({groups})")
        if in_channels % deform_groups:
            raise ValueError(f"{name}: expected in_channels ({in_channels}) to be divisible by "
                             f"deform_groups ({deform_groups})")
        if im2col_step < 0:
            raise ValueError(f"{name}: expected im2col_step to be positive, or 0 for automatic, "
                             f"but got {im2col_step}")
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size: Tuple[int, int] = _pair(kernel_size)
        self.stride: Tuple[int, int] = _pair(stride)
        self.padding: Tuple[int, int] = _pair(padding)
        self.dilation: Tuple[int, int] = _pair(dilation)
        for arg, values, minimum in (("kernel_size", self.kernel_size, 1),
                                     ("stride", self.stride, 1),
                                     ("padding", self.padding, 0),
                                     ("dilation", self.dilation, 1)):
            if min(values) < minimum:
                raise ValueError(f"{name}: expected {arg} to be at least {minimum}, "
                                 f"but got {values}")
        self.groups = groups
        self.deform_groups = deform_groups
        self.im2col_step = im2col_step
        self.weight = nn.Parameter(
            torch.empty(out_channels, in_channels // groups, *self.kernel_size))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_channels))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # As nn.Conv2d initialises itself.
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in = self.weight.shape[1] * self.weight.shape[2] * self.weight.shape[3]
            bound = 1 / math.sqrt(fan_in)
            nn.init.uniform_(self.bias, -bound, bound)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, dilation={self.dilation}, "
                f"groups={self.groups}, deform_groups={self.deform_groups}, "
                f"bias={self.bias is not None}, im2col_step={self.im2col_step}")

    def _deform_conv(self, x: Tensor, offset: Tensor, mask: Optional[Tensor]) -> Tensor:
        # The op with the module's own groups: scriptable, and no shape inference.
        return deform_conv2d_with_groups(
            x, offset, self.weight, mask, self.bias, [self.stride[0], self.stride[1]],
            [self.padding[0], self.padding[1]], [self.dilation[0], self.dilation[1]],
            self.groups, self.deform_groups, self.im2col_step)

    def _offset_conv(self, channels_per_tap: int) -> nn.Conv2d:
        """The zero-initialised convolution of the Pack variants, so that training starts from
        a plain convolution (zero offsets, mask 0.5 everywhere for v2)."""
        conv = nn.Conv2d(self.in_channels,
                         self.deform_groups * channels_per_tap * self.kernel_size[0]
                         * self.kernel_size[1],
                         kernel_size=self.kernel_size, stride=self.stride, padding=self.padding,
                         dilation=self.dilation, bias=True)
        nn.init.zeros_(conv.weight)
        nn.init.zeros_(conv.bias)
        return conv


class DeformConv2d(_DeformConvBase):
    """DCN v1: ``forward(x, offset)``. x: (N, in_channels, H, W); offset:
    (N, deform_groups * 2 * kH * kW, H_out, W_out), y before x per tap. ``forward`` also takes
    an optional mask, as ``torchvision.ops.DeformConv2d.forward`` does, so that it can stand in
    for that module."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: IntOrPair,
                 stride: IntOrPair = 1, padding: IntOrPair = 0, dilation: IntOrPair = 1,
                 groups: int = 1, deform_groups: int = 1, bias: bool = False,
                 im2col_step: int = 0, *, deformable_groups: Optional[int] = None) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation,
                         groups, _deform_groups(type(self).__name__, deform_groups,
                                                deformable_groups), bias, im2col_step)

    def forward(self, x: Tensor, offset: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        return self._deform_conv(x, offset, mask)


class ModulatedDeformConv2d(_DeformConvBase):
    """DCN v2: ``forward(x, offset, mask)``; mask: (N, deform_groups * kH * kW, H_out, W_out)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: IntOrPair,
                 stride: IntOrPair = 1, padding: IntOrPair = 0, dilation: IntOrPair = 1,
                 groups: int = 1, deform_groups: int = 1, bias: bool = True,
                 im2col_step: int = 0, *, deformable_groups: Optional[int] = None) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation,
                         groups, _deform_groups(type(self).__name__, deform_groups,
                                                deformable_groups), bias, im2col_step)

    def forward(self, x: Tensor, offset: Tensor, mask: Tensor) -> Tensor:
        return self._deform_conv(x, offset, mask)


class DeformConv2dPack(DeformConv2d):
    """DCN v1 that predicts its offsets from x with ``conv_offset``: ``forward(x)``."""

    _version = 2  # mmcv's state-dict version of the Pack modules (see upgrade_mmcv_state_dict)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.conv_offset = self._offset_conv(2)

    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
        return self._deform_conv(x, self.conv_offset(x), None)


class ModulatedDeformConv2dPack(ModulatedDeformConv2d):
    """DCN v2 that predicts offsets and mask from x with ``conv_offset``: ``forward(x)``. Its
    output is split in three along channels: offset = first two thirds, mask = sigmoid(last)."""

    _version = 2  # mmcv's state-dict version of the Pack modules (see upgrade_mmcv_state_dict)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.conv_offset = self._offset_conv(3)

    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
        out = self.conv_offset(x)
        offset_y_x_first, offset_y_x_second, mask = torch.chunk(out, 3, dim=1)
        offset = torch.cat((offset_y_x_first, offset_y_x_second), dim=1)
        return self._deform_conv(x, offset, torch.sigmoid(mask))


def upgrade_mmcv_state_dict(model: nn.Module, state_dict: dict) -> dict:
    """Returns ``state_dict`` with the keys of checkpoints saved before version 2 of mmcv's Pack
    modules renamed for ``model``: early mmdet models kept a layer's offset convolution beside
    it, as ``<layer>_offset.weight``, rather than inside it, as ``<layer>.conv_offset.weight``.
    mmcv renames them in the layer's ``_load_from_state_dict``; PyTorch now hands each module
    only the keys under its own prefix, so the renaming has to see the whole state dict:

        model.load_state_dict(deformconv.upgrade_mmcv_state_dict(model, checkpoint))
    """
    upgraded = type(state_dict)(state_dict)
    metadata = getattr(state_dict, "_metadata", {})
    if metadata:
        upgraded._metadata = metadata
    for name, module in model.named_modules():
        if not isinstance(module, (DeformConv2dPack, ModulatedDeformConv2dPack)):
            continue
        version = metadata.get(name, {}).get("version", None)
        if version is not None and version >= 2:
            continue
        for parameter in ("weight", "bias"):
            new_key = f"{name}.conv_offset.{parameter}"
            old_key = f"{name}_offset.{parameter}"
            if new_key not in upgraded and old_key in upgraded:
                upgraded[new_key] = upgraded.pop(old_key)
    return upgraded
