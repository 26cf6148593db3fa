"""``python -m deformconv benchmark``: deformconv against torchvision and a dense convolution.

For each shape, in one process and interleaved (each repeat times every contender once, so
drifts in clock speed or load hit all of them alike), after warm-up: forward, and forward +
backward, of deformconv, ``torchvision.ops.deform_conv2d`` on the same tensors (when installed)
and a dense ``F.conv2d`` of the same geometry, and deformconv's GEMMs alone (gemm_steps); on the
CPU in float32 also the forward of ONNX Runtime's own DeformConv kernel (when onnxruntime is
installed), a one-node model given the same tensors and thread count. Reports medians, the
ratios, the GFLOP/s of the GEMM part, and the peak memory allocated during one forward and
during one forward and backward, with the CPU's model and vector ISA. DCNv3 and DCNv4 run
against the grid_sample formulation, and against the memory roofline: their compulsory bytes
at the bandwidth of a large device-to-device copy measured in the same run. On the CPU (the
default) steps are timed by the wall clock and memory by the profiler; with ``--device cuda``,
by CUDA events around each step and by ``torch.cuda.max_memory_allocated``, on the training
batches of GPU_SHAPES. ``--busy-core`` keeps one core busy with a spinning process for the
run, as a data-loader worker would. A benchmark, not a test: nothing here asserts a time.
"""
import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

