"""The functional ops over torch.ops.deformconv, and the ops' fake (meta), Autograd, torch.func,
Autocast and DTensor kernels, which importing this package registers."""

from ._sharding import register_when_imported
from .dcnv3 import dcnv3, dcnv4
from .deform_conv2d import deform_conv2d
from .ms_deform_attn import flash_deform_attn, ms_deform_attn

register_when_imported()

__all__ = ["dcnv3", "dcnv4", "deform_conv2d", "flash_deform_attn", "ms_deform_attn"]
