"""Build of the deformconv extension.

The CPU kernels are always built. The CUDA kernels are built when nvcc and a CUDA build of
torch are both present, unless DEFORMCONV_WITH_CUDA says otherwise:
    DEFORMCONV_WITH_CUDA=1   require the CUDA kernels (fail if they cannot be built)
    DEFORMCONV_WITH_CUDA=0   CPU kernels only
torch's build helper honours TORCH_CUDA_ARCH_LIST (GPU architectures) and MAX_JOBS (parallel
compile jobs). DEFORMCONV_SANITIZE=1 compiles the C++ with AddressSanitizer and
UndefinedBehaviorSanitizer (tools/run_sanitized_tests.sh uses it).
"""

import os
import re
from pathlib import Path

from setuptools import setup
from torch.utils import cpp_extension

ROOT = Path(__file__).parent


def read_version():
    text = (ROOT / "deformconv" / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', text, re.MULTILINE).group(1)


def want_cuda():
    switch = os.environ.get("DEFORMCONV_WITH_CUDA", "auto").strip().lower()
    available = cpp_extension.CUDA_HOME is not None and _torch_has_cuda()
    if switch in ("1", "true", "on", "yes"):
        if not available:
            raise RuntimeError(
                "DEFORMCONV_WITH_CUDA=1, but the CUDA kernels cannot be built: "
                f"CUDA_HOME={cpp_extension.CUDA_HOME}, torch.version.cuda={_torch_cuda_version()}"
            )
        return True
    if switch in ("0", "false", "off", "no"):
        return False
    if switch != "auto":
        raise RuntimeError(f"DEFORMCONV_WITH_CUDA must be 0, 1 or auto, got {switch!r}")
    return available


def _torch_cuda_version():
    import torch

    return torch.version.cuda


def _torch_has_cuda():
    return _torch_cuda_version() is not None


def sources(pattern):
    return sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(pattern))


def extension(with_cuda: bool):
    common = (
        ["csrc/deformconv.cpp", "csrc/python/module.cpp"]
        + sources("csrc/pytorch/*.cpp")
        + sources("csrc/cpu/*.cpp")
    )
    # at::parallel_for is inlined from ATen's headers as an OpenMP parallel region: without
    # -fopenmp here it silently runs on one thread.
    cxx_flags = ["-O3", "-fopenmp"]
    link_flags = ["-fopenmp"]
    if os.environ.get("DEFORMCONV_SANITIZE", "0") == "1":
        sanitize = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
                    "-fno-omit-frame-pointer", "-g"]
        cxx_flags = ["-O1", "-fopenmp"] + sanitize
        link_flags += sanitize
    if with_cuda:
        return cpp_extension.CUDAExtension(
            "deformconv._C",
            common + sources("csrc/cuda/*.cpp") + sources("csrc/cuda/*.cu"),
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3"]},
            extra_link_args=link_flags,
        )
    return cpp_extension.CppExtension(
        "deformconv._C", common, extra_compile_args={"cxx": cxx_flags},
        extra_link_args=link_flags,
    )


def write_build_info(with_cuda: bool) -> None:
    """deformconv/_build_info.py: what `python -m deformconv info` reports about this build."""
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "torch's default") if with_cuda else ""
    (ROOT / "deformconv" / "_build_info.py").write_text(
        "# Written by setup.py at build time.\n"
        f"CUDA_ARCH_LIST = {archs!r}\n"
    )


WITH_CUDA = want_cuda()
write_build_info(WITH_CUDA)

setup(
    version=read_version(),
    ext_modules=[extension(WITH_CUDA)],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
