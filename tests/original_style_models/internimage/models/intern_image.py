"""Two InternImage-style levels: the core op built by name from the op package imported at
module level, as InternImage's model files do."""

import torch
from torch import nn
from ops_dcnv3 import modules as opsm


class TinyInternImage(nn.Module):
    def __init__(self, core_op="DCNv3", channels=16, groups=(2, 4), num_classes=10):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, kernel_size=4, stride=4)
        self.levels = nn.ModuleList()
        self.widen = nn.ModuleList()
        for index, group in enumerate(groups):
            width = channels * 2 ** index
            self.levels.append(getattr(opsm, core_op)(
                channels=width, kernel_size=3, stride=1, pad=1, dilation=1, group=group,
                offset_scale=1.0, act_layer="GELU", norm_layer="LN", dw_kernel_size=None,
                center_feature_scale=False, remove_center=False))
            self.widen.append(nn.Linear(width, 2 * width))
        self.head = nn.Linear(2 * channels * 2 ** (len(groups) - 1), num_classes)

    def forward(self, x):
        x = self.stem(x).permute(0, 2, 3, 1)  # channels-last, as the core op takes it
        for level, widen in zip(self.levels, self.widen):
            x = widen(x + level(x))
        return self.head(x.mean((1, 2)))


def build(core_op):
    torch.manual_seed(0)
    return TinyInternImage(core_op=core_op)
