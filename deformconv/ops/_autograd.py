"""Autograd and autocast of the compiled ops, registered from Python through torch.library, one
pattern for every op: each op module calls register_gradients_and_autocast once.

The C++ library registers each op's schema and its kernels for each device only. What the
dispatcher does above them is here, in the interpreter, so that the library needs no part of
torch's C++ autograd or autocast API.

The forward ops' Autograd kernels are registered with Library.impl rather than
torch.library.register_autograd, whose kernel calls torch._library.utils.fill_defaults on
every call: it reads schema.arguments once per argument, and each read builds the list of all
the arguments again, so at these ops' 6 to 16 arguments it cost about 40 us of the 550 us of a
forward and backward at a small layer (batch 1, 16 channels, 16 x 16, on the CPU), a fifth of
the whole. The kernel below does what that one does, filling in the defaults of trailing
arguments that the dispatcher leaves out.
"""

from typing import Sequence

import torch

_LIBRARY = torch.library.Library("deformconv", "IMPL")


def _below_autograd(op: torch._ops.OpOverload, keyset, arguments):
    with torch._C._AutoDispatchBelowAutograd():
        return op.redispatch(keyset & torch._C._after_autograd_keyset, *arguments)


def register_gradients_and_autocast(op: str, gradient_arguments: Sequence[int]) -> None:
    """Registers deformconv::`op`'s autograd, its backward op's refusal of a second derivative,
    and the forward op's autocast kernels.

    The backward op deformconv::`op`_backward takes grad_output, forward arguments by their
    names, an output_mask and deterministic (PyTorch's deterministic mode, which on CUDA takes
    the gathered input gradient in place of atomic adds); it returns the gradients of the forward's arguments at the places
    gradient_arguments, in the mask's order, computing only those that the mask asks for (None
    for the others).
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

    def forward(ctx, keyset, *inputs):
        output = _below_autograd(forward_op, keyset, inputs)
        ctx.save_for_backward(*(inputs[place] for place in tensor_places))
        ctx.others = [inputs[place] for place in other_places]
        return output

    def backward(ctx, grad_output):
        saved = dict(zip(other_places, ctx.others))
        saved.update(zip(tensor_places, ctx.saved_tensors))
        # The keyset comes first among the Function's inputs. needs_input_grad is False for an
        # absent tensor and for integer tensors.
        output_mask = [ctx.needs_input_grad[1 + place] for place in gradient_arguments]
        call = (grad_output, *(saved[place] for place in backward_arguments), output_mask,
                torch.are_deterministic_algorithms_enabled())
        if torch.is_grad_enabled():
            # create_graph=True: through the backward op's autograd, which records the
            # gradients so that differentiating them is refused.
            gradients = backward_op(*call)
        else:
            # The usual backward: straight to the device's kernel, without a second trip from
            # the dispatcher into the interpreter for an autograd kernel with nothing to do.
            with torch._C._AutoDispatchBelowAutograd():
                gradients = backward_op(*call)
        by_place = dict(zip(gradient_arguments, gradients))
        return (None, *(by_place.get(place) for place in range(arguments)))

    # grad_fn shows as deformconv_<op>Backward.
    function = type(f"deformconv_{op}", (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(backward)})

    # The dispatcher leaves out the trailing arguments that equal their defaults (an op called
    # without ms_deform_attn's points_per_level); the backward op takes them all.
    defaults = [argument.default_value for argument in schema.arguments]

    def autograd_kernel(keyset, *inputs):
        if torch.is_grad_enabled() and any(isinstance(value, torch.Tensor) and value.requires_grad
                                           for value in inputs):
            return function.apply(keyset, *inputs, *defaults[len(inputs):])
        return _below_autograd(forward_op, keyset, inputs)

    _LIBRARY.impl(op, autograd_kernel, "Autograd", with_keyset=True)

    def refuse_double_backward(ctx, *grads):
        # Second derivatives of bilinear sampling: no kernel computes them. With
        # create_graph=True the first backward works; differentiating its results stops here,
        # naming the op, rather than deep inside the kernels.
        raise NotImplementedError(
            f"{op}: double backward is not supported (the gradients of {op} were themselves "
            "differentiated, e.g. after backward(create_graph=True) or "
            "torch.autograd.grad(..., create_graph=True))")

    torch.library.register_autograd(backward_op, refuse_double_backward)

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
