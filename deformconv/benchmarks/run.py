"""One shape's report: every contender's medians, the ratios, peak memory, the GEMMs' rate,
DCNv3/DCNv4 and multi-scale deformable attention against the memory roofline; and the scaling
report."""

from dataclasses import asdict
from typing import Dict, Optional

import torch

from .contenders import (contenders, dcnv3_contenders, dcnv3_geometry, gemm_steps,
                         msda_contenders)
from .originals import PEERS, original_contenders
from .runtimes import RUNTIMES, form_forwards
from .shapes import (Dcnv3Shape, MsdaShape, Shape, make_dcnv3_tensors, make_msda_tensors,
                     make_tensors)
from .timing import (forward_backward_step, forward_step, peak_forward_backward_bytes,
                     peak_forward_bytes, time_interleaved)

def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def roofline(runs, medians: Dict[str, float], bytes_per_second: float, ops) -> dict:
    """The compulsory bytes of each of ops, each tensor read or written once: forward, the
    inputs and the output; forward+backward, also the output's gradient and each input's
    gradient, counted as twice the forward's. The roofline time is those bytes at the copy
    bandwidth; the fraction is roofline time / measured time (1: as fast as the memory allows).
    Small shapes whose tensors stay in the GPU's L2 cache from one repeat to the next can
    exceed 1."""
    report = {"compulsory_bytes": {}, "fraction": {}}
    for name in ops:
        run, inputs = runs[name]
        with torch.no_grad():
            forward_bytes = tensor_bytes(inputs) + tensor_bytes([run(*inputs)])
        for phase, compulsory in (("forward", forward_bytes),
                                  ("forward+backward", 2 * forward_bytes)):
            report["compulsory_bytes"][f"{name} {phase}"] = compulsory
            report["fraction"][f"{name} {phase}"] = (
                compulsory / bytes_per_second / medians[f"{name} {phase}"])
    return report


def benchmark_against_formulation(shape, runs, ops, args, bandwidth: Optional[dict],
                                  dcnv3_geometry: tuple = ()) -> dict:
    """One shape of ops (DCNv3 and DCNv4, or multi-scale deformable attention) against their
    grid_sample formulation and the originals that args.loaded_originals holds, every contender
    of runs ({name: (run, inputs)}) timed forward and forward+backward: the ratios, peak forward
    memory, each peer's agreement with ops[0], and on a run with the copy bandwidth the memory
    roofline. A shape with the softmax in the op runs no original: theirs take the weights
    normalised, which "ms_deform_attn + softmax" measures on our op."""
    loaded = args.loaded_originals
    if getattr(shape, "softmax", False):
        loaded = {}
    originals, originals_not_run = original_contenders(loaded, runs, dcnv3_geometry)
    runs = {**runs, **originals}
    steps = {}
    for name, (run, inputs) in runs.items():
        steps[f"{name} forward"] = forward_step(run, inputs)
        steps[f"{name} forward+backward"] = forward_backward_step(run, inputs)
    with torch.no_grad():
        reference, reference_inputs = runs[ops[0]]
        ours = reference(*reference_inputs)
        agreement = {f"{name} max abs difference": (run(*inputs) - ours).abs().max().item()
                     for name, (run, inputs) in runs.items() if name != ops[0]}
    if runtimes_measured(args, getattr(torch, args.dtype)):
        add_runtimes(steps, agreement, *runs[ops[0]], ours)
    medians = time_interleaved(steps, args.repeats, args.warmup, args.device)
    result = {"shape": asdict(shape), "describe": shape.describe(), "median_seconds": medians,
              "ratios": {}, "peak_forward_bytes": {}, "agreement": agreement,
              "originals_not_run": originals_not_run}
    for runtime in RUNTIMES:
        if f"{runtime} forward" in medians:
            result["ratios"][f"{runtime}/{ops[0]} forward"] = (
                medians[f"{runtime} forward"] / medians[f"{ops[0]} forward"])
    for phase in ("forward", "forward+backward"):
        peer = medians[f"grid_sample formulation {phase}"]
        for name in ops:
            result["ratios"][f"grid_sample formulation/{name} {phase}"] = (
                peer / medians[f"{name} {phase}"])
        for name in originals:
            ours = PEERS[name]
            result["ratios"][f"{name}/{ours} {phase}"] = (
                medians[f"{name} {phase}"] / medians[f"{ours} {phase}"])
        for peer in ("transformers", "ms_deform_attn + softmax"):
            if peer in runs:
                result["ratios"][f"{peer}/{ops[0]} {phase}"] = (
                    medians[f"{peer} {phase}"] / medians[f"{ops[0]} {phase}"])
    for name, (run, inputs) in runs.items():
        result["peak_forward_bytes"][name] = peak_forward_bytes(run, inputs, args.device)
    grid_sample_peak = result["peak_forward_bytes"]["grid_sample formulation"]
    for name in ops:
        result["ratios"][f"grid_sample formulation/{name} peak forward memory"] = (
            grid_sample_peak / result["peak_forward_bytes"][name])
    if bandwidth is not None:
        result["roofline"] = roofline(runs, medians, bandwidth["bytes_per_second"], ops)
    return result