import deformconv


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    in_channels: int
    out_channels: int
    height: int
    width: int
    stride: int = 1
    groups: int = 1
    offset_groups: int = 1
    kernel: int = 3
    padding: int = 1

    def output_size(self):
        length = lambda size: (size + 2 * self.padding - self.kernel) // self.stride + 1  # noqa
        return length(self.height), length(self.width)

    def gemm_flops(self) -> int:
        """Multiply-adds x 2 of the convolution proper, which a dense conv does too."""
        out_h, out_w = self.output_size()
        return (2 * self.batch * self.out_channels * (self.in_channels // self.groups)
                * self.kernel * self.kernel * out_h * out_w)


    def describe(self) -> str:
        return (f"N={self.batch} {self.in_channels}->{self.out_channels} "
                f"{self.height}x{self.width} stride {self.stride} groups {self.groups} "
                f"offset groups {self.offset_groups}")


@dataclass(frozen=True)
class Dcnv3Shape:
    """A DCNv3/DCNv4 core op: channels-last (batch, size, size, channels), 3x3, stride 1,
    pad 1, group groups of channels // group channels."""
    name: str
    batch: int
    size: int
    channels: int
    group: int

    def describe(self) -> str:
        return (f"DCNv3/DCNv4 N={self.batch} {self.size}x{self.size}x{self.channels} "
                f"group {self.group} (group_channels {self.channels // self.group}), 3x3")


# ResNet-50 DCN stages at detection resolution (800 x 1333 input), plus batched and grouped
# cases: the table of the CPU performance issue. Then FlashInternImage-T's four stages at
# 224 x 224, batch 4, for DCNv3 and DCNv4.
CPU_SHAPES = [
    Shape("c3", 1, 128, 128, 100, 168),
    Shape("c4", 1, 256, 256, 50, 84),
    Shape("c5", 1, 512, 512, 25, 42),
    Shape("c3-stride2", 1, 128, 128, 200, 336, stride=2),
    Shape("batch", 8, 64, 64, 56, 56, offset_groups=4),
    Shape("grouped", 1, 512, 512, 50, 84, groups=32),
    Dcnv3Shape("fit-stage1", 4, 56, 64, 4),
    Dcnv3Shape("fit-stage2", 4, 28, 128, 8),
    Dcnv3Shape("fit-stage3", 4, 14, 256, 16),
    Dcnv3Shape("fit-stage4", 4, 7, 512, 32),
]
# Training batches on a GPU: the detection stages at batch 8, the batched case at batch 32,
# FlashInternImage-T's stages at batch 64.
GPU_SHAPES = [
    Shape("c3-batch8", 8, 128, 128, 100, 168),
    Shape("c4-batch8", 8, 256, 256, 50, 84),
    Shape("c5-batch8", 8, 512, 512, 25, 42),
    Shape("batch32", 32, 64, 64, 56, 56, offset_groups=4),
    Dcnv3Shape("fit-stage1-batch64", 64, 56, 64, 4),
    Dcnv3Shape("fit-stage2-batch64", 64, 28, 128, 8),
    Dcnv3Shape("fit-stage3-batch64", 64, 14, 256, 16),
    Dcnv3Shape("fit-stage4-batch64", 64, 7, 512, 32),
]
SHAPES = {s.name: s for s in CPU_SHAPES + GPU_SHAPES}
DEFAULT_SHAPES = {"cpu": [s.name for s in CPU_SHAPES], "cuda": [s.name for s in GPU_SHAPES]}


def dcnv3_grid_sample_formulation(input, offset, mask, group, offset_scale):
    """What a CPU user of InternImage runs today: the originals' pure-PyTorch DCNv3
    (dcnv3_core_pytorch) for a 3x3 kernel, stride 1, pad 1, dilation 1, written out from
    what it does: the input zero-padded, float32 sampling
    grids normalised by the padded size, F.grid_sample (bilinear, zeros, align_corners=False),
    the mask, the sum over the points."""
    input = F.pad(input, [0, 0, 1, 1, 1, 1])
    N, padded_h, padded_w, channels = input.shape
    out_h, out_w = offset.shape[1], offset.shape[2]
    group_channels, points = channels // group, 9
    options = dict(dtype=torch.float32, device=input.device)
    # Reference points: the pixel centres of the kernel's centre taps, in the padded frame.
    ref_y = torch.linspace(1.5, 1.5 + out_h - 1, out_h, **options) / padded_h
    ref_x = torch.linspace(1.5, 1.5 + out_w - 1, out_w, **options) / padded_w
    ref = torch.stack(torch.meshgrid(ref_x, ref_y, indexing="xy"), -1)  # (Ho, Wo, 2): x, y
    # The kernel grid, column by column (x outer), about its centre, scaled by offset_scale.
    taps = torch.tensor([(i - 1, j - 1) for i in range(3) for j in range(3)], **options)
    kernel_grid = taps / torch.tensor([padded_w, padded_h], **options) * offset_scale
    scale = torch.tensor([padded_w, padded_h], **options)
    grid = (ref.view(1, out_h, out_w, 1, 1, 2) + kernel_grid.view(1, 1, 1, 1, points, 2)
            + offset.view(N, out_h, out_w, group, points, 2) * offset_scale / scale)
    grid = 2 * grid - 1
    images = input.view(N, padded_h * padded_w, group * group_channels).transpose(1, 2)
    images = images.reshape(N * group, group_channels, padded_h, padded_w)
    grid = grid.view(N, out_h * out_w, group, points, 2).transpose(1, 2).flatten(0, 1)
    samples = F.grid_sample(images, grid.to(input.dtype), mode="bilinear",
                            padding_mode="zeros", align_corners=False)
    weights = mask.view(N, out_h * out_w, group, points).transpose(1, 2)
    weights = weights.reshape(N * group, 1, out_h * out_w, points)
    out = (samples * weights).sum(-1).view(N, channels, out_h * out_w)
    return out.transpose(1, 2).reshape(N, out_h, out_w, channels)


def make_dcnv3_tensors(shape: Dcnv3Shape, dtype: torch.dtype, seed: int = 0,
                       device: str = "cpu"):
    """Input, offsets within a few pixels, and per-group softmax-normalised mask values, as
    the DCNv3 module feeds the op."""
    generator = torch.Generator().manual_seed(seed)
    N, size, points = shape.batch, shape.size, 9
    input = torch.randn(N, size, size, shape.channels, generator=generator)
    offset = torch.randn(N, size, size, shape.group * points * 2, generator=generator) * 2
    logits = torch.randn(N, size, size, shape.group, points, generator=generator)
    mask = logits.softmax(-1).reshape(N, size, size, shape.group * points)
    return [t.to(device=device, dtype=dtype) for t in (input, offset, mask)]


def pack_offset_mask(offset, mask, group: int):
    """DCNv4's offset_mask as its module's Linear layer makes it from the same offsets and mask:
    per group the (x, y) pairs of its points, then their mask values, the channels padded with
    zeros to a multiple of 8."""
    N, H, W, _ = offset.shape
    packed = torch.cat([offset.view(N, H, W, group, -1), mask.view(N, H, W, group, -1)], -1)
    packed = packed.view(N, H, W, -1)
    return F.pad(packed, [0, -packed.shape[-1] % 8])


def dcnv3_contenders(shape: Dcnv3Shape, tensors) -> Dict[str, Tuple[Callable, list]]:
    """Each contender with the inputs its model feeds it: DCNv3 and the formulation the offsets
    and mask that InternImage's DCNv3 makes, DCNv4 the packed offset_mask that
    FlashInternImage's DCNv4 makes in one Linear layer (pack_offset_mask)."""
    group, group_channels, scale = shape.group, shape.channels // shape.group, 1.0
    geometry = (3, 3, 1, 1, 1, 1, 1, 1, group, group_channels, scale)
    input, offset, mask = tensors
    return {
        "dcnv3": (lambda input, offset, mask: deformconv.dcnv3(input, offset, mask, *geometry),
                  [input, offset, mask]),
        "dcnv4": (lambda input, offset_mask: deformconv.dcnv4(input, offset_mask, *geometry),
                  [input, pack_offset_mask(offset, mask, group)]),
        "grid_sample formulation": (
            lambda input, offset, mask: dcnv3_grid_sample_formulation(input, offset, mask,
                                                                      group, scale),
            [input, offset, mask]),
    }


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def copy_bandwidth(device: str, repeats: int, warmup: int) -> dict:
    """The memory roofline's bandwidth, measured in the run: a device-to-device copy of a
    buffer far larger than any cache (1 GiB on a GPU, 256 MiB on the CPU), which reads and
    writes its size once each, so bytes per second = 2 x size / median time."""
    size = (1 << 30) if device == "cuda" else (256 << 20)
    source = torch.ones(size, dtype=torch.uint8, device=device)
    # Written once before the timing, so that no page is first touched inside it.
    target = torch.zeros_like(source)
    seconds = time_interleaved({"copy": lambda: target.copy_(source)}, repeats, warmup,
                               device)["copy"]
    return {"buffer_bytes": size, "median_seconds": seconds,
            "bytes_per_second": 2 * size / seconds}


def dcnv3_roofline(runs, medians: Dict[str, float], bytes_per_second: float) -> dict:
    """The compulsory bytes of DCNv3 and DCNv4, each tensor read or written once: forward, the
    inputs and the output; forward+backward, also the output's gradient and each input's
    gradient, twice the forward's. The roofline time is those bytes at the copy bandwidth; the
    fraction is roofline time / measured time (1: as fast as the memory allows). Small shapes
    whose tensors stay in the GPU's L2 cache from one repeat to the next can exceed 1."""
    report = {"compulsory_bytes": {}, "fraction": {}}
    for name in ("dcnv3", "dcnv4"):
        run, inputs = runs[name]
        with torch.no_grad():
            forward_bytes = tensor_bytes(inputs) + tensor_bytes([run(*inputs)])
        for phase, compulsory in (("forward", forward_bytes),
                                  ("forward+backward", 2 * forward_bytes)):
            report["compulsory_bytes"][f"{name} {phase}"] = compulsory
            report["fraction"][f"{name} {phase}"] = (
                compulsory / bytes_per_second / medians[f"{name} {phase}"])
    return report


def benchmark_dcnv3_shape(shape: Dcnv3Shape, args, bandwidth: Optional[dict]) -> dict:
    dtype = getattr(torch, args.dtype)
    tensors = make_dcnv3_tensors(shape, dtype, device=args.device)
    runs = dcnv3_contenders(shape, tensors)
    steps = {}
    for name, (run, inputs) in runs.items():
        steps[f"{name} forward"] = forward_step(run, inputs)
        steps[f"{name} forward+backward"] = forward_backward_step(run, inputs)
    with torch.no_grad():
        ours = runs["dcnv3"][0](*tensors)
        agreement = {f"{name} max abs difference": (run(*inputs) - ours).abs().max().item()
                     for name, (run, inputs) in runs.items() if name != "dcnv3"}
    medians = time_interleaved(steps, args.repeats, args.warmup, args.device)
    result = {"shape": asdict(shape), "describe": shape.describe(), "median_seconds": medians,
              "ratios": {}, "peak_forward_bytes": {}, "agreement": agreement}
    for phase in ("forward", "forward+backward"):
        peer = medians[f"grid_sample formulation {phase}"]
        for name in ("dcnv3", "dcnv4"):
            result["ratios"][f"grid_sample formulation/{name} {phase}"] = (
                peer / medians[f"{name} {phase}"])
    for name, (run, inputs) in runs.items():
        result["peak_forward_bytes"][name] = peak_forward_bytes(run, inputs, args.device)
    grid_sample_peak = result["peak_forward_bytes"]["grid_sample formulation"]
    for name in ("dcnv3", "dcnv4"):
        result["ratios"][f"grid_sample formulation/{name} peak forward memory"] = (
            grid_sample_peak / result["peak_forward_bytes"][name])
    if bandwidth is not None:
        result["roofline"] = dcnv3_roofline(runs, medians, bandwidth["bytes_per_second"])
    return result


def make_tensors(shape: Shape, dtype: torch.dtype, modulated: bool, seed: int = 0,
                 device: str = "cpu"):
    generator = torch.Generator().manual_seed(seed)
    out_h, out_w = shape.output_size()
    taps = shape.kernel * shape.kernel

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=generator) * scale).to(device=device, dtype=dtype)

    x = randn(shape.batch, shape.in_channels, shape.height, shape.width)
    weight = randn(shape.out_channels, shape.in_channels // shape.groups, shape.kernel,
                   shape.kernel, scale=0.05)
    bias = randn(shape.out_channels)
    offset = randn(shape.batch, 2 * shape.offset_groups * taps, out_h, out_w, scale=2.0)
    mask = (torch.rand(shape.batch, shape.offset_groups * taps, out_h, out_w,
                       generator=generator).to(device=device, dtype=dtype)
            if modulated else None)
    return x, offset, weight, bias, mask


