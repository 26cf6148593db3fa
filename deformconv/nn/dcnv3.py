"""The DCNv3 and DCNv4 modules with the names, constructor arguments, submodules and
``state_dict`` keys of InternImage's ``DCNv3`` and FlashInternImage's ``DCNv4``
(docs/dcnv3_dcnv4.md, The modules), so that their checkpoints load with ``strict=True``. The
learned channel mixing is in the modules' Linear layers; the ops only sample."""

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops import dcnv3, dcnv4

class _ToChannelsLast(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.permute(0, 2, 3, 1)


def _norm_to_channels_last(norm_layer: str, channels: int) -> nn.Sequential:
    """InternImage's norm after the depth-wise convolution, NCHW in and NHWC out: the permute
    and the norm in the order that gives the originals' submodule indices."""
    if norm_layer == "LN":
        return nn.Sequential(_ToChannelsLast(), nn.LayerNorm(channels, eps=1e-6))
    if norm_layer == "BN":
        return nn.Sequential(nn.BatchNorm2d(channels), _ToChannelsLast())
    raise NotImplementedError(f"DCNv3: norm_layer must be 'LN' or 'BN', but got {norm_layer!r}")


def _activation(act_layer: str) -> nn.Module:
    if act_layer == "ReLU":
        return nn.ReLU(inplace=True)
    if act_layer == "SiLU":
        return nn.SiLU(inplace=True)
    if act_layer == "GELU":
        return nn.GELU()
    raise NotImplementedError(
        f"DCNv3: act_layer must be 'ReLU', 'SiLU' or 'GELU', but got {act_layer!r}")


def _check_and_set_common(module: nn.Module, channels: int, kernel_size: int, stride: int,
                          pad: int, dilation: int, group: int, offset_scale: float,
                          center_feature_scale: bool, remove_center: bool) -> None:
    """The checks both modules make, and the attributes both keep, named as the originals'."""
    name = type(module).__name__
    for arg, value in (("channels", channels), ("kernel_size", kernel_size),
                       ("stride", stride), ("dilation", dilation), ("group", group)):
        if value < 1:
            raise ValueError(f"{name}: expected {arg} to be at least 1, but got {value}")
    if channels % group:
        raise ValueError(f"{name}: expected channels ({channels}) to be divisible by group "
                         f"({group})")
    # Offsets and mask are predicted at the input's resolution, so the output must have it.
    if stride != 1 or 2 * pad != dilation * (kernel_size - 1):
        raise ValueError(
            f"{name}: the module predicts offsets at the input's resolution, so it needs an "
            f"output of the input's size: stride 1 and pad = dilation * (kernel_size - 1) / 2 "
            f"= {dilation * (kernel_size - 1) / 2:g}, but got stride {stride} and pad {pad}")
    module.offset_scale = offset_scale
    module.channels = channels
    module.kernel_size = kernel_size
    module.stride = stride
    module.dilation = dilation
    module.pad = pad
    module.group = group
    module.group_channels = channels // group
    module.center_feature_scale = center_feature_scale
    module.remove_center = int(remove_center)


def _add_centre_feature_scale(module: nn.Module, wanted: bool, group: int,
                              channels: int) -> None:
    """The originals' plain parameters center_feature_scale_proj_weight and _bias, zero; None
    (absent from the state_dict) when not wanted."""
    for name, shape in (("center_feature_scale_proj_weight", (group, channels)),
                        ("center_feature_scale_proj_bias", (group,))):
        module.register_parameter(name, nn.Parameter(torch.zeros(shape)) if wanted else None)


def _blend_with_centre_feature_scale(x: Tensor, value: Tensor, query: Tensor,
                                     weight: Optional[Tensor], bias: Optional[Tensor],
                                     group_channels: int) -> Tensor:
    """x (1 - a) + value a, with a = sigmoid(query W^T + b) per group, repeated over the
    group's channels; x itself without the parameters."""
    if weight is None or bias is None:
        return x
    scale = torch.sigmoid(F.linear(query, weight, bias))
    scale = scale.repeat_interleave(group_channels, dim=-1)
    return x * (1 - scale) + value * scale


class DCNv3(nn.Module):
    """InternImage's DCNv3 module: (N, H, W, channels) to (N, H, W, channels).

    The input is projected (``input_proj``) and sampled by :func:`deformconv.dcnv3` at
    offsets and softmax-normalised mask values that ``offset`` and ``mask`` predict from a
    depth-wise convolution, norm and activation of the input (``dw_conv``); then
    ``output_proj``. Arguments, attributes and parameters are the original's."""

    def __init__(
        self,
        channels: int = 64,
        kernel_size: int = 3,
        dw_kernel_size: Optional[int] = None,
        stride: int = 1,
        pad: int = 1,
        dilation: int = 1,
        group: int = 4,
        offset_scale: float = 1.0,
        act_layer: str = "GELU",
        norm_layer: str = "LN",
        center_feature_scale: bool = False,
        remove_center: bool = False,
    ) -> None:
        super().__init__()
        # Before the same-size check, which rejects every even kernel too, for the clearer
        # message.
        if remove_center and kernel_size % 2 == 0:
            raise ValueError(f"DCNv3: remove_center needs an odd kernel_size, but got "
                             f"{kernel_size}")
        _check_and_set_common(self, channels, kernel_size, stride, pad, dilation, group,
                              offset_scale, center_feature_scale, remove_center)
        dw_kernel_size = kernel_size if dw_kernel_size is None else dw_kernel_size
        self.dw_kernel_size = dw_kernel_size
        points = group * (kernel_size * kernel_size - self.remove_center)

        self.dw_conv = nn.Sequential(
            nn.Conv2d(channels, channels, dw_kernel_size, stride=1,
                      padding=(dw_kernel_size - 1) // 2, groups=channels),
            _norm_to_channels_last(norm_layer, channels),
            _activation(act_layer))
        self.offset = nn.Linear(channels, points * 2)
        self.mask = nn.Linear(channels, points)
        self.input_proj = nn.Linear(channels, channels)
        self.output_proj = nn.Linear(channels, channels)
        _add_centre_feature_scale(self, center_feature_scale, group, channels)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """The original's initialisation: zero offsets and a uniform mask (zero weights and
        biases before the softmax), Xavier-uniform projections with zero biases."""
        for layer in (self.offset, self.mask):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)
        for layer in (self.input_proj, self.output_proj):
            nn.init.xavier_uniform_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, input: Tensor) -> Tensor:
        # Not while a trace records the graph: its shapes are tensors there, the check a
        # constant of the trace.
        if not torch.jit.is_tracing() and (input.dim() != 4 or input.shape[3] != self.channels):
            raise ValueError(f"DCNv3: expected input of shape (N, H, W, {self.channels}), but "
                             f"got {list(input.shape)}")
        N, H, W, _ = input.shape
        value = self.input_proj(input)
        feature = self.dw_conv(input.permute(0, 3, 1, 2))
        offset = self.offset(feature)
        points = self.kernel_size * self.kernel_size - self.remove_center
        mask = self.mask(feature).reshape(N, H, W, self.group, points)
        mask = F.softmax(mask, -1).reshape(N, H, W, self.group * points).type(value.dtype)
        k = self.kernel_size
        # im2col_step 256 as the original passes; the op takes any batch, and the step changes
        # nothing.
        x = dcnv3(value, offset, mask, k, k, self.stride, self.stride, self.pad, self.pad,
                  self.dilation, self.dilation, self.group, self.group_channels,
                  self.offset_scale, 256, bool(self.remove_center))
        x = _blend_with_centre_feature_scale(x, value, feature,
                                             self.center_feature_scale_proj_weight,
                                             self.center_feature_scale_proj_bias,
                                             self.group_channels)
        return self.output_proj(x)


