"""``python -m deformconv benchmark-transformers``: whole transformers models, routed to
deformconv (``deformconv.integrations.use_for("transformers")``) and on their own code.

Two models of Hugging Face transformers, built from their configs with random weights (nothing
downloaded): Deformable DETR with a ResNet-50 (transformers' own ResNet, not timm's; the
config's defaults: 4 levels, 6 encoder and 6 decoder layers, 300 queries) at COCO's
800 x 1066, and Mask2Former with a ResNet-50 (its pixel decoder's 6 MSDA layers over 3 levels,
10 decoder layers, 100 queries) at ADE20K's 512 x 512. For each, one model, and in one process,
interleaved after warm-up (each repeat runs every contender once; the routing is switched
between them, untimed): inference (eval mode, no gradients) and one training step (train mode,
the model's own loss against fixed random targets, backward, SGD), routed and on transformers'
own grid_sample code. Also the time spent inside MSDA in each, and each one's peak memory.

The time inside MSDA is taken at the three places that the routing replaces, around whatever
is there: a forward call by the wall clock around it; its backward as the interval between the
gradient's arrival at the call's output and the moment the gradients of its inputs are
complete, marked by two identity autograd functions on each side of the call. The CPU's
autograd engine runs on the calling thread, highest sequence number first, so the nodes
created inside the call run together between the two marks. Peak memory as in ``python -m
deformconv benchmark`` (the profiler's record of the calling thread's allocations). CPU only;
a benchmark, not a test: nothing here asserts a time. Needs transformers and scipy (the
detection loss's matching).
"""

import argparse
import contextlib
import importlib.util
import json
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

import deformconv
from .environment import cpu_description
from .timing import peak_bytes
from ..integrations import restore, transformers_models, use_for

DEFAULT_IMAGES = {"deformable-detr": (800, 1066), "mask2former": (512, 512)}


class _Call:
    """One MSDA call's backward: when the gradient reached its output."""

    def __init__(self, clock: "MsdaClock"):
        self.clock, self.started = clock, None


class _OutputMark(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: _Call, output: Tensor) -> Tensor:
        ctx.call = call
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        ctx.call.started = time.perf_counter()
        return None, grad


class _InputMark(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: _Call, *inputs: Tensor):
        ctx.call = call
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    def backward(ctx, *grads):
        call = ctx.call
        if call.started is not None:
            call.clock.seconds += time.perf_counter() - call.started
        return (None, *grads)


class MsdaClock:
    """Seconds spent inside MSDA (forward calls and their backwards) and the calls counted,
    while installed in a modeling module by :meth:`installed`."""

    def __init__(self):
        self.seconds, self.calls = 0.0, 0

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0

    def timed(self, function: Callable) -> Callable:
        def run(*args, **kwargs):
            args = list(args)
            marked = [i for i, a in enumerate(args)
                      if isinstance(a, Tensor) and a.requires_grad]
            call = _Call(self)
            if marked and torch.is_grad_enabled():
                for i, t in zip(marked, _InputMark.apply(call, *(args[i] for i in marked))):
                    args[i] = t
            start = time.perf_counter()
            output = function(*args, **kwargs)
            self.seconds += time.perf_counter() - start
            self.calls += 1
            if output.requires_grad:
                output = _OutputMark.apply(call, output)
            return output

        return run

    @contextlib.contextmanager
    def installed(self, module):
        """Wraps each routed form that the modeling module holds, whatever is there now (the
        routed one or transformers' own), and puts it back on leaving."""
        put_back = []
        for name in transformers_models.FORMS:
            target = vars(module).get(name)
            if isinstance(target, type):
                original = vars(target)["forward"]
                put_back.append((target, "forward", original))
                target.forward = self.timed(original)
            elif target is not None:
                put_back.append((module, name, target))
                setattr(module, name, self.timed(target))
        try:
            yield self
        finally:
            for owner, name, original in put_back:
                setattr(owner, name, original)


def deformable_detr(image: Tuple[int, int]):
    """(model, its modeling module, the keyword arguments of its loss's targets, the names of
    the outputs to compare); the image's size is that of the targets' masks where they have
    any."""
    import transformers as T
    from transformers.models.deformable_detr import modeling_deformable_detr

    backbone = T.ResNetConfig(out_features=["stage2", "stage3", "stage4"])
    config = T.DeformableDetrConfig(use_timm_backbone=False, use_pretrained_backbone=False,
                                    backbone_config=backbone)
    model = T.DeformableDetrForObjectDetection(config)
    generator = torch.Generator().manual_seed(0)
    objects = 8
    boxes = torch.cat([0.2 + 0.6 * torch.rand(objects, 2, generator=generator),
                       0.05 + 0.3 * torch.rand(objects, 2, generator=generator)], 1)
    targets = {"labels": [{"class_labels": torch.randint(0, config.num_labels, (objects,),
                                                         generator=generator),
                           "boxes": boxes}]}
    return model, modeling_deformable_detr, targets, ("logits", "pred_boxes")