def contenders(shape: Shape, tensors, im2col_step: int) -> Dict[str, Callable]:
    x, offset, weight, bias, mask = tensors
    geometry = dict(stride=shape.stride, padding=shape.padding)
    runs = {
        "deformconv": lambda x, o, w, b, m: deformconv.deform_conv2d(
            x, o, w, b, mask=m, im2col_step=im2col_step, **geometry),
        "dense": lambda x, o, w, b, m: F.conv2d(x, w, b, groups=shape.groups, **geometry),
    }
    try:
        from torchvision.ops import deform_conv2d as torchvision_deform_conv2d
    except ImportError:
        pass
    else:
        runs["torchvision"] = lambda x, o, w, b, m: torchvision_deform_conv2d(
            x, o, w, b, mask=m, **geometry)
    return runs


def onnxruntime_forward(shape: Shape, tensors) -> Optional[Callable[[], object]]:
    """The forward of ONNX Runtime's DeformConv CPU kernel on the same float32 tensors, as a
    one-node model (opset 19) with torch's thread count; None without onnx and onnxruntime."""
    try:
        import numpy as np
        import onnxruntime
        from onnx import TensorProto, helper
    except ImportError:
        return None
    x, offset, weight, bias, mask = tensors
    names = ["X", "W", "offset", "B"] + (["mask"] if mask is not None else [])
    values = [x, weight, offset, bias] + ([mask] if mask is not None else [])
    node = helper.make_node(
        "DeformConv", names, ["Y"], kernel_shape=[shape.kernel, shape.kernel],
        strides=[shape.stride] * 2, pads=[shape.padding] * 4, dilations=[1, 1],
        group=shape.groups, offset_group=shape.offset_groups)
    graph = helper.make_graph(
        [node], "deform_conv",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, list(value.shape))
         for name, value in zip(names, values)],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    # IR version 9 is the one of opset 19, which every onnxruntime since 1.15 reads.
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.inter_op_num_threads = 1
    # Its pool's threads would otherwise spin for a while after each run, taking the cores from
    # the contender timed next.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = onnxruntime.InferenceSession(model.SerializeToString(), options,
                                           providers=["CPUExecutionProvider"])
    feeds = {name: np.ascontiguousarray(value.numpy()) for name, value in zip(names, values)}

    def forward():
        return session.run(None, feeds)[0]

    return forward


