"""Two FlashInternImage-style levels: the op package imported at module level and the core op
built by name from it, as FlashInternImage's model file does."""

import torch
from torch import nn
import DCNv4


class TinyFlashInternImage(nn.Module):
    def __init__(self, core_op="DCNv4", channels=16, groups=(1, 2), num_classes=10):
        super().__init__()
        self.core_op = core_op
        self.stem = nn.Conv2d(3, channels, kernel_size=4, stride=4)
        self.levels = nn.ModuleList()
        self.widen = nn.ModuleList()
        for index, group in enumerate(groups):
            width = channels * 2 ** index
            self.levels.append(getattr(DCNv4, core_op)(
                channels=width, group=group, offset_scale=0.5, dw_kernel_size=None,
                output_bias=False))
            self.widen.append(nn.Linear(width, 2 * width))
        self.head = nn.Linear(2 * channels * 2 ** (len(groups) - 1), num_classes)
        self.apply(self._init_deform_weights)

    def _init_deform_weights(self, m):
        if isinstance(m, getattr(DCNv4, self.core_op)):
            m._reset_parameters()

    def forward(self, x):
        x = self.stem(x)
        N, C, H, W = x.shape
        x = x.flatten(2).transpose(1, 2)  # (N, L, C), L = H W
        for level, widen in zip(self.levels, self.widen):
            x = widen(x + level(x, (H, W)))
        return self.head(x.mean(1))


def build():
    torch.manual_seed(0)
    return TinyFlashInternImage()
