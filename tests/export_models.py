"""What the export tests share: the two ONNX exporters as pytest parameters, and the models
they export at geometries that exercise every setting."""

import pytest
import torch

import deformconv

# torch.export's exporter, and the legacy TorchScript one, which torch deprecates when asked
# for it (dynamo=False): that warning is torch's answer to the request.
EXPORTERS = [pytest.param(True, id="dynamo"),
             pytest.param(False, id="torchscript", marks=pytest.mark.filterwarnings(
                 "ignore:You are using the legacy TorchScript-based ONNX export"))]


class TwoLayerNet(torch.nn.Module):
    """DCN v2 then v1, with groups, deform groups, stride, non-square padding and dilation."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = deformconv.ModulatedDeformConv2dPack(4, 6, 3, padding=1, deform_groups=2,
                                                          bias=False)
        self.second = deformconv.DeformConv2dPack(6, 4, (3, 2), stride=(2, 1), padding=(1, 0),
                                                  dilation=(1, 2), groups=2, bias=True)
        with torch.no_grad():
            for layer in (self.first, self.second):
                layer.conv_offset.weight.normal_(0, 0.3)

    def forward(self, x):
        return self.second(self.first(x))


class Dcnv4Op(torch.nn.Module):
    """The functional DCNv4 op at a geometry the modules cannot have: stride 2, unequal
    padding, a non-square kernel with dilation, remove_center."""

    def forward(self, input, offset_mask):
        return deformconv.dcnv4(input, offset_mask, 2, 3, 2, 1, 1, 2, 2, 1, 1, 2, 0.5, 0, True)
