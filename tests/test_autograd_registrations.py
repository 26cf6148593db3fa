"""The ops' autograd, registered from Python (deformconv/ops/_autograd.py): for every op and
every subset of its differentiable operands, the backward op is called once, with the
output_mask of exactly the gradients that autograd asks for, and those gradients arrive; and
the backward op is told PyTorch's deterministic mode, whatever the gradients asked for."""

import itertools

import pytest
import torch

from op_cases import CASES, GRADIENTS, OpCalls, deform_conv2d_case


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
    with OpCalls() as calls:
        output.backward(torch.ones_like(output))
    assert [(name, list(arguments["output_mask"])) for name, arguments in calls] == \
        [(f"{op}_backward", [name in wanted for name in GRADIENTS[op]])]
    assert calls[0][1]["deterministic"] is False
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
            with OpCalls() as calls:
                output.backward(torch.ones_like(output))
            assert [arguments["deterministic"] for _, arguments in calls] == [True], wanted
            assert operands[wanted].grad is not None
    finally:
        torch.use_deterministic_algorithms(previous)
