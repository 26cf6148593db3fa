"""Whole-model CPU speed of InternImage-T: the original pure-PyTorch DCNv3 against deformconv,
and how much of each model's time its DCNv3 core takes.

    python tools/benchmark_internimage.py --internimage PATH [--threads 2] [--output FILE]

PATH is a checkout of github.com/OpenGVLab/InternImage; timm must be installed. Two InternImage-T
models are built from its unchanged classification/models/intern_image.py with the same
weights: core_op='DCNv3_pytorch' on the original ops_dcnv3 package (its CUDA extension is not
needed for that path: empty stand-ins take the place of the extension module and of the
pkg_resources lookup of its version), and core_op='DCNv3' on deformconv
(deformconv.integrations). Interleaved, after warm-up, the medians of: a forward (eval mode,
no gradients) and a training step (train mode, cross-entropy, backward, SGD), batch 1 at
224 x 224; and, for each model, the time spent inside its DCNv3 core (the original's
dcnv3_core_pytorch, deformconv's dcnv3 op) during a forward, by wrapping the function each
module calls. Writes the JSON report.
"""

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

import deformconv
import deformconv.nn.dcnv3 as deformconv_modules
import deformconv.integrations
from deformconv.benchmarks.environment import cpu_description
from deformconv.benchmarks.timing import time_interleaved

INTERNIMAGE_T = dict(channels=64, depths=[4, 4, 18, 4], groups=[4, 8, 16, 32],
                     offset_scale=1.0, mlp_ratio=4.0, post_norm=False, layer_scale=None)


def original_and_deformconv_models(checkout: Path):
    """(original pure-PyTorch model, deformconv model), the same weights."""
    sys.modules["DCNv3"] = types.ModuleType("DCNv3")
    sys.modules["pkg_resources"] = types.SimpleNamespace(
        get_distribution=lambda name: types.SimpleNamespace(version="1.0"))
    sys.path.insert(0, str(checkout / "classification"))
    import ops_dcnv3.modules.dcnv3 as original_module
    from models import intern_image

    torch.manual_seed(0)
    original = intern_image.InternImage(core_op="DCNv3_pytorch", **INTERNIMAGE_T)
    # The model file has bound the original package as opsm; the deformconv model is built
    # from the stand-in that use_for registers, bound the same way.
    deformconv.integrations.use_for("internimage")
    intern_image.opsm = sys.modules["ops_dcnv3"].modules
    ours = intern_image.InternImage(core_op="DCNv3", **INTERNIMAGE_T)
    ours.load_state_dict(original.state_dict(), strict=True)
    return original, ours, original_module


class CoreTimer:
    """Wraps module_namespace.name, summing the wall time of its calls while enabled."""

    def __init__(self, namespace, name):
        self.seconds, self.enabled = 0.0, False
        function = getattr(namespace, name)

        def timed(*args, **kwargs):
            if not self.enabled:
                return function(*args, **kwargs)
            start = time.perf_counter()
            result = function(*args, **kwargs)
            self.seconds += time.perf_counter() - start
            return result

        setattr(namespace, name, timed)

    def during(self, run, repeats):
        samples = []
        for _ in range(repeats):
            self.seconds, self.enabled = 0.0, True
            run()
            self.enabled = False
            samples.append(self.seconds)
        return statistics.median(samples)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--internimage", type=Path, required=True,
                        help="a checkout of github.com/OpenGVLab/InternImage")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--output", default="benchmark_internimage.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    original, ours, original_module = original_and_deformconv_models(args.internimage)
    images = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([3])
    models = {"original": original, "deformconv": ours}

    def forward(model):
        def run():
            model.eval()
            with torch.no_grad():
                model(images)
        return run

    def training_step(model):
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

        def run():
            model.train()
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(images), labels).backward()
            optimizer.step()
        return run

    with torch.no_grad():
        difference = (original.eval()(images) - ours.eval()(images)).abs().max().item()
    steps = {}
    for name, model in models.items():
        steps[f"{name} forward"] = forward(model)
        steps[f"{name} training step"] = training_step(model)
    medians = time_interleaved(steps, args.repeats, args.warmup)
    core = {"original": CoreTimer(original_module, "dcnv3_core_pytorch"),
            "deformconv": CoreTimer(deformconv_modules, "dcnv3")}
    core_seconds = {name: core[name].during(forward(models[name]), args.repeats)
                    for name in models}
    report = {
        "setup": {**cpu_description(), "threads": torch.get_num_threads(),
                  "torch": torch.__version__, "deformconv": deformconv.__version__,
                  "model": "InternImage-T", "batch": 1, "size": 224,
                  "repeats": args.repeats, "warmup": args.warmup},
        "median_seconds": medians,
        "core_seconds_in_forward": core_seconds,
        "speedups": {
            "forward": medians["original forward"] / medians["deformconv forward"],
            "training step": (medians["original training step"]
                              / medians["deformconv training step"]),
            "DCNv3 core in the forward": core_seconds["original"] / core_seconds["deformconv"],
        },
        "core_share_of_forward": {name: core_seconds[name] / medians[f"{name} forward"]
                                  for name in models},
        "max_abs_logit_difference": difference,
    }
    print(json.dumps(report, indent=1))
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
