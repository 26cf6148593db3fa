"""``python -m deformconv demo``: deformable against plain convolution on rotated, rescaled
digits.

The data is scikit-learn's bundled digits (1,797 handwritten 8x8 images, no download), enlarged
to 32x32 and randomly rotated and rescaled, so that the shape a filter should look at varies
from image to image: the case deformable convolution was made for. Two small CNNs that differ
only in their middle layers (ModulatedDeformConv2dPack against nn.Conv2d) train side by side
with the same data order; the demo prints both test accuracies and writes two PNGs: the
training curves, and the learned sampling locations of a deformable layer drawn over test
images.
"""

import argparse
import math
import sys
import time
from pathlib import Path
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .nn import ModulatedDeformConv2dPack

IMAGE_SIZE = 32


def load_digits_tensors():
    try:
        from sklearn.datasets import load_digits
        import matplotlib  # noqa: F401  (for the charts, drawn after training)
    except ImportError as error:
        raise SystemExit(f"the demo needs the demo extra's packages, scikit-learn for its data "
                         f"set and matplotlib for its charts ({error.name} is missing): pip "
                         "install scikit-learn matplotlib") from error
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    return images, labels


def augment(images: torch.Tensor, copies: int, generator: torch.Generator) -> torch.Tensor:
    """Each image `copies` times, enlarged to 32x32, rotated by up to +-75 degrees and scaled
    by 0.5-1.1, by one affine resampling."""
    images = images.repeat(copies, 1, 1, 1)
    n = images.shape[0]
    angle = (torch.rand(n, generator=generator) * 2 - 1) * math.radians(75)
    scale = 0.5 + 0.6 * torch.rand(n, generator=generator)
    cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
    theta = torch.stack([torch.stack([cos, -sin, torch.zeros(n)], 1),
                         torch.stack([sin, cos, torch.zeros(n)], 1)], 1)
    grid = F.affine_grid(theta, (n, 1, IMAGE_SIZE, IMAGE_SIZE), align_corners=False)
    return F.grid_sample(images, grid, align_corners=False, padding_mode="zeros")


class SmallCNN(nn.Module):
    """conv -> pool -> two middle layers (deformable or not) -> pool -> linear."""

    def __init__(self, deformable: bool):
        super().__init__()
        middle = ModulatedDeformConv2dPack if deformable else nn.Conv2d
        self.stem = nn.Conv2d(1, 16, 3, padding=1)
        self.middle1 = middle(16, 32, 3, padding=1)
        self.middle2 = middle(32, 32, 3, padding=1)
        self.head = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.stem(x)), 2)          # 16 x 16
        x = F.relu(self.middle1(x))
        x = F.max_pool2d(F.relu(self.middle2(x)), 2)       # 8 x 8
        return self.head(F.adaptive_avg_pool2d(x, 4).flatten(1))


def progress(prefix: str, done: int, total: int, extra: str = "") -> None:
    """A bar redrawn in place on a terminal; nothing where the output is a file or a pipe,
    whose reader would get every redraw (the epoch's summary line follows either way)."""
    if not sys.stdout.isatty():
        return
    width = 30
    filled = int(width * done / total)
    sys.stdout.write(f"\r{prefix} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} {extra}")
    if done == total:
        sys.stdout.write("\n")
    sys.stdout.flush()


def accuracy(model: nn.Module, images, labels, device, batch_size=256) -> float:
    model.eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(images), batch_size):
            x = images[start:start + batch_size].to(device)
            correct += (model(x).argmax(1).cpu() == labels[start:start + batch_size]).sum().item()
    model.train()
    return correct / len(images)


def sampling_locations(layer: ModulatedDeformConv2dPack, features: torch.Tensor, y: int, x: int):
    """(y, x) input positions of the kernel taps of output pixel (y, x) of the first image."""
    with torch.no_grad():
        out = layer.conv_offset(features[:1])
    taps = layer.kernel_size[0] * layer.kernel_size[1]
    offset = torch.cat(torch.chunk(out, 3, dim=1)[:2], dim=1)[0, :2 * taps, y, x].view(taps, 2)
    i = torch.arange(layer.kernel_size[0]).repeat_interleave(layer.kernel_size[1])
    j = torch.arange(layer.kernel_size[1]).repeat(layer.kernel_size[0])
    base_y = y * layer.stride[0] - layer.padding[0] + i * layer.dilation[0]
    base_x = x * layer.stride[1] - layer.padding[1] + j * layer.dilation[1]
    return base_y + offset[:, 0].cpu(), base_x + offset[:, 1].cpu(), base_y, base_x