class DCNv4(nn.Module):
    """FlashInternImage's DCNv4 module: (N, L, channels) to (N, L, channels), the L = H W
    pixels in rows, with ``shape=(H, W)`` (or a square H = W = floor(sqrt(L)) without it).

    The input is projected (``value_proj``) and sampled by :func:`deformconv.dcnv4` at the
    offsets and raw mask values that ``offset_mask`` predicts from the input (after the
    depth-wise ``offset_mask_dw`` when ``dw_kernel_size`` is set); then ``output_proj``.
    Arguments, attributes and parameters are the original's; extra keyword arguments (such as
    DCNv3's ``act_layer``) are accepted and ignored, as there."""

    def __init__(
        self,
        channels: int = 64,
        kernel_size: int = 3,
        stride: int = 1,
        pad: int = 1,
        dilation: int = 1,
        group: int = 4,
        offset_scale: float = 1.0,
        dw_kernel_size: Optional[int] = None,
        center_feature_scale: bool = False,
        remove_center: bool = False,
        output_bias: bool = True,
        without_pointwise: bool = False,
        **kwargs,
    ) -> None:
        super().__init__()
        _check_and_set_common(self, channels, kernel_size, stride, pad, dilation, group,
                              offset_scale, center_feature_scale, remove_center)
        self.dw_kernel_size = dw_kernel_size
        self.without_pointwise = without_pointwise
        self.K = group * (kernel_size * kernel_size - self.remove_center)

        # Submodules that may be None: TorchScript compiles a None attribute as a constant.
        self.offset_mask_dw = None
        if dw_kernel_size is not None:
            self.offset_mask_dw = nn.Conv2d(channels, channels, dw_kernel_size, stride=1,
                                            padding=(dw_kernel_size - 1) // 2, groups=channels)
        # The original pads the 3 K channels to a multiple of 8 for its vector loads.
        self.offset_mask = nn.Linear(channels, int(math.ceil(self.K * 3 / 8) * 8))
        self.value_proj = None
        self.output_proj = None
        if not without_pointwise:
            self.value_proj = nn.Linear(channels, channels)
            self.output_proj = nn.Linear(channels, channels, bias=output_bias)
        _add_centre_feature_scale(self, center_feature_scale, group, channels)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """The original's initialisation: offset_mask zero (so the op's output starts at
        exactly zero), Xavier-uniform projections with zero biases."""
        nn.init.zeros_(self.offset_mask.weight)
        nn.init.zeros_(self.offset_mask.bias)
        for layer in (self.value_proj, self.output_proj):
            if layer is not None:
                nn.init.xavier_uniform_(layer.weight)
                if layer.bias is not None:
                    nn.init.zeros_(layer.bias)

    def forward(self, input: Tensor, shape: Optional[Tuple[int, int]] = None) -> Tensor:
        tracing = torch.jit.is_tracing()  # as in DCNv3.forward
        if not tracing and (input.dim() != 3 or input.shape[2] != self.channels):
            raise ValueError(f"DCNv4: expected input of shape (N, L, {self.channels}), but "
                             f"got {list(input.shape)}")
        N, L, C = input.shape
        if shape is None:
            H = W = int(math.sqrt(L))
        else:
            H, W = shape
        if not tracing and H * W != L:
            raise ValueError(f"DCNv4: expected shape (H, W) with H * W = L = {L}, but got "
                             f"{(H, W)}" + ("" if shape is not None else
                                            " (L is not a square: pass shape=(H, W))"))
        x = input if self.value_proj is None else self.value_proj(input)
        x = x.reshape(N, H, W, C)
        offset_mask_input = input
        if self.offset_mask_dw is not None:
            offset_mask_input = self.offset_mask_dw(input.view(N, H, W, C).permute(0, 3, 1, 2))
            offset_mask_input = offset_mask_input.permute(0, 2, 3, 1).reshape(N, L, C)
        offset_mask = self.offset_mask(offset_mask_input)
        offset_mask = offset_mask.reshape(N, H, W, self.offset_mask.out_features)
        value = x
        k = self.kernel_size
        # im2col_step as in DCNv3.
        x = dcnv4(x, offset_mask, k, k, self.stride, self.stride, self.pad, self.pad,
                  self.dilation, self.dilation, self.group, self.group_channels,
                  self.offset_scale, 256, bool(self.remove_center))
        # The query is the op's output here, where DCNv3's is its depth-wise feature.
        x = _blend_with_centre_feature_scale(x, value, x, self.center_feature_scale_proj_weight,
                                             self.center_feature_scale_proj_bias,
                                             self.group_channels)
        x = x.reshape(N, L, C)
        if self.output_proj is not None:
            x = self.output_proj(x)
        return x
