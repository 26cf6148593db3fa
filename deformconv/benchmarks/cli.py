"""``python -m deformconv benchmark``: deformconv against torchvision and a dense convolution.

For each shape, in one process and interleaved (each repeat times every contender once, so
drifts in clock speed or load hit all of them alike), after warm-up: forward, and forward +
backward, of deformconv, ``torchvision.ops.deform_conv2d`` on the same tensors (when installed)
and a dense ``F.conv2d`` of the same geometry, and deformconv's GEMMs alone (gemm_steps); on the
CPU in float32 also the forwards of the inference runtimes that are installed, given the same
tensors and thread count (runtimes.py): ONNX Runtime's own DeformConv kernel (a one-node model),
and each op's standard-operator ONNX export (deformconv.onnx) in both sampling forms, GridSample
and gather, in ONNX Runtime and OpenVINO. Reports medians, the
ratios, the GFLOP/s of the GEMM part, and the peak memory allocated during one forward and
during one forward and backward, with the CPU's model and vector ISA. DCNv3 and DCNv4, and
multi-scale deformable attention (Deformable DETR's encoder and decoder), run against their
grid_sample formulations, and against the memory roofline: their compulsory bytes
at the bandwidth of a large device-to-device copy measured in the same run. On the CPU (the
default) steps are timed by the wall clock and memory by the profiler; with ``--device cuda``,
by CUDA events around blocks of steps issued back to back (at least 2 ms of them, so that
the host's launch latency is hidden as in a training loop) and by ``torch.cuda.max_memory_allocated``, on the training
batches of GPU_SHAPES. ``--busy-core`` keeps one core busy with a spinning process for the
run, as a data-loader worker would. ``--deterministic`` runs everything under PyTorch's
deterministic mode (warnings only, so that contenders without a deterministic backward still
run): deformconv's CUDA backwards then gather their input gradients. ``--report`` writes the tables of docs/performance.md from
the JSON files of earlier runs instead. A benchmark, not a test: nothing here asserts a time.
"""

import argparse
import importlib.util
import json
import os
from typing import List, Optional

import torch

import deformconv

from .environment import cpu_description
from .originals import load_originals
from .report import plot, print_result, update_tables
from .run import benchmark_shape, scaling
from .runtimes import versions as runtime_versions
from .shapes import DEFAULT_SHAPES, ROOFLINE_SHAPES, SHAPES
from .timing import CUDA_BLOCK_SECONDS, busy_core, copy_bandwidth


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
    parser.add_argument("--deterministic", action="store_true",
                        help="torch.use_deterministic_algorithms(True, warn_only=True) for the "
                        "run: deformconv's CUDA backwards gather their input gradients")
    parser.add_argument("--originals", metavar="DIR", default=None,
                        help="also time the originals' CUDA ops that tools/originals.py built "
                        "into DIR (DCNv3, DCNv4 and multi-scale deformable attention shapes)")
    parser.add_argument("--output", default="benchmark.json", help="JSON results file")
    parser.add_argument("--plot", default="benchmark.png", help="PNG chart of the ratios "
                        "(needs matplotlib; '' to skip)")
    parser.add_argument("--report", metavar="DOCUMENT", default=None,
                        help="measure nothing: rewrite the tables of the markdown DOCUMENT "
                        "(docs/performance.md) from the JSON files each names")
    args = parser.parse_args(argv)
    if args.report:
        print(f"rewrote {update_tables(args.report)} tables of {args.report}")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    if args.device == "cuda" and not deformconv.cuda_compiled():
        parser.error("--device cuda: this build of deformconv holds no CUDA kernels "
                     "(python -m deformconv info says why)")
    if args.originals and args.device != "cuda":
        parser.error("--originals: the originals' ops are CUDA ops: add --device cuda")
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
             "im2col_step": args.im2col_step, "deterministic": args.deterministic,
             "tf32": ({"matmul": torch.backends.cuda.matmul.allow_tf32,
                       "cudnn": torch.backends.cudnn.allow_tf32}
                      if args.device == "cuda" else None),
             "cuda_block_seconds": CUDA_BLOCK_SECONDS if args.device == "cuda" else None,
             "runtimes": runtime_versions() if args.device == "cpu" else {}}
    if any(isinstance(SHAPES[name], ROOFLINE_SHAPES) for name in shapes):
        setup["copy_bandwidth"] = copy_bandwidth(args.device, args.repeats, args.warmup)
    args.loaded_originals = {}
    if args.originals:
        args.loaded_originals, setup["originals_missing"], setup["originals"] = (
            load_originals(args.originals))
    print("setup:", json.dumps(setup))
    results = []
    report = {"setup": setup, "results": results}
    if args.deterministic:
        # cuBLAS's GEMMs are deterministic with a fixed workspace only, which torch asks for.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
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
        if importlib.util.find_spec("matplotlib") is None:
            print("no chart: it needs matplotlib, of the benchmark extra (pip install matplotlib; "
                  "--plot '' skips the chart)")
        else:
            plot(results, args.plot, setup)
            print(f"wrote {args.plot}")
    return 0
