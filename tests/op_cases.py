"""Each op called on small float64 operands, for the tests of what surrounds the ops (autograd,
torch.func): CASES maps an op to a builder of (operands, call), the operands a dict of the
tensors that the op differentiates and call(operands) the op on them, its other arguments
fixed; GRADIENTS names the differentiable operands in the backward op's output_mask order;
OpCalls records the deformconv ops that reach the kernels."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dcnv3_reference
import deform_conv2d_cases
import ms_deform_attn_reference


def deform_conv2d_case(geometry=deform_conv2d_cases.GEOMETRIES[2]):
    input, offset, weight, bias, mask = deform_conv2d_cases.make_operands(geometry)
    operands = dict(input=input, offset=offset, weight=weight, mask=mask, bias=bias)

    def call(t):
        return torch.ops.deformconv.deform_conv2d(
            t["input"], t["offset"], t["weight"], t["mask"], t["bias"], geometry.stride,
            geometry.padding, geometry.dilation, geometry.groups, geometry.offset_groups, 0)

    return operands, call


def dcnv3_case(op):
    geometry = dcnv3_reference.GEOMETRIES[2]
    input, offset, mask = dcnv3_reference.random_operands(2, 5, 6, geometry)
    (kh, kw), (sh, sw), (ph, pw), (dh, dw), group, group_channels = geometry
    others = (kh, kw, sh, sw, ph, pw, dh, dw, group, group_channels, 0.5, 0, False)
    if op == "dcnv3":
        return (dict(input=input, offset=offset, mask=mask),
                lambda t: torch.ops.deformconv.dcnv3(t["input"], t["offset"], t["mask"], *others))
    offset_mask = dcnv3_reference.pack_offset_mask(offset, mask, group, padding_value=0.0)
    return (dict(input=input, offset_mask=offset_mask),
            lambda t: torch.ops.deformconv.dcnv4(t["input"], t["offset_mask"], *others))


def ms_deform_attn_case():
    value, shapes, starts, locations, weights = ms_deform_attn_reference.make_operands(
        [(4, 6), (2, 3)])
    operands = dict(value=value, sampling_locations=locations, attention_weights=weights)

    def call(t):
        return torch.ops.deformconv.ms_deform_attn(t["value"], shapes, starts,
                                                   t["sampling_locations"],
                                                   t["attention_weights"], 64)

    return operands, call


CASES = {"deform_conv2d": deform_conv2d_case, "dcnv3": lambda: dcnv3_case("dcnv3"),
         "dcnv4": lambda: dcnv3_case("dcnv4"), "ms_deform_attn": ms_deform_attn_case}
# The backward ops' gradients, in their output_mask's order.
GRADIENTS = {"deform_conv2d": ("input", "offset", "weight", "mask", "bias"),
             "dcnv3": ("input", "offset", "mask"), "dcnv4": ("input", "offset_mask"),
             "ms_deform_attn": ("value", "sampling_locations", "attention_weights")}


class OpCalls(TorchDispatchMode, list):
    """The deformconv ops called under it, below autograd and torch.func (as the kernels get
    them), as (op name, {argument name: value}), the arguments that the dispatcher leaves out
    at their defaults filled in."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "deformconv":
            arguments = {argument.name: argument.default_value
                         for argument in func._schema.arguments if argument.has_default_value()}
            arguments.update(zip((argument.name for argument in func._schema.arguments), args))
            arguments.update(kwargs or {})
            self.append((func._opname, arguments))
        return func(*args, **(kwargs or {}))
