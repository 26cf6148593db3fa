"""torch.func through every op (deformconv/ops/_autograd.py) and the ops' batching rules
(deformconv/ops/_vmap.py), in float64 against torch.autograd and Python loops over the
unbatched op; each rule's branch is told by the calls that reach the kernels (one folded call,
and of which batch or groups, or one call per element). vmap's fallback, which would loop
with a warning, is turned into an error throughout."""

import itertools

import pytest
import torch
from torch.func import functional_call, grad, jacfwd, jacrev, jvp, vjp, vmap

import deform_conv2d_cases
import deformconv
import ms_deform_attn_reference
from op_cases import CASES, GRADIENTS, OpCalls, deform_conv2d_case

pytestmark = pytest.mark.workflows

ELEMENTS = 3
# The operands that each batch element has of its own (the others are the layer's: weight, bias).
PER_SAMPLE = {"deform_conv2d": ("input", "offset", "mask"), "dcnv3": GRADIENTS["dcnv3"],
              "dcnv4": GRADIENTS["dcnv4"], "ms_deform_attn": GRADIENTS["ms_deform_attn"]}
# The argument of each op whose first dimension is the op's batch.
BATCH_ARGUMENT = {"deform_conv2d": "input", "dcnv3": "input", "dcnv4": "input",
                  "ms_deform_attn": "value"}


@pytest.fixture(autouse=True)
def no_vmap_fallback():
    torch._C._functorch._set_vmap_fallback_enabled(False)
    yield
    torch._C._functorch._set_vmap_fallback_enabled(True)


def stacked(tensor, elements=ELEMENTS):
    """`elements` different copies of tensor, stacked: the first is tensor."""
    generator = torch.Generator().manual_seed(tensor.numel())
    return torch.stack([tensor + 0.05 * element * torch.randn(tensor.shape, generator=generator,
                                                             dtype=tensor.dtype)
                        for element in range(elements)])


def kernel_calls(calls, op):
    return [arguments for name, arguments in calls if name == op]


# grad, vjp, jacrev and functional_call against torch.autograd.