def forward_backward_step(run: Callable, tensors) -> Callable[[], None]:
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in tensors]
    grad = None

    def step():
        nonlocal grad
        for t in leaves:
            if t is not None:
                t.grad = None
        out = run(*leaves)
        if grad is None:
            grad = torch.ones_like(out)
        out.backward(grad)

    return step


def gemm_steps(shape: Shape, dtype: torch.dtype,
               device: str = "cpu") -> Dict[str, Callable[[], None]]:
    """The GEMMs of deformconv's im2col formulation alone, whole-size, on random columns in its
    layout (per image and conv group, pixels x taps * channels), in the form deformconv runs
    them: forward, the output; backward, the columns gradient and the weight gradient. On the
    CPU in float32 with one conv group that form is a 1x1 convolution over the columns viewed
    as a channels-last image (oneDNN), elsewhere batched matrix products (bmm). No im2col +
    GEMM implementation can beat them, so they measure how much of the gap to a dense
    convolution is sampling and how much is the GEMMs themselves."""
    out_h, out_w = shape.output_size()
    pixels = out_h * out_w
    matrices = shape.batch * shape.groups
    rows = shape.in_channels // shape.groups * shape.kernel * shape.kernel
    out_per_group = shape.out_channels // shape.groups
    options = dict(device=device, dtype=dtype)
    columns = torch.randn(matrices, pixels, rows).to(**options)
    weight = torch.randn(shape.groups, out_per_group, rows).to(**options)
    grad_output = torch.randn(matrices, out_per_group, pixels).to(**options)
    as_convolution = (device == "cpu" and dtype == torch.float32 and shape.groups == 1
                      and torch.backends.mkldnn.is_available()
                      and torch.backends.mkldnn.enabled)
    if as_convolution:
        image = columns.permute(0, 2, 1).unsqueeze(2)  # (N, rows, 1, pixels), channels-last
        weight_1x1 = weight.view(shape.out_channels, rows, 1, 1)
        grad_image = grad_output.unsqueeze(2)

        def forward():
            torch.mkldnn_convolution(image, weight_1x1, None, [0, 0], [1, 1], [1, 1], 1)

        def forward_backward():
            forward()
            torch.ops.aten.convolution_backward(grad_image, image, weight_1x1, None, [1, 1],
                                                [0, 0], [1, 1], False, [0, 0], 1,
                                                [True, True, False])

        return {"GEMMs alone forward": forward,
                "GEMMs alone forward+backward": forward_backward}

    weight = weight.repeat(shape.batch, 1, 1)
    # Results go to buffers allocated once: the allocation of a fresh columns-sized buffer
    # (page faults) is not GEMM work.
    output, grad_weight = torch.empty_like(grad_output), torch.empty_like(weight)
    grad_columns = torch.empty_like(columns)

    def forward():
        torch.bmm(weight, columns.transpose(1, 2), out=output)

    def forward_backward():
        forward()
        torch.bmm(grad_output.transpose(1, 2), weight, out=grad_columns)
        torch.bmm(grad_output, columns, out=grad_weight)

    return {"GEMMs alone forward": forward, "GEMMs alone forward+backward": forward_backward}