def plot_curves(history, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (loss_axis, accuracy_axis) = plt.subplots(1, 2, figsize=(10, 4))
    for name, values in history.items():
        epochs = range(1, len(values["loss"]) + 1)
        loss_axis.plot(epochs, values["loss"], marker="o", label=name)
        accuracy_axis.plot(epochs, values["test_accuracy"], marker="o", label=name)
    loss_axis.set(xlabel="epoch", ylabel="training loss", title="training loss")
    accuracy_axis.set(xlabel="epoch", ylabel="test accuracy", title="test accuracy")
    for axis in (loss_axis, accuracy_axis):
        axis.legend()
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_sampling(model: SmallCNN, images, labels, device, path: Path, count: int = 6) -> None:
    """The 9 taps of middle2 at a few output pixels, mapped back to input pixels (the layer
    works at half resolution), over test images: learned (red) against the regular grid
    (blue)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, count, figsize=(2.4 * count, 2.8))
    model.eval()
    for axis, index in zip(axes, range(count)):
        x = images[index:index + 1].to(device)
        with torch.no_grad():
            features = F.relu(model.middle1(F.max_pool2d(F.relu(model.stem(x)), 2)))
        axis.imshow(images[index, 0], cmap="gray")
        for y, x_ in ((5, 5), (8, 8), (10, 6)):
            sy, sx, by, bx = sampling_locations(model.middle2, features, y, x_)
            # feature pixel p covers input pixels 2p, 2p + 1: its centre is 2p + 0.5
            axis.scatter(2 * bx + 0.5, 2 * by + 0.5, s=8, c="tab:blue")
            axis.scatter(2 * sx + 0.5, 2 * sy + 0.5, s=12, c="tab:red")
        axis.set_title(f"label {labels[index].item()}")
        axis.axis("off")
    figure.suptitle("middle2 sampling locations: regular grid (blue), learned (red)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    model.train()


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deformconv demo",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output", default="demo-output", help="folder for the PNGs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args(argv)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)

    generator = torch.Generator().manual_seed(args.seed)
    images, labels = load_digits_tensors()
    order = torch.randperm(len(images), generator=generator)
    test_count = len(images) // 5
    test_index, train_index = order[:test_count], order[test_count:]
    train_images = augment(images[train_index], 4, generator)
    train_labels = labels[train_index].repeat(4)
    test_images = augment(images[test_index], 4, generator)
    test_labels = labels[test_index].repeat(4)
    print(f"data: scikit-learn digits, {len(train_images)} training and {len(test_images)} test "
          f"images of {IMAGE_SIZE}x{IMAGE_SIZE}, randomly rotated and rescaled; "
          f"device {args.device}")

    models = {}
    optimizers = {}
    batches = math.ceil(len(train_images) / args.batch_size)
    schedulers = {}
    for name, deformable in (("deformable", True), ("plain", False)):
        torch.manual_seed(args.seed)
        model = models[name] = SmallCNN(deformable).to(args.device)
        optimizers[name] = torch.optim.Adam(model.parameters(), lr=3e-3)
        schedulers[name] = torch.optim.lr_scheduler.OneCycleLR(
            optimizers[name], max_lr=3e-3, total_steps=args.epochs * batches)
    history = {name: {"loss": [], "test_accuracy": []} for name in models}

    start = time.time()
    for epoch in range(1, args.epochs + 1):
        permutation = torch.randperm(len(train_images), generator=generator)
        totals = {name: 0.0 for name in models}
        for batch in range(batches):
            index = permutation[batch * args.batch_size:(batch + 1) * args.batch_size]
            x = train_images[index].to(args.device)
            y = train_labels[index].to(args.device)
            for name, model in models.items():
                optimizers[name].zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizers[name].step()
                schedulers[name].step()
                totals[name] += loss.item()
            progress(f"epoch {epoch}/{args.epochs}", batch + 1, batches,
                     " ".join(f"{n} {totals[n] / (batch + 1):.3f}" for n in models))
        for name, model in models.items():
            history[name]["loss"].append(totals[name] / batches)
            history[name]["test_accuracy"].append(
                accuracy(model, test_images, test_labels, args.device))
        print(f"epoch {epoch}/{args.epochs}: loss " + ", ".join(
            f"{n} {history[n]['loss'][-1]:.3f}" for n in models) + "; test accuracy " + ", ".join(
            f"{n} {history[n]['test_accuracy'][-1]:.2%}" for n in models))

    print(f"\ntrained {args.epochs} epochs in {time.time() - start:.0f} s")
    for name in models:
        print(f"{name:10s} test accuracy {history[name]['test_accuracy'][-1]:.2%}")
    plot_curves(history, output / "training_curves.png")
    plot_sampling(models["deformable"], test_images, test_labels, args.device,
                  output / "sampling_locations.png")
    print(f"wrote {output / 'training_curves.png'} and {output / 'sampling_locations.png'}")
    return 0