@pytest.mark.parametrize("op", list(CASES))
def test_grad_and_vjp_equal_autograd(op):
    operands, call = CASES[op]()
    names = GRADIENTS[op]
    cotangent = torch.randn(call(operands).shape, dtype=torch.float64,
                            generator=torch.Generator().manual_seed(1))

    def loss(*values):
        return (call({**operands, **dict(zip(names, values))}) * cotangent).sum()

    leaves = [operands[name].detach().requires_grad_() for name in names]
    expected = torch.autograd.grad(loss(*leaves), leaves)
    values = [operands[name] for name in names]
    gradients = grad(loss, argnums=tuple(range(len(names))))(*values)
    _, pullback = vjp(lambda *v: call({**operands, **dict(zip(names, v))}), *values)
    for name, ours, pulled, theirs in zip(names, gradients, pullback(cotangent), expected):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12, msg=name)
        torch.testing.assert_close(pulled, theirs, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("op", list(CASES))
def test_jacrev_equals_autograd_jacobian(op):
    """jacrev: the backward op vmapped over the output's unit cotangents, folded into one
    call."""
    operands, call = CASES[op]()
    first = GRADIENTS[op][0]

    def outputs(value):  # a few of the outputs, to keep the Jacobian small
        return call({**operands, first: value}).flatten()[:7]

    expected = torch.autograd.functional.jacobian(outputs, operands[first])
    with OpCalls() as calls:
        jacobian = jacrev(outputs)(operands[first])
    torch.testing.assert_close(jacobian, expected, rtol=1e-12, atol=1e-12)
    assert len(kernel_calls(calls, f"{op}_backward")) == 1


def modules():
    """Each module with its inputs of one sample (no batch dimension), its parameters moved
    off their initial values (zero offsets put every sample on a pixel)."""
    torch.manual_seed(0)
    dcn = deformconv.ModulatedDeformConv2dPack(4, 6, 3, padding=1, deform_groups=2)
    dcnv3 = deformconv.DCNv3(16, group=4)
    dcnv4 = deformconv.DCNv4(16, group=2)
    attention = deformconv.MSDeformAttn(d_model=16, n_levels=2, n_heads=2, n_points=2)
    shapes = torch.tensor([[4, 6], [2, 3]])
    starts = torch.tensor([0, 24])
    reference_points = torch.rand(5, 2, 2, dtype=torch.float64)
    inputs = {
        "deform_conv2d": (dcn, lambda x: (x,), torch.randn(4, 5, 6)),
        "dcnv3": (dcnv3, lambda x: (x,), torch.randn(5, 6, 16)),
        "dcnv4": (dcnv4, lambda x: (x, (5, 6)), torch.randn(30, 16)),
        "ms_deform_attn": (attention, lambda x: (x[:5], reference_points, x,
                                                 shapes, starts), torch.randn(30, 16)),
    }
    result = {}
    for op, (module, arguments, sample) in inputs.items():
        module = module.double()
        with torch.no_grad():
            for parameter in module.parameters():
                parameter.add_(0.1 * torch.randn_like(parameter))
        result[op] = (module, arguments, sample.double())
    return result


@pytest.mark.parametrize("op", list(CASES))
def test_per_sample_gradients_of_a_module(op):
    """The recipe of torch.func's documentation: vmap(grad(loss)) over the samples, the
    parameters through functional_call, against one torch.autograd.grad per sample."""
    module, arguments, sample = modules()[op]
    samples = stacked(sample)
    parameters = {name: p.detach() for name, p in module.named_parameters()}

    def loss(parameters, x):
        batched = tuple(a.unsqueeze(0) if isinstance(a, torch.Tensor) and a.dim() > 1
                        and a.dtype.is_floating_point else a for a in arguments(x))
        return functional_call(module, parameters, batched).square().sum()

    per_sample = vmap(grad(loss), in_dims=(None, 0))(parameters, samples)
    for element in range(ELEMENTS):
        expected = torch.autograd.grad(loss(dict(module.named_parameters()), samples[element]),
                                       list(module.parameters()))
        for (name, ours), theirs in zip(per_sample.items(), expected):
            torch.testing.assert_close(ours[element], theirs, rtol=1e-10, atol=1e-12,
                                       msg=name)


# Forward mode and second derivatives: refused, naming the op.

@pytest.mark.parametrize("op", list(CASES))
def test_forward_mode_is_refused_naming_the_op(op):
    operands, call = CASES[op]()
    first = GRADIENTS[op][0]

    def output(value):
        return call({**operands, first: value})

    value = operands[first]
    message = f"{op}: forward-mode AD is not supported"
    with pytest.raises(NotImplementedError, match=message):
        jvp(output, (value,), (torch.ones_like(value),))
    with pytest.raises(NotImplementedError, match=message):
        jacfwd(output)(value)
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(value, torch.ones_like(value))
        with pytest.raises(NotImplementedError, match=message):
            output(dual)


@pytest.mark.parametrize("op", list(CASES))
def test_second_derivative_is_refused_naming_the_op(op):
    operands, call = CASES[op]()
    first = GRADIENTS[op][0]

    def gradient_norm(value):
        return grad(lambda v: call({**operands, first: v}).square().sum())(value).square().sum()

    with pytest.raises(NotImplementedError, match=f"{op}: double backward is not supported"):
        grad(gradient_norm)(operands[first])


@pytest.mark.parametrize("op", list(CASES))
def test_deterministic_mode_reaches_the_backward_op_under_grad(op):
    operands, call = CASES[op]()
    first = GRADIENTS[op][0]
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with OpCalls() as calls:
            grad(lambda v: call({**operands, first: v}).sum())(operands[first])
    finally:
        torch.use_deterministic_algorithms(previous)
    backward = kernel_calls(calls, f"{op}_backward")
    assert [arguments["deterministic"] for arguments in backward] == [True]
    assert list(backward[0]["output_mask"]) == [name == first for name in GRADIENTS[op]]


# The batching rules, forward.

def per_element(function, batched, dims):
    """function applied to each element of the batched arguments (dims: each one's vmapped
    dimension, or None for one that all share), the results stacked."""
    results = [function(*(argument if dim is None else argument.select(dim, element)
                          for argument, dim in zip(batched, dims)))
               for element in range(ELEMENTS)]
    if isinstance(results[0], tuple):
        return tuple(torch.stack(parts) for parts in zip(*results))
    return torch.stack(results)


# Where each element's operands sit: all batched at dimension 0; the first of them shared by the
# elements (in_dims None) and the others batched at dimension 1.
LAYOUTS = ["all-at-0", "first-shared-others-at-1"]


def batched_operands(operands, names, layout):
    values, dims = [], []
    for place, name in enumerate(names):
        if layout == "first-shared-others-at-1" and place == 0:
            values.append(operands[name])
            dims.append(None)
        elif layout == "first-shared-others-at-1":
            values.append(stacked(operands[name]).movedim(0, 1))
            dims.append(1)
        else:
            values.append(stacked(operands[name]))
            dims.append(0)
    return values, tuple(dims)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op", list(CASES))
def test_vmap_folds_into_the_batch(op, layout, dtype):
    operands, call = CASES[op]()
    operands = {name: value.to(dtype) for name, value in operands.items()}
    names = PER_SAMPLE[op]
    values, dims = batched_operands(operands, names, layout)

    def function(*per_sample):
        return call({**operands, **dict(zip(names, per_sample))})

    with OpCalls() as calls:
        output = vmap(function, in_dims=dims)(*values)
    expected = per_element(function, values, dims)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(output, expected, rtol=tolerance, atol=tolerance)
    (folded,) = kernel_calls(calls, op)
    batch = operands[BATCH_ARGUMENT[op]].shape[0]
    assert folded[BATCH_ARGUMENT[op]].shape[0] == ELEMENTS * batch


def test_nested_vmap_folds_both_levels_into_the_batch():
    operands, call = CASES["dcnv3"]()
    inner = stacked(operands["input"])
    outer = torch.stack([inner, inner.flip(0)])

    def function(input):
        return call({**operands, "input": input})

    with OpCalls() as calls:
        output = vmap(vmap(function))(outer)
    for first in range(2):
        for second in range(ELEMENTS):
            torch.testing.assert_close(output[first, second], function(outer[first, second]),
                                       rtol=1e-12, atol=1e-12)
    (folded,) = kernel_calls(calls, "dcnv3")
    assert folded["input"].shape[0] == 2 * ELEMENTS * operands["input"].shape[0]


DEFORM_CONV2D_GEOMETRIES = [deform_conv2d_cases.GEOMETRIES[2], deform_conv2d_cases.GEOMETRIES[4]]


@pytest.mark.parametrize("batched", [("weight",), ("weight", "bias"), ("bias",),
                                     ("input", "offset", "mask", "weight", "bias")],
                         ids="+".join)
@pytest.mark.parametrize("geometry", DEFORM_CONV2D_GEOMETRIES, ids=lambda g: g.name)
def test_deform_conv2d_per_example_weights_fold_into_the_groups(geometry, batched):
    """vmap over an ensemble: each element's weight or bias (with or without its own input)
    is one call of ELEMENTS times the groups and offset groups, deform groups spanning conv
    groups (the second geometry) included."""
    operands, call = deform_conv2d_case(geometry)
    names = ("input", "offset", "mask", "weight", "bias")
    values = [stacked(operands[name]) if name in batched else operands[name] for name in names]
    dims = tuple(0 if name in batched else None for name in names)

    def function(*arguments):
        return call(dict(zip(names, arguments)))

    with OpCalls() as calls:
        output = vmap(function, in_dims=dims)(*values)
    torch.testing.assert_close(output, per_element(function, values, dims), rtol=1e-12,
                               atol=1e-12)
    (folded,) = kernel_calls(calls, "deform_conv2d")
    assert (folded["groups"], folded["offset_groups"]) == \
        (ELEMENTS * geometry.groups, ELEMENTS * geometry.offset_groups)
    assert folded["input"].shape[0] == geometry.batch


def test_deform_conv2d_without_mask_folds_into_the_groups():
    operands, call = deform_conv2d_case()
    operands["mask"] = None
    weights = stacked(operands["weight"])
    with OpCalls() as calls:
        output = vmap(lambda w: call({**operands, "weight": w}))(weights)
    torch.testing.assert_close(
        output, per_element(lambda w: call({**operands, "weight": w}), [weights], (0,)),
        rtol=1e-12, atol=1e-12)
    (folded,) = kernel_calls(calls, "deform_conv2d")
    assert folded["mask"] is None and folded["groups"] == ELEMENTS * 2


def ms_deform_attn_levels():
    """Two sets of levels of one total size, at the same starts: each element its own."""
    value, shapes, starts, locations, weights = ms_deform_attn_reference.make_operands(
        [(4, 6), (2, 3)])
    other = torch.tensor([[6, 4], [3, 2]], dtype=shapes.dtype)
    return value, torch.stack([shapes, other, shapes]), starts, locations, weights


def test_ms_deform_attn_levels_of_each_element_take_a_call_each():
    value, shapes, starts, locations, weights = ms_deform_attn_levels()

    def function(shapes):
        return torch.ops.deformconv.ms_deform_attn(value, shapes, starts, locations, weights, 64)

    with OpCalls() as calls:
        output = vmap(function)(shapes)
    torch.testing.assert_close(output, per_element(function, [shapes], (0,)), rtol=1e-12,
                               atol=1e-12)
    assert [arguments["spatial_shapes"].tolist() for arguments in
            kernel_calls(calls, "ms_deform_attn")] == shapes.tolist()


# The batching rules, backward: per-sample gradients of every subset of the operands, through
# vmap of vjp (which asks the backward op for exactly that subset).

def subsets(op):
    names = GRADIENTS[op]
    return [(op, wanted) for count in range(1, len(names) + 1)
            for wanted in itertools.combinations(names, count)]


def per_sample_gradients(op, wanted, batched):
    """vmap(vjp) of op's gradients of `wanted`, each element with its own `batched` operands
    and cotangent, against torch.autograd.grad per element; returns the backward op's calls."""
    operands, call = CASES[op]()
    cotangents = stacked(torch.randn(call(operands).shape, dtype=torch.float64,
                                     generator=torch.Generator().manual_seed(2)))
    values = [stacked(operands[name]) for name in batched]

    def gradients(cotangent, *own):
        mine = {**operands, **dict(zip(batched, own))}
        _, pullback = vjp(lambda *v: call({**mine, **dict(zip(wanted, v))}),
                          *(mine[name] for name in wanted))
        return pullback(cotangent)

    with OpCalls() as calls:
        ours = vmap(gradients)(cotangents, *values)
    for element in range(ELEMENTS):
        mine = {**operands, **{name: value[element] for name, value in zip(batched, values)}}
        leaves = {name: mine[name].detach().requires_grad_() for name in wanted}
        expected = torch.autograd.grad(call({**mine, **leaves}), list(leaves.values()),
                                       cotangents[element])
        for name, gradient, theirs in zip(wanted, ours, expected):
            torch.testing.assert_close(gradient[element], theirs, rtol=1e-12, atol=1e-12,
                                       msg=name)
    (backward,) = kernel_calls(calls, f"{op}_backward")
    assert list(backward["output_mask"]) == [name in wanted for name in GRADIENTS[op]]
    return backward


@pytest.mark.parametrize("op,wanted", [case for op in CASES for case in subsets(op)],
                         ids=lambda value: "+".join(value) if isinstance(value, tuple) else value)
def test_per_sample_gradients_of_each_subset(op, wanted):
    """The layer's weight and bias shared: DCN v1/v2 folds its backward into the groups where
    their per-element gradients are asked for, into the batch where they are not; the other
    ops always into the batch."""
    backward = per_sample_gradients(op, wanted, PER_SAMPLE[op])
    geometry = deform_conv2d_cases.GEOMETRIES[2]
    if op == "deform_conv2d" and ("weight" in wanted or "bias" in wanted):
        assert backward["groups"] == ELEMENTS * geometry.groups
        assert backward["grad_output"].shape[0] == geometry.batch
    else:
        batch = CASES[op]()[0][BATCH_ARGUMENT[op]].shape[0]
        assert backward["grad_output"].shape[0] == ELEMENTS * batch


@pytest.mark.parametrize("wanted", [("weight",), ("input", "offset", "weight", "mask", "bias")],
                         ids="+".join)
def test_per_example_weight_gradients_fold_into_the_groups(wanted):
    """An ensemble's training step: each element its own weight and bias."""
    backward = per_sample_gradients("deform_conv2d", wanted,
                                    ("input", "offset", "mask", "weight", "bias"))
    assert backward["groups"] == ELEMENTS * deform_conv2d_cases.GEOMETRIES[2].groups


def test_ms_deform_attn_backward_with_levels_of_each_element_takes_a_call_each():
    value, shapes, starts, locations, weights = ms_deform_attn_levels()

    def value_gradient(shapes):
        _, pullback = vjp(lambda v: torch.ops.deformconv.ms_deform_attn(
            v, shapes, starts, locations, weights, 64), value)
        return pullback(torch.ones(value.shape[0], locations.shape[1],
                                   value.shape[2] * value.shape[3], dtype=value.dtype))[0]

    with OpCalls() as calls:
        ours = vmap(value_gradient)(shapes)
    torch.testing.assert_close(ours, per_element(value_gradient, [shapes], (0,)), rtol=1e-12,
                               atol=1e-12)
    assert len(kernel_calls(calls, "ms_deform_attn_backward")) == ELEMENTS
