"""The ops' autograd, registered from Python (deformconv/ops/_autograd.py): for every op and
every subset of its differentiable operands, the backward op is called once, with the
output_mask of exactly the gradients that autograd asks for, and those gradients arrive; and
the backward op is told PyTorch's deterministic mode, whatever the gradients asked for."""

import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dcnv3_reference
import deform_conv2d_cases
import ms_deform_attn_reference


class BackwardOpCalls(TorchDispatchMode):
    """Records the output_mask and the deterministic flag (the last two arguments) of every
    deformconv backward op called under it."""

    def __init__(self):
        super().__init__()
        self.output_masks = []
        self.deterministic = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "deformconv" and func._opname.endswith("_backward"):
            # The dispatcher leaves out a trailing argument equal to its default.
            names = [argument.name for argument in func._schema.arguments]
            given = {**dict(zip(names, args)), **(kwargs or {})}
            self.output_masks.append((func._opname, list(given["output_mask"])))
            self.deterministic.append(given.get("deterministic", False))
        return func(*args, **(kwargs or {}))


def deform_conv2d_case():
    geometry = deform_conv2d_cases.GEOMETRIES[2]
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


def subsets(op):
    names = GRADIENTS[op]
    return [(op, wanted) for count in range(1, len(names) + 1)
            for wanted in itertools.combinations(names, count)]


@pytest.mark.parametrize("op,wanted", [case for op in CASES for case in subsets(op)],
                         ids=lambda value: "+".join(value) if isinstance(value, tuple) else value)
def test_the_backward_op_computes_only_what_autograd_asks_for(op, wanted):
    operands, call = CASES[op]()
    for name in wanted:
        operands[name].requires_grad_()
    output = call(operands)
    assert type(output.grad_fn).__name__ == f"deformconv_{op}Backward"
    with BackwardOpCalls() as calls:
        output.backward(torch.ones_like(output))
    assert calls.output_masks == [(f"{op}_backward",
                                   [name in wanted for name in GRADIENTS[op]])]
    assert calls.deterministic == [False]
    for name, tensor in operands.items():
        if name in wanted:
            assert tensor.grad is not None and tensor.grad.shape == tensor.shape, name
        else:
            assert tensor.grad is None, name


def test_no_graph_is_recorded_where_nothing_needs_a_gradient():
    operands, call = deform_conv2d_case()
    operands["input"].requires_grad_()
    with torch.no_grad():
        assert call(operands).grad_fn is None
    operands["input"].requires_grad_(False)
    assert call(operands).grad_fn is None


@pytest.mark.parametrize("op", list(CASES))
def test_deterministic_mode_reaches_the_backward_op_without_an_alert(op):
    # On CUDA the flag takes the gathered input gradient (the emulated tests show its bits);
    # here the op is only told, and nothing alerts, whichever gradients are asked for.
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for wanted in GRADIENTS[op][:2]:
            operands, call = CASES[op]()
            operands[wanted].requires_grad_()
            output = call(operands)
            with BackwardOpCalls() as calls:
                output.backward(torch.ones_like(output))
            assert calls.deterministic == [True], wanted
            assert operands[wanted].grad is not None
    finally:
        torch.use_deterministic_algorithms(previous)
