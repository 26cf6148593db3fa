"""Autograd, torch.func and autocast of the compiled ops, registered from Python through
torch.library, one pattern for every op: each op module calls register_gradients_and_autocast
once.

The C++ library registers each op's schema and its kernels for each device only. What the
dispatcher does above them is here, in the interpreter, so that the library needs no part of
torch's C++ autograd or autocast API.

Each op, forward and backward, has an autograd.Function of the form that torch.func takes
(forward, setup_context, backward, and a vmap rule from deformconv/ops/_vmap.py) and two
kernels that apply it:

- its Autograd kernel, registered with Library.impl rather than
  torch.library.register_autograd, whose kernel calls torch._library.utils.fill_defaults on
  every call: it reads schema.arguments once per argument, and each read builds the list of all
  the arguments again, so at these ops' 6 to 16 arguments it cost about 40 us of the 550 us of
  a forward and backward at a small layer (batch 1, 16 channels, 16 x 16, on the CPU), a fifth
  of the whole. This kernel fills in the defaults of trailing arguments that the dispatcher
  leaves out itself;
- its kernel for torch.func's FuncTorchDynamicLayerFrontMode key, which the dispatcher takes
  first while a transform (grad, vjp, jacrev, vmap, jvp) is active. torch.func handles an
  autograd.Function before the dispatcher, level by level (its custom_function_call): applied
  from the Autograd kernel, inside the dispatcher, the Function is refused; applied from this
  kernel it is given each transform's rule, unwrapping one level at a time. Neither
  register_autograd nor register_vmap gives a compiled op that.
"""

from typing import Sequence, Tuple

import torch
from torch.autograd import forward_ad

from ._vmap import Rule

_LIBRARY = torch.library.Library("deformconv", "IMPL")


def _below_autograd(op: torch._ops.OpOverload, keyset, arguments):
    with torch._C._AutoDispatchBelowAutograd():
        if keyset is None:
            # Through torch.func's front kernel: once each transform has unwrapped its level,
            # the keyset of that call no longer holds; a fresh dispatch.
            return op(*arguments)
        return op.redispatch(keyset & torch._C._after_autograd_keyset, *arguments)


def _differentiable(op: torch._ops.OpOverload, name: str, setup_context, backward,
                    batching_rule: Rule) -> None:
    """Registers op's Function (named `name`; its grad_fn shows as `name`Backward), with
    forward(keyset, *arguments), and the two kernels that apply it."""

    def forward(keyset, *arguments):
        return _below_autograd(op, keyset, arguments)

    def jvp(ctx, *tangents):
        raise NotImplementedError(
            f"{op._opname}: forward-mode AD is not supported (torch.func.jvp, "
            "torch.func.jacfwd, torch.autograd.forward_ad); use reverse mode: torch.func.vjp, "
            "torch.func.jacrev, torch.autograd.grad")

    def vmap(info, in_dims, keyset, *arguments):
        return batching_rule(info, in_dims[1:], *arguments)

    def forward_and_setup(ctx, keyset, *arguments):
        output = forward(keyset, *arguments)
        setup_context(ctx, (keyset, *arguments), output)
        return output

    # Two Functions of one forward and backward: torch.func's form for the transforms; outside
    # them the older form, with ctx in forward, since torch binds the arguments of a Function
    # that has setup_context through inspect.signature at every call (3% of the instructions
    # of a forward and backward at the small layer above).
    shared = {"backward": staticmethod(backward), "jvp": staticmethod(jvp)}
    function = type(name, (torch.autograd.Function,),
                    {**shared, "forward": staticmethod(forward_and_setup)})
    transformable = type(name, (torch.autograd.Function,),
                         {**shared, "forward": staticmethod(forward),
                          "setup_context": staticmethod(setup_context),
                          "vmap": staticmethod(vmap)})
    # The dispatcher leaves out the trailing arguments that equal their defaults (an op called
    # without ms_deform_attn's points_per_level); the Function takes them all.
    defaults = [argument.default_value for argument in op._schema.arguments]

    def autograd_kernel(keyset, *arguments):
        # A dual level open: forward-mode AD, whose tangents only the Function sees (to refuse
        # them).
        if forward_ad._current_level >= 0 or (
                torch.is_grad_enabled()
                and any(isinstance(value, torch.Tensor) and value.requires_grad
                        for value in arguments)):
            return function.apply(keyset, *arguments, *defaults[len(arguments):])
        return _below_autograd(op, keyset, arguments)

    def functorch_kernel(keyset, *arguments):
        return transformable.apply(None, *arguments, *defaults[len(arguments):])

    _LIBRARY.impl(op._opname, autograd_kernel, "Autograd", with_keyset=True)
    _LIBRARY.impl(op._opname, functorch_kernel, "FuncTorchDynamicLayerFrontMode",
                  with_keyset=True)


