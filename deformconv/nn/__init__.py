"""The modules: mmcv's DCN v1/v2 (deform_conv.py), InternImage's and FlashInternImage's DCNv3
and DCNv4 (dcnv3.py), and Deformable DETR's, mmcv's and DCNv4's multi-scale deformable
attention (ms_deform_attn.py)."""

from .dcnv3 import DCNv3, DCNv4
from .deform_conv import (
    DeformConv2d,
    DeformConv2dPack,
    ModulatedDeformConv2d,
    ModulatedDeformConv2dPack,
    upgrade_mmcv_state_dict,
)
from .ms_deform_attn import FlashDeformAttn, MSDeformAttn, MultiScaleDeformableAttention

__all__ = ["DCNv3", "DCNv4", "DeformConv2d", "DeformConv2dPack", "FlashDeformAttn",
           "ModulatedDeformConv2d",
           "ModulatedDeformConv2dPack", "MSDeformAttn", "MultiScaleDeformableAttention",
           "upgrade_mmcv_state_dict"]
