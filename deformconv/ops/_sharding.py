"""Sharding rules of the ops for DTensor (torch.distributed.tensor), forward and backward ops.

Each rule lists the placements that the op computes locally, per mesh dimension; DTensor picks
the cheapest and redistributes other placements to one of them (all replicated at worst,
always listed, with the same values):

- the batch sharded (Shard(0) of every per-image operand and of the output), the layer's
  tensors (weight, bias, spatial shapes, level starts) replicated: the gradients of the
  per-image operands sharded the same way, those of the weight and bias partial sums;
- DCN v1/v2 without conv groups: the weight and bias sharded on their output channels, the
  images replicated, the output sharded on its channels (Shard(1)): the gradients of the input,
  offset and mask partial sums over the shards' channels, those of the weight and bias sharded.

Importing torch.distributed.tensor takes about half a second, too much for every import of
deformconv: the rules are registered when it has been imported (register_when_imported).
"""

import sys

import torch

from .._after_import import AfterImport

_DTENSOR = "torch.distributed.tensor"


def _optional(tensor, placement):
    return None if tensor is None else placement


def _register() -> None:
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    ops = torch.ops.deformconv
    batch, whole, channels, summed = Shard(0), Replicate(), Shard(1), Partial()

    def rules(outputs_and_inputs, others):
        # The arguments that are not tensors, to the end (as many as the call passed), take no
        # placement.
        return [(outputs, inputs + [None] * len(others)) for outputs, inputs in outputs_and_inputs]

    @register_sharding(ops.deform_conv2d.default)
    def deform_conv2d(input, offset, weight, mask, bias, *others):
        listed = [([whole], [whole, whole, whole, _optional(mask, whole), _optional(bias, whole)]),
                  ([batch], [batch, batch, whole, _optional(mask, batch),
                             _optional(bias, whole)])]
        if others[3] == 1:  # groups
            listed.append(([channels], [whole, whole, batch, _optional(mask, whole),
                                        _optional(bias, batch)]))
        return rules(listed, others)

    @register_sharding(ops.deform_conv2d_backward.default)
    def deform_conv2d_backward(grad_output, input, offset, weight, mask, *others):
        listed = [([whole] * 3 + [_optional(mask, whole), whole],
                   [whole, whole, whole, whole, _optional(mask, whole)]),
                  ([batch, batch, summed, _optional(mask, batch), summed],
                   [batch, batch, batch, whole, _optional(mask, batch)])]
        if others[3] == 1:  # groups
            listed.append(([summed, summed, batch, _optional(mask, summed), batch],
                           [channels, whole, whole, batch, _optional(mask, whole)]))
        return rules(listed, others)

    def per_image(op, images):
        """Every output and the first `images` arguments, all the op's tensors, per image."""

        @register_sharding(op)
        def rule(*arguments):
            outputs = len(op._schema.returns)
            return rules([([whole] * outputs, [whole] * images),
                          ([batch] * outputs, [batch] * images)], arguments[images:])

    per_image(ops.dcnv3.default, 3)
    per_image(ops.dcnv3_backward.default, 4)
    per_image(ops.dcnv4.default, 2)
    per_image(ops.dcnv4_backward.default, 3)

    @register_sharding(ops.ms_deform_attn.default)
    def ms_deform_attn(value, spatial_shapes, level_start_index, locations, weights, *others):
        return rules([([whole], [whole] * 5), ([batch], [batch, whole, whole, batch, batch])],
                     others)

    @register_sharding(ops.ms_deform_attn_backward.default)
    def ms_deform_attn_backward(grad_output, value, spatial_shapes, level_start_index,
                                locations, weights, *others):
        return rules([([whole] * 3, [whole] * 6),
                      ([batch] * 3, [batch, batch, whole, whole, batch, batch])], others)


def _at_dtensor_import(module) -> None:
    _AT_DTENSOR_IMPORT.uninstall()  # once
    _register()


_AT_DTENSOR_IMPORT = AfterImport(lambda name: name == _DTENSOR, _at_dtensor_import)


def register_when_imported() -> None:
    """Registers the rules now if DTensor has been imported, else once it is."""
    if not torch.distributed.is_available():
        return
    if _DTENSOR in sys.modules:
        _register()
    else:
        _AT_DTENSOR_IMPORT.install()