def forward_step(run: Callable, tensors) -> Callable[[], None]:
    def step():
        with torch.no_grad():
            run(*tensors)

    return step


def peak_bytes(step: Callable[[], None], device: str = "cpu") -> int:
    """Peak of live allocations during one run of step, over what was live before it (what the
    step allocates and returns included). On CUDA, from the caching allocator's statistics. On
    the CPU, from the profiler's record of every allocation and free, on every thread that runs
    in the caller's thread-local state, in the order they happened."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as profiler:
        step()
    records = sorted((event for event in profiler.profiler.kineto_results.events()
                      if event.name() == "[memory]"), key=lambda event: event.start_ns())
    live = peak = 0
    for record in records:
        live += record.nbytes()
        peak = max(peak, live)
    return peak


def peak_forward_bytes(run: Callable, tensors, device: str = "cpu") -> int:
    """Peak of live allocations during one forward, the output included."""
    return peak_bytes(forward_step(run, tensors), device)


def peak_forward_backward_bytes(run: Callable, tensors, device: str = "cpu") -> int:
    """Peak of live allocations during one forward and backward from fresh leaves (their
    copies not counted): the output, its gradient, what autograd keeps and every gradient."""
    return peak_bytes(forward_backward_step(run, tensors), device)


def seconds_of(step: Callable[[], None], device: str) -> float:
    """One run of step: by the wall clock on the CPU; on CUDA, whose kernels run asynchronously,
    between two events recorded on the current stream around it."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    start_time = time.perf_counter()
    step()
    return time.perf_counter() - start_time


