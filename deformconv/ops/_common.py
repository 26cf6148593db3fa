"""Argument handling that the functional ops and their fake kernels share."""

import functools
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional, Sequence

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
#
# The argument lists are the registered schemas' (csrc/core/<op>.h's kSchema, kBackwardSchema
# and kChecksSchema): a fake kernel takes what the dispatcher passes, names it by the op's
# schema, and hands the checks op each of its own arguments by name.


def _bound_arguments(op: torch._ops.OpOverload, args: Sequence, kwargs: Dict) -> SimpleNamespace:
    """A call of op's arguments by their schema names. The dispatcher leaves out trailing
    arguments that have their default (deterministic, the last of every backward op), so those
    take the schema's default."""
    values = {}
    for place, argument in enumerate(op._schema.arguments):
        if place < len(args):
            values[argument.name] = args[place]
        elif argument.name in kwargs:
            values[argument.name] = kwargs[argument.name]
        else:
            values[argument.name] = argument.default_value
    return SimpleNamespace(**values)


def _is_tensor(argument: torch._C.Argument) -> bool:
    return argument.type.isSubtypeOf(torch._C.OptionalType.ofTensor())


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


def _run_checks(checks: torch._ops.OpOverload, arguments: SimpleNamespace,
                renamed: Dict[str, str]) -> List[int]:
    """The checks op's verdict on a call's arguments, those of its backward where they hold
    grad_output: each of its schema's arguments taken from `arguments` by name (renamed maps
    a checks argument's name to the op's; one the op lacks is None), tensors as meta copies,
    outside any fake mode, so that fake tensors are rejected exactly as real ones are. Returns
    the output shape.

    torch has no public way out of a fake mode. Called on the fake tensors themselves, inside
    the mode, the check op would run as its own meta kernel and raise the same error, but
    FakeTensorMode logs every exception of a meta kernel at ERROR level, with a traceback,
    before re-raising it: each rejected call under torch.compile or torch.export would print
    one. Hence torch's private unset_fake_temporarily."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    values = [getattr(arguments, renamed.get(argument.name, argument.name), None)
              for argument in checks._schema.arguments]
    values = [_on_meta(value) if _is_tensor(argument) else value
              for argument, value in zip(checks._schema.arguments, values)]
    with unset_fake_temporarily():
        return checks(*values)


def _has_static_shapes(tensors) -> bool:
    return all(tensor is None or all(isinstance(size, int) for size in tensor.shape)
               for tensor in tensors)


def contiguous_like(name: str) -> Callable[[SimpleNamespace], Tensor]:
    """A gradient of argument `name`, shaped as it, in the contiguous format."""
    return lambda arguments: torch.empty_like(getattr(arguments, name),
                                              memory_format=torch.contiguous_format)


def register_fake_kernels(op: str, output_shape: Callable[[SimpleNamespace], Sequence],
                          gradients: Sequence[Callable[[SimpleNamespace], Optional[Tensor]]],
                          checks_of: str = "", renamed: Optional[Dict[str, str]] = None) -> None:
    """The fake kernels of op and of op_backward. output_shape(arguments) is the output's shape
    from the call's arguments by name, for symbolic sizes; gradient i of the backward is
    gradients[i](arguments) where output_mask asks for it, else None. checks_of names the op
    whose checks apply, where not op's own, and renamed maps its argument names to op's."""
    forward = getattr(torch.ops.deformconv, op).default
    backward = getattr(torch.ops.deformconv, f"{op}_backward").default
    checks = getattr(torch.ops.deformconv, f"_check_{checks_of or op}_arguments").default
    renamed = renamed or {}

    def tensors(overload, arguments):
        return {argument.name: getattr(arguments, argument.name)
                for argument in overload._schema.arguments if _is_tensor(argument)}

    @torch.library.register_fake(forward)
    def fake_forward(*args, **kwargs):
        arguments = _bound_arguments(forward, args, kwargs)
        inputs = tensors(forward, arguments)
        _check_devices(op, inputs)
        if _has_static_shapes(inputs.values()):
            shape = _run_checks(checks, arguments, renamed)
        else:
            shape = output_shape(arguments)
        return next(iter(inputs.values())).new_empty(shape)

    @torch.library.register_fake(backward)
    def fake_backward(*args, **kwargs):
        arguments = _bound_arguments(backward, args, kwargs)
        inputs = tensors(backward, arguments)
        grad_output = inputs.pop("grad_output")
        # Devices against the first input, as the forward's, grad_output named second.
        first_name, first = next(iter(inputs.items()))
        _check_devices(f"{op}_backward", {first_name: first, "grad_output": grad_output, **inputs})
        if _has_static_shapes([grad_output, *inputs.values()]):
            _run_checks(checks, arguments, renamed)
        # The checks op takes no output_mask; the real kernel checks its length so.
        if len(arguments.output_mask) != len(gradients):
            raise ValueError(f"{op}_backward(): expected output_mask to have {len(gradients)} "
                             f"entries, but got {len(arguments.output_mask)}")
        return tuple(gradient(arguments) if wanted else None
                     for gradient, wanted in zip(gradients, arguments.output_mask))
