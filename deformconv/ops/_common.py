"""Argument handling that the functional ops and their fake kernels share."""

import functools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

@torch.jit.unused
def _in_onnx_export() -> bool:
    # Both ONNX exporters trace the model: the TorchScript-based one with torch.jit's tracer,
    # the torch.export-based one as a compilation. torch.onnx.is_in_onnx_export imports two
    # modules at every call, slow where the interpreter's caches have gone cold, as between the
    # layers of a model; so it is asked only while tracing.
    return ((torch.jit.is_tracing() or torch.compiler.is_compiling())
            and torch.onnx.is_in_onnx_export())


def cuda_compiled() -> bool:
    """Whether this build of deformconv holds CUDA kernels (whether or not a GPU is present)."""
    return torch.ops.deformconv.deform_conv2d.default.has_kernel_for_dispatch_key("CUDA")


@functools.lru_cache(maxsize=None)
def _cuda_kernels_missing_reason() -> Optional[str]:
    """None where this build holds CUDA kernels, else why not (setup.py records it)."""
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


# The fake kernels (for torch.compile, torch.export and meta tensors), one pattern for every
# op: the devices checked here; then, where every size is concrete, the op's own argument
# checks (its C++ _check_<op>_arguments op, which reads no tensor data) on meta copies; with
# symbolic sizes (dynamic shapes), the op's shape formula instead, the checks having run when
# the graph was traced with concrete sizes and running again in the real kernel.


def _on_meta(tensor: Optional[Tensor]) -> Optional[Tensor]:
    return None if tensor is None else torch.empty(tensor.shape, dtype=tensor.dtype,
                                                   device="meta")


def _check_devices(op: str, tensors: Dict[str, Optional[Tensor]]) -> None:
    # The meta copies all sit on "meta": the op's device check is made here, against the
    # first tensor's device.
    (first_name, first), *others = tensors.items()
    for name, tensor in others:
        if tensor is not None and tensor.device != first.device:
            raise ValueError(f"{op}(): expected {name} to be on the device of {first_name} "
                             f"({first.device}), but got {tensor.device}")


def _run_checks(op: str, grad_output: Optional[Tensor], tensors: Sequence[Optional[Tensor]],
                others: Sequence) -> List[int]:
    """op's argument checks, those of its backward when grad_output is given, on meta copies of
    the tensors and outside any fake mode, so that fake tensors are rejected exactly as real
    ones are. Returns the output shape.

    torch has no public way out of a fake mode. Called on the fake tensors themselves, inside
    the mode, the check op would run as its own meta kernel and raise the same error, but
    FakeTensorMode logs every exception of a meta kernel at ERROR level, with a traceback,
    before re-raising it: each rejected call under torch.compile or torch.export would print
    one. Hence torch's private unset_fake_temporarily."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    check = getattr(torch.ops.deformconv, f"_check_{op}_arguments")
    with unset_fake_temporarily():
        return check(*[_on_meta(t) for t in (grad_output, *tensors)], *others)


def _has_static_shapes(tensors) -> bool:
    return all(tensor is None or all(isinstance(size, int) for size in tensor.shape)
               for tensor in tensors)


def _fake_output(op: str, tensors: Dict[str, Optional[Tensor]], others: Sequence,
                 shape_formula: Callable[[], Sequence], checks_of: str = "") -> Tensor:
    """The fake kernel of forward op `op`, over its tensors by name (in the schema's order) and
    its other arguments: the output, shaped as the checks or shape_formula() say, on the first
    tensor's device. checks_of names the op whose checks apply, where not op's own."""
    _check_devices(op, tensors)
    if _has_static_shapes(tensors.values()):
        shape = _run_checks(checks_of or op, None, list(tensors.values()), others)
    else:
        shape = shape_formula()
    return next(iter(tensors.values())).new_empty(shape)


def _fake_gradients(op: str, grad_output: Tensor, tensors: Dict[str, Optional[Tensor]],
                    others: Sequence, gradients: Sequence[Callable[[], Optional[Tensor]]],
                    output_mask: Sequence[bool], checks_of: str = "") -> Tuple:
    """The fake kernel of op's backward op (`op`_backward): gradient i is gradients[i]() where
    output_mask asks for it, else None; the checks as _fake_output's."""
    first_name, first = next(iter(tensors.items()))
    _check_devices(f"{op}_backward", {first_name: first, "grad_output": grad_output, **tensors})
    if _has_static_shapes([grad_output, *tensors.values()]):
        _run_checks(checks_of or op, grad_output, list(tensors.values()), others)
    return tuple(gradient() if wanted else None
                 for gradient, wanted in zip(gradients, output_mask))
