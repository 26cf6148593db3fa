"""python -m deformconv {info,benchmark,benchmark-training,benchmark-transformers,demo}."""

import argparse
import sys


def info() -> int:
    import platform

    import torch

    import deformconv

    try:
        from . import _build_info
    except ImportError:  # built by other means than setup.py
        _build_info = None
    cuda = deformconv.cuda_compiled()
    print(f"deformconv {deformconv.__version__}")
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}), "
          f"Python {platform.python_version()}")
    if cuda:
        print("CUDA kernels compiled: yes")
        archs = _build_info.CUDA_ARCH_LIST if _build_info else "unknown"
        print(f"CUDA architectures compiled: {archs}")
        print(f"CUDA devices: {torch.cuda.device_count()}")
        for index in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(index)
            print(f"  cuda:{index}: {torch.cuda.get_device_name(index)}, compute capability "
                  f"{major}.{minor}")
    else:
        reason = _build_info.CPU_ONLY_REASON if _build_info else "unknown"
        print(f"CUDA kernels compiled: no, CPU kernels only ({reason})")
    print("dtypes: cpu float32 float64 float16 bfloat16"
          + ("; cuda float32 float64 float16 bfloat16" if cuda else ""))
    print(f"CPU kernels: the {torch.ops.deformconv._cpu_capability()} copy (this CPU runs: "
          f"{' '.join(torch.ops.deformconv._cpu_capabilities())}; DEFORMCONV_CPU_CAPABILITY "
          "chooses)")
    print(f"CPU threads: {torch.get_num_threads()}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m deformconv",
        description="deformconv: deformable convolution for PyTorch")
    parser.add_argument("command", choices=["info", "benchmark", "benchmark-training",
                                             "benchmark-transformers", "demo"],
                        help="info: versions and build; benchmark: speed against "
                             "torchvision and dense conv; benchmark-training: a ResNet-50 "
                             "training step with DCN v2; benchmark-transformers: transformers' "
                             "Deformable DETR and Mask2Former, routed to deformconv and not; "
                             "demo: train DCN vs plain CNN")
    parser.add_argument("args", nargs=argparse.REMAINDER,
                        help="options of the command (python -m deformconv COMMAND --help)")
    parsed = parser.parse_args(argv[:1])
    rest = argv[1:]
    if parsed.command == "info":
        return info()
    if parsed.command == "benchmark":
        from .benchmarks.cli import main as benchmark_main

        return benchmark_main(rest)
    if parsed.command == "benchmark-training":
        from .benchmarks.training import main as training_main

        return training_main(rest)
    if parsed.command == "benchmark-transformers":
        from .benchmarks.transformers_models import main as transformers_main

        return transformers_main(rest)
    from .demo import main as demo_main

    return demo_main(rest)


if __name__ == "__main__":
    sys.exit(main())