def register_gradients_and_autocast(op: str, gradient_arguments: Sequence[int],
                                    batching_rules: Tuple[Rule, Rule]) -> None:
    """Registers deformconv::`op`'s autograd, its backward op's refusal of a second derivative,
    both ops' batching rules (forward's, backward's) and the forward op's autocast kernels.

    The backward op deformconv::`op`_backward takes grad_output, forward arguments by their
    names, an output_mask and deterministic (PyTorch's deterministic mode, which on CUDA takes
    the gathered input gradient in place of atomic adds); it returns the gradients of the
    forward's arguments at the places gradient_arguments, in the mask's order, computing only
    those that the mask asks for (None for the others).
    """
    forward_op = getattr(torch.ops.deformconv, op).default
    backward_op = getattr(torch.ops.deformconv, f"{op}_backward").default
    schema = forward_op._schema
    arguments = len(schema.arguments)
    places = {argument.name: place for place, argument in enumerate(schema.arguments)}
    # Between grad_output and the two flags, output_mask and deterministic.
    backward_arguments = [places[argument.name]
                          for argument in backward_op._schema.arguments[1:-2]]
    # Tensors go through save_for_backward (None keeps the place of an absent one), so that
    # autograd checks that they were not modified in place before the backward.
    tensor_places = [place for place in backward_arguments
                     if str(schema.arguments[place].type) in ("Tensor", "Optional[Tensor]")]
    other_places = [place for place in backward_arguments if place not in tensor_places]

    def setup_context(ctx, inputs, output):
        inputs = inputs[1:]  # after the keyset
        ctx.save_for_backward(*(inputs[place] for place in tensor_places))
        ctx.others = [inputs[place] for place in other_places]

    def backward(ctx, grad_output):
        saved = dict(zip(other_places, ctx.others))
        saved.update(zip(tensor_places, ctx.saved_tensors))
        # The keyset comes first among the Function's inputs. needs_input_grad is False for an
        # absent tensor and for integer tensors.
        output_mask = [ctx.needs_input_grad[1 + place] for place in gradient_arguments]
        call = (grad_output, *(saved[place] for place in backward_arguments), output_mask,
                torch.are_deterministic_algorithms_enabled())
        if torch.is_grad_enabled():
            # create_graph=True, and torch.func, which always differentiates so: through the
            # backward op's Function, which records the gradients so that differentiating them
            # is refused.
            gradients = backward_op(*call)
        else:
            # The usual backward: straight to the device's kernel, without a second trip from
            # the dispatcher into the interpreter for an autograd kernel with nothing to do.
            with torch._C._AutoDispatchBelowAutograd():
                gradients = backward_op(*call)
        by_place = dict(zip(gradient_arguments, gradients))
        return (None, *(by_place.get(place) for place in range(arguments)))

    def refuse_double_backward(ctx, *grads):
        # Second derivatives of bilinear sampling: no kernel computes them. With
        # create_graph=True the first backward works; differentiating its results stops here,
        # naming the op, rather than deep inside the kernels.
        raise NotImplementedError(
            f"{op}: double backward is not supported (the gradients of {op} were themselves "
            "differentiated, e.g. after backward(create_graph=True), "
            "torch.autograd.grad(..., create_graph=True) or torch.func.grad of torch.func.grad)")

    forward_rule, backward_rule = batching_rules
    _differentiable(forward_op, f"deformconv_{op}", setup_context, backward, forward_rule)
    _differentiable(backward_op, f"deformconv_{op}_backward", lambda ctx, inputs, output: None,
                    refuse_double_backward, backward_rule)

    # Every op runs in float32 under autocast and returns float32, as the ops of autocast's
    # float32 list do: bilinear weights and the summed input gradients lose too much in float16
    # or bfloat16 to be worth the speed (a caller who wants half precision calls the op on half
    # tensors outside autocast). Under autocast the operands often come in mixed dtypes (a half
    # projection's offsets beside a float32 softmax's mask), which the ops refuse outside it.
    # Integer and float64 tensors pass unchanged. Autograd records the casts, so gradients come
    # back in the dtypes of the original tensors; the backward ops, which autograd calls on the
    # float32 operands it saved, need no autocast kernel.
    for device_type in ("cpu", "cuda"):
        torch.library.register_autocast(forward_op, device_type, torch.float32)
