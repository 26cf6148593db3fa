"""Argument handling that the functional ops and their fake kernels share."""

import functools
from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor

IntOrPair = Union[int, Tuple[int, int], List[int]]


@torch.jit.unused
def _check_pair(name: str, value: IntOrPair) -> None:
    # Python only: under TorchScript the argument's type has been checked already.
    if (not isinstance(value, (tuple, list)) or len(value) != 2
            or not all(isinstance(v, int) for v in value)):
        raise ValueError(f"deform_conv2d(): expected {name} to be an int or a pair of ints, "
                         f"but got {value!r}")


def _pair(name: str, value: IntOrPair) -> List[int]:
    if isinstance(value, int):
        return [value, value]
    if not torch.jit.is_scripting():
        _check_pair(name, value)
    if isinstance(value, list):
        if len(value) != 2:
            raise ValueError("deform_conv2d(): expected " + name + " to be an int or a pair of "
                             "ints, but got a list of " + str(len(value)))
        return value
    return [value[0], value[1]]


@torch.jit.unused
def _in_onnx_export() -> bool:
    # Both ONNX exporters trace the model: the TorchScript-based one with torch.jit's tracer,
    # the torch.export-based one as a compilation. torch.onnx.is_in_onnx_export imports two
    # modules at every call, slow where the interpreter's caches have gone cold, as between the
    # layers of a model; so it is asked only while tracing.
    return ((torch.jit.is_tracing() or torch.compiler.is_compiling())
            and torch.onnx.is_in_onnx_export())


@functools.lru_cache(maxsize=None)
def _cuda_kernels_missing_reason() -> Optional[str]:
    """None where this build holds CUDA kernels, else why not (setup.py records it)."""
    from .. import cuda_compiled  # at call time: the package imports this module first

    if cuda_compiled():
        return None
    try:
        from .._build_info import CPU_ONLY_REASON
    except ImportError:  # built by CMake, which records no reason
        return "built without them"
    return CPU_ONLY_REASON


@torch.jit.unused
def _check_cuda_kernels(op: str, device: torch.device) -> None:
    # Python only: the dispatcher's own error ("Could not run ... with arguments from the
    # 'CUDA' backend") says nothing of how to get the kernels.
    if device.type != "cuda":
        return
    reason = _cuda_kernels_missing_reason()
    if reason is not None:
        raise RuntimeError(
            f"{op}(): this build of deformconv has no CUDA kernels ({reason}), so it cannot run "
            f"on {device}. Reinstall it with FORCE_CUDA=1 set (pip install --no-build-isolation "
            "--force-reinstall --no-deps . from its source folder, with a CUDA toolkit and a "
            "CUDA build of torch); python -m deformconv info shows the build.")


def _output_size(size, kernel: int, stride: int, pad: int, dilation: int):
    return (size + 2 * pad - (dilation * (kernel - 1) + 1)) // stride + 1


def _has_static_shape(tensor: Optional[Tensor]) -> bool:
    return tensor is None or all(isinstance(size, int) for size in tensor.shape)


def _on_meta(tensor: Optional[Tensor]) -> Optional[Tensor]:
    return None if tensor is None else torch.empty(tensor.shape, dtype=tensor.dtype,
                                                   device="meta")


def _check_devices(op: str, input: Tensor, **others: Optional[Tensor]) -> None:
    # The meta tensors below all sit on "meta"; the device check of the op is made here.
    for name, tensor in others.items():
        if tensor is not None and tensor.device != input.device:
            raise ValueError(f"{op}(): expected {name} to be on the device of input "
                             f"({input.device}), but got {tensor.device}")
