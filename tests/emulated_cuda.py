"""Builds and loads tests/cuda_emulation: the project's real CUDA launchers and CUDA kernels of
the ops (csrc/cuda), compiled as C++ against a small CUDA emulator and run on CPU tensors, as
torch.ops.deformconv_emulated.*. Built once into torch's extension cache; ninja rebuilds what
changed in csrc/ or tests/cuda_emulation. DEFORMCONV_SANITIZE=1 builds it with AddressSanitizer
and UndefinedBehaviorSanitizer (tools/run_sanitized_tests.sh).

    python tests/emulated_cuda.py     # build only
"""

import os
from pathlib import Path

import torch
from torch.utils import cpp_extension

from setup_py import load_setup_py

ROOT = Path(__file__).resolve().parent.parent
EMULATION = ROOT / "tests" / "cuda_emulation"
SANITIZER_FLAGS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
                   "-fno-omit-frame-pointer", "-g"]


def load():
    sanitize = os.environ.get("DEFORMCONV_SANITIZE", "0") == "1"
    extra = SANITIZER_FLAGS if sanitize else []
    # The torch version in the name: torch's extension cache keys a build by its sources and
    # flags only, and would load a library built against another torch.
    torch_tag = "".join(c if c.isalnum() else "_" for c in torch.__version__)
    cpp_extension.load(
        name=f"deformconv_cuda_emulation_{torch_tag}" + ("_sanitized" if sanitize else ""),
        # The emulator's ops, and csrc/sources.txt's sources of the emulation build.
        sources=[str(EMULATION / "emulated_ops.cpp")]
        + [str(ROOT / path) for path in load_setup_py().listed_sources("emulation")],
        extra_cflags=["-O1" if sanitize else "-O2", "-DDEFORMCONV_CUDA_EMULATION",
                      "-include", str(EMULATION / "cuda_emulation.h")] + extra,
        # A copy: cpp_extension appends to the list it is given, and the changed flags of a
        # second load() would make it build and load another copy of the library, whose ops
        # are registered already.
        extra_ldflags=list(extra),
        is_python_module=False,
    )
    return torch.ops.deformconv_emulated


if __name__ == "__main__":
    load()