def runtimes_measured(args, dtype: torch.dtype) -> bool:
    """The inference runtimes run on the CPU, in float32."""
    return args.device == "cpu" and dtype == torch.float32


def add_runtimes(steps: dict, agreement: dict, run, inputs, ours, deform_conv_node=None) -> None:
    """The forwards of run(*inputs) in the inference runtimes that are installed
    (runtimes.form_forwards), as steps, and each one's largest difference from ours, run's
    output."""
    for runtime, forward in form_forwards(run, inputs, deform_conv_node).items():
        steps[f"{runtime} forward"] = forward
        agreement[f"{runtime} max abs difference"] = (
            torch.from_numpy(forward()) - ours).abs().max().item()


def drop_unsupported_contenders(runs: Dict[str, object], tensors) -> Dict[str, str]:
    """Removes the peers that do not implement the operands' dtype on their device (torchvision's
    op has no bfloat16 kernel, for one) and returns why each was dropped; deformconv itself must
    run."""
    unsupported = {}
    for name in [name for name in runs if name != "deformconv"]:
        try:
            with torch.no_grad():
                runs[name](*tensors)
        except (NotImplementedError, RuntimeError) as error:
            # torch's dispatch macros word it so, on either device; anything else is a failure.
            if "not implemented for" not in str(error):
                raise
            unsupported[name] = str(error).splitlines()[-1]
            del runs[name]
            print(f"  {name}: not run: {unsupported[name]}")
    return unsupported


def benchmark_shape(shape: Shape, args, bandwidth: Optional[dict] = None) -> dict:
    """One shape's report; bandwidth (copy_bandwidth's) gives DCNv3/DCNv4 their roofline."""
    dtype = getattr(torch, args.dtype)
    if isinstance(shape, Dcnv3Shape):
        runs = dcnv3_contenders(shape, make_dcnv3_tensors(shape, dtype, device=args.device))
        return benchmark_against_formulation(shape, runs, ("dcnv3", "dcnv4"), args, bandwidth,
                                             dcnv3_geometry(shape))
    if isinstance(shape, MsdaShape):
        runs = msda_contenders(shape, make_msda_tensors(shape, dtype, device=args.device))
        return benchmark_against_formulation(shape, runs, ("ms_deform_attn",), args, bandwidth)
    tensors = make_tensors(shape, dtype, modulated=not args.v1, device=args.device)
    runs = contenders(shape, tensors, args.im2col_step)
    if args.no_torchvision:
        runs.pop("torchvision", None)
    unsupported = drop_unsupported_contenders(runs, tensors)
    steps = {}
    for name, run in runs.items():
        steps[f"{name} forward"] = forward_step(run, tensors)
        steps[f"{name} forward+backward"] = forward_backward_step(run, tensors)
    steps.update(gemm_steps(shape, dtype, args.device))
    agreement = {}
    if runtimes_measured(args, dtype):
        with torch.no_grad():
            ours = runs["deformconv"](*tensors)
        add_runtimes(steps, agreement, runs["deformconv"], tensors, ours, shape)
    medians = time_interleaved(steps, args.repeats, args.warmup, args.device)
    result = {"shape": asdict(shape), "describe": shape.describe(), "median_seconds": medians,
              "ratios": {}, "gemm_gflops_per_second": {}, "peak_forward_bytes": {},
              "agreement": agreement, "unsupported": unsupported}
    for phase in ("forward", "forward+backward"):
        ours = medians[f"deformconv {phase}"]
        for other in ("torchvision", "dense", "GEMMs alone", *RUNTIMES):
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
