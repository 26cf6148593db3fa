"""Deformable convolution for PyTorch, on CPU and CUDA: DCN v1 and v2, InternImage's DCNv3,
FlashInternImage's DCNv4 and Deformable DETR's multi-scale deformable attention.

    import deformconv
    out = deformconv.deform_conv2d(x, offset, weight, mask=mask)   # functional
    layer = deformconv.ModulatedDeformConv2dPack(64, 64, 3, padding=1)  # module
"""

__version__ = "0.1.0"

from pathlib import Path

import torch


def _check_torch_version() -> None:
    """_C is machine code linked against the C++ ABI of the torch it was compiled with; under any
    other torch it would fail to load with an undefined symbol, or worse."""
    try:
        from ._build_info import TORCH_VERSION
    except ImportError:  # not built by setup.py: nothing recorded to check against
        return
    if TORCH_VERSION != torch.__version__:
        raise ImportError(
            f"deformconv {__version__} was compiled against torch {TORCH_VERSION}, but torch "
            f"{torch.__version__} is installed. Rebuild it against this torch from its source "
            "folder (pip install --no-build-isolation --force-reinstall --no-deps .), or install "
            f"torch {TORCH_VERSION}."
        )


_check_torch_version()

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
    ModulatedDeformConv2d,
    ModulatedDeformConv2dPack,
    MSDeformAttn,
    MultiScaleDeformableAttention,
    upgrade_mmcv_state_dict,
)
from .ops import dcnv3, dcnv4, deform_conv2d, ms_deform_attn


def cuda_compiled() -> bool:
    """Whether this build of deformconv holds CUDA kernels (whether or not a GPU is present)."""
    return torch.ops.deformconv.deform_conv2d.default.has_kernel_for_dispatch_key("CUDA")


__all__ = [
    "DCNv3",
    "DCNv4",
    "DeformConv2d",
    "DeformConv2dPack",
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
    "ms_deform_attn",
    "upgrade_mmcv_state_dict",
]
