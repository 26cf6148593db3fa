"""``python -m deformconv benchmark-training``: a whole training step with DCN v2 in it.

torchvision's ResNet-50 with each 3x3 convolution of layer3 and layer4 (9 of them) replaced by
DCN v2 (``ModulatedDeformConv2dPack``, offsets and mask predicted from the block's input), as
detectors place DCN in their backbones. Timed, interleaved in one process as in ``python -m
deformconv benchmark``: one step (forward under autocast, cross-entropy, backward, SGD with
momentum) of that model on deformconv, of the same model on ``torchvision.ops.deform_conv2d``,
with the same weights, and of the plain ResNet-50. Channels-last, batch 32 of 224 x 224 by
default. Reports the medians, the ratios, and how far the two DCN models' logits are apart on
the first batch. A benchmark, not a test: nothing here asserts a time.
"""

import argparse
import json
import sys
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import deformconv
from .timing import time_interleaved
from ..nn import ModulatedDeformConv2dPack


class TorchvisionModulatedDeformConv2dPack(ModulatedDeformConv2dPack):
    """The same module, parameters and offset layout on ``torchvision.ops.deform_conv2d``."""

    def _deform_conv(self, x: Tensor, offset: Tensor, mask: Optional[Tensor]) -> Tensor:
        from torchvision.ops import deform_conv2d

        return deform_conv2d(x, offset, self.weight, self.bias, stride=self.stride,
                             padding=self.padding, dilation=self.dilation, mask=mask)


def dcn_resnet50(pack=ModulatedDeformConv2dPack, seed: int = 0) -> nn.Module:
    """ResNet-50 with DCN v2 as conv2 of every block of layer3 and layer4; the offset layers
    drawn with a small spread rather than zero, so that the samples fall between pixels."""
    import torchvision

    torch.manual_seed(seed)
    model = torchvision.models.resnet50()
    for layer in (model.layer3, model.layer4):
        for block in layer:
            conv = block.conv2
            dcn = pack(conv.in_channels, conv.out_channels, 3, stride=conv.stride, padding=1)
            dcn.weight.data.copy_(conv.weight.data)
            nn.init.normal_(dcn.conv_offset.weight, std=0.01)
            block.conv2 = dcn
    return model


def models(device: str) -> Dict[str, nn.Module]:
    """The three contenders, channels-last on device; the two DCN models with equal weights."""
    import torchvision

    ours = dcn_resnet50(pack=ModulatedDeformConv2dPack)
    peer = dcn_resnet50(pack=TorchvisionModulatedDeformConv2dPack)
    peer.load_state_dict(ours.state_dict())
    torch.manual_seed(0)
    plain = torchvision.models.resnet50()
    return {name: model.to(device=device, memory_format=torch.channels_last)
            for name, model in (("deformconv", ours), ("torchvision", peer), ("plain", plain))}


def training_step(model: nn.Module, images: Tensor, labels: Tensor, autocast_dtype):
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step():
        with torch.autocast(images.device.type, dtype=autocast_dtype,
                            enabled=autocast_dtype is not None):
            loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def dcn_logit_difference(contenders: Dict[str, nn.Module], images: Tensor,
                         autocast_dtype) -> float:
    """The largest difference between the two DCN models' logits, in eval mode: batch
    normalisation of training mode over a tiny batch and 1x1 maps divides by a standard
    deviation near zero, and would amplify float32 rounding into large differences."""
    logits = []
    for name in ("deformconv", "torchvision"):
        model = contenders[name].eval()
        with torch.no_grad(), torch.autocast(images.device.type, dtype=autocast_dtype,
                                             enabled=autocast_dtype is not None):
            logits.append(model(images).float())
        model.train()
    return (logits[0] - logits[1]).abs().max().item()


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deformconv benchmark-training",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--autocast", choices=["bfloat16", "float16", "none"],
                        default="bfloat16")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--output", default="benchmark-training.json")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    autocast_dtype = None if args.autocast == "none" else getattr(torch, args.autocast)
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(args.batch, 3, args.size, args.size, generator=generator)
    images = images.to(args.device).contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (args.batch,), generator=generator).to(args.device)
    contenders = models(args.device)
    agreement = dcn_logit_difference(contenders, images, autocast_dtype)
    steps = {name: training_step(model, images, labels, autocast_dtype)
             for name, model in contenders.items()}
    medians = time_interleaved(steps, args.repeats, args.warmup, args.device)
    report = {
        "setup": {"device": args.device, "batch": args.batch, "size": args.size,
                  "autocast": args.autocast, "channels_last": True,
                  "repeats": args.repeats, "warmup": args.warmup,
                  "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
                  "torch": torch.__version__, "cuda": torch.version.cuda,
                  "deformconv": deformconv.__version__,
                  "dcn_layers": sum(isinstance(m, ModulatedDeformConv2dPack)
                                    for m in contenders["deformconv"].modules()),
                  "tf32": False if args.device == "cuda" else None},
        "median_seconds": medians,
        "ratios": {"torchvision/deformconv step": medians["torchvision"] / medians["deformconv"],
                   "deformconv/plain step": medians["deformconv"] / medians["plain"]},
        "agreement": {"torchvision max abs logit difference": agreement},
    }
    for name, seconds in medians.items():
        print(f"  {name:12s} step {seconds * 1e3:9.2f} ms")
    for name, ratio in report["ratios"].items():
        print(f"  {name:32s} {ratio:6.2f}x")
    print(f"  logits, torchvision vs deformconv: max abs difference {agreement:.2e}")
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
