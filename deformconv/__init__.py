"""Deformable convolution for PyTorch, on CPU and CUDA: DCN v1 and v2, InternImage's DCNv3,
FlashInternImage's DCNv4 and Deformable DETR's multi-scale deformable attention.

    import deformconv
    out = deformconv.deform_conv2d(x, offset, weight, mask=mask)   # functional
    layer = deformconv.ModulatedDeformConv2dPack(64, 64, 3, padding=1)  # module
"""

__version__ = "0.1.0"

import re
from pathlib import Path

import torch


def _torch_mismatch(torch_version: str, torch_cuda, build) -> "str | None":
    """Why this build cannot load under a torch of this version and CUDA release (None for a
    CPU-only torch), or None where it can. _C uses PyTorch's stable ABI alone, compiled against
    the oldest torch it targets, so it runs under every torch from that one on; its CUDA
    kernels need a CUDA build of torch, whose libraries they link against."""
    release = tuple(int(part) for part in re.findall(r"\d+", torch_version)[:2])
    if release < tuple(build.MINIMUM_TORCH):
        minimum = ".".join(map(str, build.MINIMUM_TORCH))
        return (f"deformconv {__version__} needs torch {minimum} or newer, but torch "
                f"{torch_version} is installed. Upgrade it: pip install 'torch>={minimum}'.")
    if build.CUDA_ARCH_LIST and torch_cuda is None:
        return (f"this build of deformconv {__version__} holds CUDA kernels, which need a CUDA "
                f"build of torch, but torch {torch_version} is CPU-only. Install deformconv's "
                "CPU wheel (built with DEFORMCONV_WITH_CUDA=0: pip install --force-reinstall "
                "--no-deps . from its source folder with that variable set), or a CUDA build of "
                "torch.")
    return None


def _check_torch() -> None:
    try:
        from . import _build_info
    except ImportError:  # not built by setup.py: nothing recorded to check against
        return
    mismatch = _torch_mismatch(torch.__version__, torch.version.cuda, _build_info)
    if mismatch is not None:
        raise ImportError(mismatch)


_check_torch()

try:
    from . import _C  # noqa: F401  (loads the library, which registers torch.ops.deformconv.*)
except ImportError as error:
    if any(Path(__file__).parent.glob("_C.*.so")):
        raise
    # Typically a repository checkout: `python -m ...` or `python -c ...` from its root finds
    # the source folder before the installed package.
    raise ImportError(
        f"deformconv's compiled extension _C is missing from {Path(__file__).parent}, which is "
        "probably its source folder, found before the installed package because Python runs "
        "from the repository root. Run from another directory, or install in editable mode "
        "(pip install --no-build-isolation -e .), which builds _C there."
    ) from error


def _warn_of_a_cpu_copy_fallback() -> None:
    # The library cannot warn itself (PyTorch's stable ABI has no warnings): it says why the
    # copy of its CPU kernels that DEFORMCONV_CPU_CAPABILITY names does not run, if it does not.
    import warnings

    fallback = torch.ops.deformconv._cpu_capability_fallback()
    if fallback:
        warnings.warn(fallback, stacklevel=3)


_warn_of_a_cpu_copy_fallback()

from .convert import convert_to_deformable
from .nn import (
    DCNv3,
    DCNv4,
    DeformConv2d,
    DeformConv2dPack,
    FlashDeformAttn,
    ModulatedDeformConv2d,
    ModulatedDeformConv2dPack,
    MSDeformAttn,
    MultiScaleDeformableAttention,
    upgrade_mmcv_state_dict,
)
from .ops import dcnv3, dcnv4, deform_conv2d, flash_deform_attn, ms_deform_attn
from .ops._common import cuda_compiled


__all__ = [
    "DCNv3",
    "DCNv4",
    "DeformConv2d",
    "DeformConv2dPack",
    "FlashDeformAttn",
    "ModulatedDeformConv2d",
    "ModulatedDeformConv2dPack",
    "MSDeformAttn",
    "MultiScaleDeformableAttention",
    "__version__",
    "convert_to_deformable",
    "cuda_compiled",
    "dcnv3",
    "dcnv4",
    "deform_conv2d",
    "flash_deform_attn",
    "ms_deform_attn",
    "upgrade_mmcv_state_dict",
]