def time_interleaved(steps: Dict[str, Callable[[], None]], repeats: int,
                     warmup: int, device: str = "cpu") -> Dict[str, float]:
    for _ in range(warmup):
        for step in steps.values():
            step()
    samples: Dict[str, List[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            samples[name].append(seconds_of(step, device))
    return {name: statistics.median(values) for name, values in samples.items()}


def benchmark_shape(shape: Shape, args, bandwidth: Optional[dict] = None) -> dict:
    """One shape's report; bandwidth (copy_bandwidth's) gives DCNv3/DCNv4 their roofline."""
    if isinstance(shape, Dcnv3Shape):
        return benchmark_dcnv3_shape(shape, args, bandwidth)
    dtype = getattr(torch, args.dtype)
    tensors = make_tensors(shape, dtype, modulated=not args.v1, device=args.device)
    runs = contenders(shape, tensors, args.im2col_step)
    if args.no_torchvision:
        runs.pop("torchvision", None)
    steps = {}
    for name, run in runs.items():
        steps[f"{name} forward"] = forward_step(run, tensors)
        steps[f"{name} forward+backward"] = forward_backward_step(run, tensors)
    steps.update(gemm_steps(shape, dtype, args.device))
    onnxruntime_step = (onnxruntime_forward(shape, tensors)
                        if args.device == "cpu" and dtype == torch.float32 else None)
    agreement = {}
    if onnxruntime_step is not None:
        steps["onnxruntime forward"] = onnxruntime_step
        with torch.no_grad():
            ours = runs["deformconv"](*tensors)
        agreement["onnxruntime max abs difference"] = (
            torch.from_numpy(onnxruntime_step()) - ours).abs().max().item()
    medians = time_interleaved(steps, args.repeats, args.warmup, args.device)
    result = {"shape": asdict(shape), "describe": shape.describe(), "median_seconds": medians,
              "ratios": {}, "gemm_gflops_per_second": {}, "peak_forward_bytes": {},
              "agreement": agreement}
    for phase in ("forward", "forward+backward"):
        ours = medians[f"deformconv {phase}"]
        for other in ("torchvision", "dense", "GEMMs alone", "onnxruntime"):
            if f"{other} {phase}" in medians:
                result["ratios"][f"{other}/deformconv {phase}"] = (
                    medians[f"{other} {phase}"] / ours)
        # forward: one GEMM; forward+backward: three (output, columns gradient, weight gradient).
        gemms = 1 if phase == "forward" else 3
        result["gemm_gflops_per_second"][phase] = gemms * shape.gemm_flops() / ours / 1e9
    result["peak_forward_backward_bytes"] = {}
    for name, run in runs.items():
        result["peak_forward_bytes"][name] = peak_forward_bytes(run, tensors, args.device)
        result["peak_forward_backward_bytes"][name] = peak_forward_backward_bytes(
            run, tensors, args.device)
    if "torchvision" in runs:
        peaks = result["peak_forward_backward_bytes"]
        result["ratios"]["torchvision/deformconv peak forward+backward memory"] = (
            peaks["torchvision"] / peaks["deformconv"])
    return result


def print_result(result: dict, out=sys.stdout) -> None:
    medians = result["median_seconds"]
    print(f"\n{result['shape']['name']}: {result['describe']}", file=out)
    for name, seconds in medians.items():
        print(f"  {name:40s} {seconds * 1e3:9.2f} ms", file=out)
    for name, ratio in result["ratios"].items():
        print(f"  {name:58s} {ratio:6.2f}x", file=out)
    for phase, rate in result.get("gemm_gflops_per_second", {}).items():
        print(f"  GEMM GFLOP/s, deformconv {phase:18s} {rate:7.1f}", file=out)
    for name, size in result["peak_forward_bytes"].items():
        print(f"  peak forward memory, {name:24s} {size / 2**20:8.1f} MiB", file=out)
    for name, size in result.get("peak_forward_backward_bytes", {}).items():
        print(f"  peak forward+backward memory, {name:15s} {size / 2**20:8.1f} MiB", file=out)
    for name, fraction in result.get("roofline", {}).get("fraction", {}).items():
        print(f"  memory roofline reached, {name:30s} {fraction:6.1%}", file=out)
    for name, value in result.get("agreement", {}).items():
        print(f"  {name:40s} {value:.2e}", file=out)


# Dashed lines of the chart: the targets of deformconv's performance issues. On the CPU, against
# dense convolution on the single-image shapes: forward at most 1.3x, forward+backward at most
# 1.5x. On a GPU: forward at most 1.5x dense, torchvision at least 3x slower, the grid_sample
# formulation of DCNv3 at least 20x slower.
TARGET_LINES = {"cpu": [(1 / 1.3, "tab:green"), (1 / 1.5, "tab:red")],
                "cuda": [(1 / 1.5, "tab:red"), (3.0, "tab:green"), (20.0, "tab:blue")]}


def plot(results: List[dict], path: str, setup: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["shape"]["name"] for r in results]
    series = sorted({key for r in results for key in r["ratios"]})
    figure, axis = plt.subplots(figsize=(max(6, 1.6 * len(names)), 4.5))
    width = 0.8 / max(1, len(series))
    for i, key in enumerate(series):
        values = [r["ratios"].get(key, float("nan")) for r in results]
        # Bars from parity (1) to the ratio, up where deformconv is faster, down where slower.
        axis.bar([x + i * width for x in range(len(names))], [v - 1 for v in values], width,
                 bottom=1.0, label=key)
    # Logarithmic: ratios span 0.2x to 40x, and 1/2 is as far below 1 as 2 is above.
    axis.set_yscale("log")
    known = [v for r in results for v in r["ratios"].values()]
    axis.set_ylim(min(known + [1.0]) / 1.5, max(known + [1.0]) * 4)
    axis.axhline(1.0, color="black", linewidth=0.8)
    for target, colour in TARGET_LINES[setup["device"]]:
        axis.axhline(target, color=colour, linewidth=0.8, linestyle="--")
    axis.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(names))])
    axis.set_xticklabels(names)
    axis.set_ylabel("time of other / time of deformconv (higher: deformconv faster)")
    where = (setup["gpu"] if setup["device"] == "cuda"
             else f"{setup['vector_isa']} CPU"
             + (f" running {setup['kernels_isa']} kernels"
                if setup["kernels_isa"] != setup["vector_isa"] else "")
             + f", {setup['threads']} threads"
             + (", one core busy" if setup["busy_core"] else ""))
    axis.set_title(f"deformconv on {where}, torch {torch.__version__}")
    axis.legend(fontsize=7, ncol=3, loc="upper left")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


