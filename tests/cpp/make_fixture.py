"""Writes what the LibTorch test programs check: a scripted model using all four deformconv
modules (model.pt), the same model exported and compiled by AOTInductor into a package
(model.pt2), and its input with the output and gradients computed in eager Python (fixture.pt,
a scripted module holding them as buffers, which C++ reads with torch::jit::load).

    python make_fixture.py <folder>
"""

import sys
import warnings
from pathlib import Path

import torch

import deformconv


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.v2_pack = deformconv.ModulatedDeformConv2dPack(3, 6, 3, padding=1, deform_groups=3)
        self.v1_pack = deformconv.DeformConv2dPack(6, 4, (3, 2), stride=(2, 1), padding=(1, 0),
                                                   dilation=(1, 2), groups=2)
        self.v1 = deformconv.DeformConv2d(4, 4, 1, bias=True)
        self.v2 = deformconv.ModulatedDeformConv2d(4, 2, 1, deform_groups=2)
        with torch.no_grad():
            for layer in (self.v2_pack, self.v1_pack):
                layer.conv_offset.weight.normal_(0, 0.3)

    def forward(self, x):
        y = self.v1_pack(self.v2_pack(x))
        shift = torch.sin(y[:, :2])
        y = self.v1(y, shift)
        mask = torch.sigmoid(y[:, :2])
        return self.v2(y, torch.cat([shift, shift], dim=1), mask)


class Fixture(torch.nn.Module):
    def __init__(self, tensors):
        super().__init__()
        for name, tensor in tensors.items():
            self.register_buffer(name, tensor)


def main(folder):
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = Model().double()
    x = torch.randn(2, 3, 9, 8, dtype=torch.float64, requires_grad=True)
    out = model(x)
    out.pow(2).sum().backward()
    tensors = {
        "input": x.detach(),
        "expected_output": out.detach(),
        "expected_input_grad": x.grad,
        "expected_v2_pack_weight_grad": model.v2_pack.weight.grad,
        "expected_v2_pack_offset_weight_grad": model.v2_pack.conv_offset.weight.grad,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch.jit.save(torch.jit.script(model), str(folder / "model.pt"))
        torch.jit.save(torch.jit.script(Fixture(tensors)), str(folder / "fixture.pt"))
    # The package's kernels call deformconv's ops through the dispatcher, so the C++ program
    # that runs it links the library.
    exported = torch.export.export(model, (x.detach(),))
    torch._inductor.aoti_compile_and_package(exported, package_path=str(folder / "model.pt2"))
    print(f"wrote {folder / 'model.pt'}, {folder / 'model.pt2'} and {folder / 'fixture.pt'}")


if __name__ == "__main__":
    main(sys.argv[1])
