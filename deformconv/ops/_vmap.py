"""Batching rules of the ops, for torch.func.vmap: each takes (info, in_dims, *arguments) of its
op and returns (outputs, out_dims), calling the op once on unbatched tensors.

A vmapped dimension becomes part of a dimension the op already has. Where every operand that
the batch elements share (a weight, the spatial shapes) is unbatched and every output belongs
to one batch element, it folds into the op's batch: B elements of batch N are one call of batch
B * N. DCN v1/v2 has two more cases, per-example weights (vmap over an ensemble) and gradients
of the weight or bias asked for per element (per-sample gradients, vmap of grad): there it
folds into the groups, B elements of g conv groups and o offset groups being one call of
B * g and B * o groups over B times the channels, each element's channels, offsets, weights
and gradients in a block of their own. Spatial shapes batched (each element with levels of its
own) are one call per element.

The autograd.Functions of deformconv/ops/_autograd.py name these as their vmap rules, which
torch.func reaches through the Functions (see that module).
"""

from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

# A batching rule: (info, in_dims, *arguments) -> (outputs, out_dims).
Rule = Callable


def _leading(tensor: Tensor, dim: Optional[int], batch: int) -> Tensor:
    """tensor with the vmapped dimension first; an unbatched one expanded to it."""
    if dim is None:
        return tensor.expand(batch, *tensor.shape)
    return tensor.movedim(dim, 0)


def _into_batch(tensor: Optional[Tensor], dim: Optional[int], batch: int) -> Optional[Tensor]:
    if tensor is None:
        return None
    tensor = _leading(tensor, dim, batch)
    return tensor.reshape(batch * tensor.shape[1], *tensor.shape[2:])


def _out_of_batch(tensor: Optional[Tensor], batch: int) -> Optional[Tensor]:
    if tensor is None:
        return None
    return tensor.reshape(batch, tensor.shape[0] // batch, *tensor.shape[1:])


def _dims_of(outputs, dim: int):
    if isinstance(outputs, tuple):
        return tuple(None if output is None else dim for output in outputs)
    return dim


def _per_element(op, batch: int, in_dims: Sequence[Optional[int]], arguments: Sequence):
    """One call per batch element, the results stacked. (A list argument's in_dims is a list,
    of its elements' dims.)"""
    results = [op(*(argument.select(dim, element)
                    if isinstance(argument, Tensor) and dim is not None else argument
                    for argument, dim in zip(arguments, in_dims)))
               for element in range(batch)]
    if isinstance(results[0], tuple):
        outputs = tuple(None if parts[0] is None else torch.stack(parts)
                        for parts in zip(*results))
    else:
        outputs = torch.stack(results)
    return outputs, _dims_of(outputs, 0)


def batch_folding(op: torch._ops.OpOverload, per_sample: Sequence[str]) -> Rule:
    """The rule of an op whose operands named in per_sample have the op's batch first, the
    other tensors being shared by the batch, and whose outputs all have it first."""
    names = [argument.name for argument in op._schema.arguments]
    tensor_places = [place for place, argument in enumerate(op._schema.arguments)
                     if str(argument.type) in ("Tensor", "Optional[Tensor]")]
    per_sample_places = [names.index(name) for name in per_sample]
    shared_places = [place for place in tensor_places if place not in per_sample_places]

    def rule(info, in_dims, *arguments):
        if any(in_dims[place] is not None for place in shared_places):
            return _per_element(op, info.batch_size, in_dims, arguments)
        folded = list(arguments)
        for place in per_sample_places:
            folded[place] = _into_batch(arguments[place], in_dims[place], info.batch_size)
        outputs = op(*folded)
        if isinstance(outputs, tuple):
            outputs = tuple(_out_of_batch(output, info.batch_size) for output in outputs)
        else:
            outputs = _out_of_batch(outputs, info.batch_size)
        return outputs, _dims_of(outputs, 0)

    return rule


def _into_channels(tensor: Optional[Tensor], dim: Optional[int], batch: int) -> Optional[Tensor]:
    """(B, N, C, ...) -> (N, B * C, ...): each element's channels a block of their own."""
    if tensor is None:
        return None
    tensor = _leading(tensor, dim, batch).transpose(0, 1)
    return tensor.reshape(tensor.shape[0], batch * tensor.shape[2], *tensor.shape[3:])


def _out_of_channels(tensor: Optional[Tensor], batch: int) -> Optional[Tensor]:
    """(N, B * C, ...) -> (N, B, C, ...): the vmapped dimension at 1."""
    if tensor is None:
        return None
    return tensor.reshape(tensor.shape[0], batch, tensor.shape[1] // batch, *tensor.shape[2:])


# deform_conv2d's arguments: input, offset, weight, mask, bias, stride, padding, dilation, groups,
# offset_groups, im2col_step; its backward's: grad_output, input, offset, weight, mask, stride,
# padding, dilation, groups, offset_groups, im2col_step, output_mask[5], deterministic, and its
# gradients those of input, offset, weight, mask and bias.

def deform_conv2d_rule(info, in_dims, input, offset, weight, mask, bias, stride, padding,
                       dilation, groups, offset_groups, im2col_step):
    op = torch.ops.deformconv.deform_conv2d.default
    batch = info.batch_size
    if in_dims[2] is None and in_dims[4] is None:
        output = op(_into_batch(input, in_dims[0], batch), _into_batch(offset, in_dims[1], batch),
                    weight, _into_batch(mask, in_dims[3], batch), bias, stride, padding,
                    dilation, groups, offset_groups, im2col_step)
        return _out_of_batch(output, batch), 0
    output = op(_into_channels(input, in_dims[0], batch),
                _into_channels(offset, in_dims[1], batch), _into_batch(weight, in_dims[2], batch),
                _into_channels(mask, in_dims[3], batch), _into_batch(bias, in_dims[4], batch),
                stride, padding, dilation, batch * groups, batch * offset_groups, im2col_step)
    return _out_of_channels(output, batch), 1


def deform_conv2d_backward_rule(info, in_dims, grad_output, input, offset, weight, mask, stride,
                                padding, dilation, groups, offset_groups, im2col_step,
                                output_mask, deterministic=False):
    op = torch.ops.deformconv.deform_conv2d_backward.default
    batch = info.batch_size
    if in_dims[3] is None and not output_mask[2] and not output_mask[4]:
        gradients = op(_into_batch(grad_output, in_dims[0], batch),
                       _into_batch(input, in_dims[1], batch),
                       _into_batch(offset, in_dims[2], batch), weight,
                       _into_batch(mask, in_dims[4], batch), stride, padding, dilation, groups,
                       offset_groups, im2col_step, output_mask, deterministic)
        outputs = tuple(_out_of_batch(gradient, batch) for gradient in gradients)
        return outputs, _dims_of(outputs, 0)
    grad_input, grad_offset, grad_weight, grad_mask, grad_bias = op(
        _into_channels(grad_output, in_dims[0], batch), _into_channels(input, in_dims[1], batch),
        _into_channels(offset, in_dims[2], batch), _into_batch(weight, in_dims[3], batch),
        _into_channels(mask, in_dims[4], batch), stride, padding, dilation, batch * groups,
        batch * offset_groups, im2col_step, output_mask, deterministic)
    outputs = (_out_of_channels(grad_input, batch), _out_of_channels(grad_offset, batch),
               _out_of_batch(grad_weight, batch), _out_of_channels(grad_mask, batch),
               _out_of_batch(grad_bias, batch))
    dims = (1, 1, 0, 1, 0)
    return outputs, tuple(None if output is None else dim for output, dim in zip(outputs, dims))