# Environment variables that cap the vector ISA of the libraries' CPU kernels below what the
# CPU has: oneDNN's (dense convolution, and deformconv's GEMMs), MKL's, ATen's own.
ISA_CAP_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
                     "ATEN_CPU_CAPABILITY")


def cpu_description() -> dict:
    """The CPU's model name and vector ISA (from /proc/cpuinfo where there is one), the
    kernels ATen dispatches to on it (torch.backends.cpu.get_cpu_capability), the copies of
    deformconv's CPU kernels this build holds (torch.ops.deformconv._cpu_kernel_copies), and the
    ISA caps set in the environment. An AVX-512 machine runs every contender's AVX2 kernels
    when the copies are "avx2 baseline" and the caps say AVX2: then "kernels_isa" is AVX2."""
    model, flags = platform.processor() or platform.machine(), set()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                if model and flags:
                    break
    isa = next((name for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"),
                                        ("asimd", "NEON")) if flag in flags), "unknown")
    if isa == "unknown" and platform.machine() in ("arm64", "aarch64"):
        isa = "NEON"
    clones = torch.ops.deformconv._cpu_kernel_copies()
    caps = {name: os.environ[name] for name in ISA_CAP_VARIABLES if os.environ.get(name)}
    aten = torch.backends.cpu.get_cpu_capability()
    onednn_cap = caps.get("ONEDNN_MAX_CPU_ISA", caps.get("DNNL_MAX_CPU_ISA", "")).upper()
    capped = (isa == "AVX-512" and clones == "avx2 baseline" and aten == "AVX2"
              and onednn_cap == "AVX2" and caps.get("MKL_ENABLE_INSTRUCTIONS") == "AVX2")
    return {"cpu": model, "vector_isa": isa, "kernels_isa": "AVX2" if capped else isa,
            "aten_cpu_capability": aten, "deformconv_cpu_clones": clones, "isa_caps": caps}


@contextlib.contextmanager
def busy_core(enabled: bool):
    """With enabled, a separate Python process spinning for the duration (yielded; None
    otherwise): one core taken from the benchmark, as a data-loader worker or a second job
    takes it."""
    if not enabled:
        yield None
        return
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # let it be scheduled before the first timing
        yield spinner
    finally:
        spinner.kill()
        spinner.wait()


