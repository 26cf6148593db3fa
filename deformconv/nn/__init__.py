"""The modules: mmcv's DCN v1/v2 (deform_conv.py) and InternImage's and FlashInternImage's
DCNv3 and DCNv4 (dcn_v3_v4.py)."""

from .dcn_v3_v4 import DCNv3, DCNv4
from .deform_conv import (
    DeformConv2d,
    DeformConv2dPack,
    ModulatedDeformConv2d,
    ModulatedDeformConv2dPack,
    upgrade_mmcv_state_dict,
)

__all__ = ["DCNv3", "DCNv4", "DeformConv2d", "DeformConv2dPack", "ModulatedDeformConv2d",
           "ModulatedDeformConv2dPack", "upgrade_mmcv_state_dict"]