def mask2former(image: Tuple[int, int]):
    import transformers as T
    from transformers.models.mask2former import modeling_mask2former

    backbone = T.ResNetConfig(out_features=["stage1", "stage2", "stage3", "stage4"])
    config = T.Mask2FormerConfig(backbone_config=backbone, use_pretrained_backbone=False,
                                 num_labels=150)
    model = T.Mask2FormerForUniversalSegmentation(config)
    generator = torch.Generator().manual_seed(0)
    objects = 8
    # Masks at the image's size, as the image processor gives them: rectangles.
    masks = torch.zeros(objects, *image)
    for mask in masks:
        top, left = (int(torch.randint(0, size // 2, (), generator=generator)) for size in image)
        mask[top:top + image[0] // 3, left:left + image[1] // 3] = 1
    targets = {"mask_labels": [masks],
               "class_labels": [torch.randint(0, config.num_labels, (objects,),
                                              generator=generator)]}
    return model, modeling_mask2former, targets, ("class_queries_logits", "masks_queries_logits")


BUILDERS = {"deformable-detr": deformable_detr, "mask2former": mask2former}
MODELS = tuple(BUILDERS)


def _steps(model, images: Tensor, targets: dict) -> Dict[str, Callable[[], None]]:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)

    def inference():
        model.eval()
        with torch.no_grad():
            model(pixel_values=images)

    def training_step():
        model.train()
        loss = model(pixel_values=images, **targets).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return {"inference": inference, "training step": training_step}


@contextlib.contextmanager
def _routing(routed: bool):
    if routed:
        use_for("transformers")
    try:
        yield
    finally:
        if routed:
            restore("transformers")


ROUTES = {"transformers": False, "deformconv": True}


def benchmark_model(name: str, image: Tuple[int, int], repeats: int, warmup: int) -> dict:
    torch.manual_seed(0)
    model, module, targets, outputs = BUILDERS[name](image)
    images = torch.randn(1, 3, *image, generator=torch.Generator().manual_seed(1))
    steps = _steps(model, images, targets)
    contenders = {f"{route} {step}": (routed, run) for step, run in steps.items()
                  for route, routed in ROUTES.items()}
    clock = MsdaClock()
    total: Dict[str, List[float]] = {key: [] for key in contenders}
    inside: Dict[str, List[float]] = {key: [] for key in contenders}
    calls: Dict[str, int] = {}
    for repeat in range(warmup + repeats):
        for key, (routed, run) in contenders.items():
            with _routing(routed), clock.installed(module):
                clock.reset()
                start = time.perf_counter()
                run()
                seconds = time.perf_counter() - start
            calls[key] = clock.calls
            if repeat >= warmup:
                total[key].append(seconds)
                inside[key].append(clock.seconds)
    peaks = {}
    for key, (routed, run) in contenders.items():
        with _routing(routed):
            peaks[key] = peak_bytes(run)
    # The same weights through both: eval mode, no gradients (dropout off).
    model.eval()
    results = {}
    for route, routed in ROUTES.items():
        with _routing(routed), torch.no_grad():
            results[route] = model(pixel_values=images)
    agreement = {output: (results["transformers"][output]
                          - results["deformconv"][output]).abs().max().item()
                 for output in outputs}
    median = {key: statistics.median(values) for key, values in total.items()}
    msda = {key: statistics.median(values) for key, values in inside.items()}
    return {
        "model": name, "image": list(image), "msda_calls": calls,
        "parameters": sum(p.numel() for p in model.parameters()),
        "median_seconds": median, "msda_median_seconds": msda,
        "peak_bytes": peaks,
        "speedups": {step: median[f"transformers {step}"] / median[f"deformconv {step}"]
                     for step in steps}
                    | {f"MSDA in {step}": msda[f"transformers {step}"]
                       / msda[f"deformconv {step}"] for step in steps},
        "agreement": {f"{output} max abs difference": value
                      for output, value in agreement.items()},
    }


def print_model(result: dict, out=None) -> None:
    out = sys.stdout if out is None else out
    height, width = result["image"]
    print(f"\n{result['model']} ({height} x {width})", file=out)
    for key, seconds in result["median_seconds"].items():
        msda = result["msda_median_seconds"][key]
        print(f"  {key:34s} {seconds * 1e3:9.1f} ms, MSDA {msda * 1e3:8.1f} ms "
              f"({result['msda_calls'][key]} calls, {msda / seconds:4.0%}), peak "
              f"{result['peak_bytes'][key] / 2**20:7.1f} MiB", file=out)
    for key, ratio in result["speedups"].items():
        print(f"  transformers / deformconv, {key:24s} {ratio:6.2f}x", file=out)
    for key, value in result["agreement"].items():
        print(f"  {key:40s} {value:.2e}", file=out)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deformconv benchmark-transformers",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--image", nargs=2, type=int, metavar=("HEIGHT", "WIDTH"),
                        default=None, help="the input size of every model (default: "
                        + ", ".join(f"{m} {h} x {w}" for m, (h, w) in DEFAULT_IMAGES.items())
                        + ")")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--output", default="benchmark-transformers.json")
    args = parser.parse_args(argv)
    missing = [package for package in ("transformers", "scipy")
               if importlib.util.find_spec(package) is None]
    if missing:
        parser.error(f"needs {' and '.join(missing)} (pip install {' '.join(missing)})")
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    setup = {**cpu_description(), "device": "cpu", "threads": torch.get_num_threads(),
             "torch": torch.__version__, "transformers": transformers.__version__,
             "deformconv": deformconv.__version__, "dtype": "float32", "batch": 1,
             "repeats": args.repeats, "warmup": args.warmup}
    print("setup:", json.dumps(setup))
    results = []
    for name in args.models:
        image = tuple(args.image) if args.image else DEFAULT_IMAGES[name]
        results.append(benchmark_model(name, image, args.repeats, args.warmup))
        print_model(results[-1])
    with open(args.output, "w") as f:
        json.dump({"setup": setup, "models": results}, f, indent=1)
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