def scaling(args) -> dict:
    """Time against batch and image area (should be linear), peak memory against
    im2col_step (bounded by the step, not the batch)."""
    dtype = getattr(torch, args.dtype)
    report = {"batch": {}, "area": {}, "im2col_step_peak_bytes": {}}
    for batch in (1, 2, 4, 8):
        shape = Shape("scaling", batch, 64, 64, 40, 40)
        tensors = make_tensors(shape, dtype, True, device=args.device)
        step = forward_backward_step(contenders(shape, tensors, 0)["deformconv"], tensors)
        report["batch"][batch] = time_interleaved({"x": step}, args.repeats, args.warmup,
                                                    args.device)["x"]
        print(f"  batch {batch}: forward+backward {report['batch'][batch] * 1e3:.2f} ms")
    for side in (20, 40, 80):
        shape = Shape("scaling", 1, 64, 64, side, side)
        tensors = make_tensors(shape, dtype, True, device=args.device)
        step = forward_backward_step(contenders(shape, tensors, 0)["deformconv"], tensors)
        report["area"][side * side] = time_interleaved({"x": step}, args.repeats,
                                                       args.warmup, args.device)["x"]
        print(f"  {side}x{side}: forward+backward {report['area'][side * side] * 1e3:.2f} ms")
    shape = Shape("scaling", 16, 64, 64, 40, 40)
    tensors = make_tensors(shape, dtype, True, device=args.device)
    for step_size in (1, 2, 4, 8, 16):
        run = contenders(shape, tensors, step_size)["deformconv"]
        peak = peak_forward_bytes(run, tensors, args.device)
        report["im2col_step_peak_bytes"][step_size] = peak
        print(f"  batch 16, im2col_step {step_size:2d}: peak forward memory "
              f"{peak / 2**20:.1f} MiB")
    return report


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deformconv benchmark",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=None,
                        help="default: the device's set, "
                        f"cpu: {' '.join(DEFAULT_SHAPES['cpu'])}; "
                        f"cuda: {' '.join(DEFAULT_SHAPES['cuda'])}")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: the current GPU, timed with CUDA events")
    parser.add_argument("--dtype", choices=["float32", "float64", "float16", "bfloat16"],
                        default="float32")
    parser.add_argument("--im2col-step", type=int, default=0)
    parser.add_argument("--v1", action="store_true", help="DCN v1 (no mask); default v2")
    parser.add_argument("--no-torchvision", action="store_true")
    parser.add_argument("--scaling", action="store_true",
                        help="also report scaling with batch, area and im2col_step")
    parser.add_argument("--busy-core", action="store_true",
                        help="keep one core busy with a spinning process during the run")
    parser.add_argument("--output", default="benchmark.json", help="JSON results file")
    parser.add_argument("--plot", default="benchmark.png", help="PNG chart of the ratios "
                        "(needs matplotlib; '' to skip)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    if args.device == "cuda" and not deformconv.cuda_compiled():
        parser.error("--device cuda: this build of deformconv holds no CUDA kernels "
                     "(python -m deformconv info says why)")
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = args.shapes or DEFAULT_SHAPES[args.device]
    if args.device == "cuda":
        # float32 timed as float32: no contender's cuBLAS or cuDNN call may round to TF32.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

    setup = {**cpu_description(), "device": args.device, "busy_core": args.busy_core,
             "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
             "cuda": torch.version.cuda if args.device == "cuda" else None,
             "cudnn": torch.backends.cudnn.version() if args.device == "cuda" else None,
             "threads": torch.get_num_threads(), "torch": torch.__version__,
             "deformconv": deformconv.__version__, "dtype": args.dtype,
             "modulated": not args.v1, "repeats": args.repeats, "warmup": args.warmup,
             "im2col_step": args.im2col_step,
             "tf32": ({"matmul": torch.backends.cuda.matmul.allow_tf32,
                       "cudnn": torch.backends.cudnn.allow_tf32}
                      if args.device == "cuda" else None)}
    if any(isinstance(SHAPES[name], Dcnv3Shape) for name in shapes):
        setup["copy_bandwidth"] = copy_bandwidth(args.device, args.repeats, args.warmup)
    print("setup:", json.dumps(setup))
    results = []
    report = {"setup": setup, "results": results}
    with busy_core(args.busy_core):
        for index, name in enumerate(shapes, 1):
            print(f"[{index}/{len(shapes)}] {name} ...", flush=True)
            results.append(benchmark_shape(SHAPES[name], args, setup.get("copy_bandwidth")))
            print_result(results[-1])
        if args.scaling:
            print("\nscaling:")
            report["scaling"] = scaling(args)
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nwrote {args.output}")
    if args.plot:
        plot(results, args.plot, setup)
        print(f"wrote {args.plot}")
    return 0
