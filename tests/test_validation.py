"""Every bad input gets a clear exception naming the argument, what was expected and what came,
from the op (so TorchScript and C++ users get it too) and from its fake kernel alike; non-finite
and huge offsets never crash or read out of bounds."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import deformconv
from ms_deform_attn_reference import DEFAULT_OPTIONS

OP = torch.ops.deformconv.deform_conv2d.default


def good_args(**changes):
    """A valid call of the op: N=2, C_in=4, C_out=6, 5x5 input, 3x3 kernel, padding 1,
    groups 2, offset groups 2; `changes` replaces arguments by name."""
    args = dict(
        input=torch.randn(2, 4, 5, 5), offset=torch.randn(2, 2 * 2 * 9, 5, 5),
        weight=torch.randn(6, 2, 3, 3), mask=torch.rand(2, 2 * 9, 5, 5), bias=torch.randn(6),
        stride=[1, 1], padding=[1, 1], dilation=[1, 1], groups=2, offset_groups=2,
        im2col_step=0)
    args.update(changes)
    return list(args.values())


BAD_CALLS = [
    ("input-dims", dict(input=torch.randn(4, 5, 5)), ValueError,
     r"expected input to be a 4-D tensor .*but got a 3-D tensor"),
    ("offset-dims", dict(offset=torch.randn(2, 36, 25)), ValueError,
     r"expected offset to be a 4-D tensor"),
    ("weight-dims", dict(weight=torch.randn(6, 2, 9)), ValueError,
     r"expected weight to be a 4-D tensor"),
    ("mask-dims", dict(mask=torch.rand(2, 18, 25)), ValueError, r"expected mask to be a 4-D"),
    ("bias-dims", dict(bias=torch.randn(6, 1)), ValueError, r"expected bias to be a 1-D"),
    ("offset-channels", dict(offset=torch.randn(2, 16, 5, 5)), ValueError,
     r"expected offset to have 36 channels \(2 \* offset_groups \* kH \* kW\), but got 16"),
    ("mask-channels", dict(mask=torch.rand(2, 9, 5, 5)), ValueError,
     r"expected mask to have 18 channels \(offset_groups \* kH \* kW\), but got 9"),
    ("offset-size", dict(offset=torch.randn(2, 36, 4, 5)), ValueError,
     r"expected offset to have the output size 5 x 5, but got 4 x 5"),
    ("mask-size", dict(mask=torch.rand(2, 18, 5, 6)), ValueError,
     r"expected mask to have the output size 5 x 5, but got 5 x 6"),
    ("offset-batch", dict(offset=torch.randn(3, 36, 5, 5)), ValueError,
     r"expected offset to have the batch size of input \(2\), but got 3"),
    ("mask-batch", dict(mask=torch.rand(1, 18, 5, 5)), ValueError,
     r"expected mask to have the batch size of input \(2\), but got 1"),
    ("weight-in-channels", dict(weight=torch.randn(6, 3, 3, 3)), ValueError,
     r"expected weight to have 2 input channels \(in_channels / groups = 4 / 2\), but got 3"),
    ("in-not-divisible", dict(groups=3, weight=torch.randn(6, 1, 3, 3)), ValueError,
     r"expected in_channels \(4\) to be divisible by groups \(3\)"),
    ("out-not-divisible", dict(weight=torch.randn(5, 2, 3, 3), bias=torch.randn(5)), ValueError,
     r"expected out_channels \(5, weight.size\(0\)\) to be divisible by groups \(2\)"),
    ("offset-groups-not-dividing", dict(offset_groups=3, offset=torch.randn(2, 54, 5, 5),
                                        mask=torch.rand(2, 27, 5, 5)), ValueError,
     r"expected in_channels \(4\) to be divisible by offset_groups \(3\)"),
    ("bias-size", dict(bias=torch.randn(5)), ValueError,
     r"expected bias to have 6 elements \(out_channels\), but got 5"),
    ("integer-dtype", dict(input=torch.ones(2, 4, 5, 5, dtype=torch.int64)), ValueError,
     r"expected input to have a floating point dtype .*but got Long"),
    ("dtype-mismatch", dict(weight=torch.randn(6, 2, 3, 3, dtype=torch.float64)), ValueError,
     r"expected weight to have the dtype of input \(Float\), but got Double"),
    ("stride", dict(stride=[0, 1]), ValueError, r"expected stride to be at least 1, but got"),
    ("dilation", dict(dilation=[1, -1]), ValueError, r"expected dilation to be at least 1"),
    ("padding", dict(padding=[-1, 0]), ValueError, r"expected padding to be at least 0"),
    ("groups", dict(groups=0), ValueError, r"expected groups to be at least 1, but got 0"),
    ("offset-groups", dict(offset_groups=0), ValueError,
     r"expected offset_groups to be at least 1, but got 0"),
    ("im2col-step", dict(im2col_step=-1), ValueError,
     r"expected im2col_step to be positive, or 0 for automatic, but got -1"),
    ("empty-output", dict(input=torch.randn(2, 4, 1, 1), offset=torch.randn(2, 36, 1, 1),
                          mask=torch.rand(2, 18, 1, 1), padding=[0, 0]), ValueError,
     r"expected the padded input \(1 x 1\) to be at least as large as the dilated kernel"),
    ("empty-input", dict(input=torch.randn(2, 4, 0, 5)), ValueError,
     r"expected input to have non-zero channels, height and width"),
    # 2^31 rows, expanded from one element: the CPU launchers index rows in 32 bits.
    ("huge-height", dict(input=torch.zeros(1, 1, 1, 1).expand(2, 4, 2 ** 31, 5),
                         offset=torch.zeros(1, 1, 1, 1).expand(2, 36, 2 ** 31, 5),
                         mask=torch.zeros(1, 1, 1, 1).expand(2, 18, 2 ** 31, 5)), ValueError,
     r"expected input's height and width to be at most 2147483646, but got 2147483648 x 5"),
]


@pytest.mark.parametrize("name,changes,error,match", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_op_rejects(name, changes, error, match):
    with pytest.raises(error, match=match):
        OP(*good_args(**changes))


@pytest.mark.parametrize("name,changes,error,match", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_fake_kernel_rejects_the_same(name, changes, error, match):
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                for a in good_args(**changes)]
        with pytest.raises(error, match=match):
            OP(*args)


def test_backward_op_checks_grad_output():
    args = good_args()
    del args[4]  # the backward op takes no bias
    with pytest.raises(ValueError, match=r"expected grad_output of shape \[2, 6, 5, 5\]"):
        torch.ops.deformconv.deform_conv2d_backward(torch.randn(2, 6, 4, 5), *args,
                                                    [True] * 5)


def backward_calls_with_mask(mask):
    """Each stable-ABI backward op called with `mask` as its output_mask, on valid operands."""
    value, shapes, starts = torch.randn(1, 4, 2, 4), torch.tensor([[2, 2]]), torch.tensor([0])
    locations, weights = torch.rand(1, 3, 2, 1, 2, 2), torch.rand(1, 3, 2, 1, 2)
    geometry = [3, 3, 1, 1, 1, 1, 1, 1, 2, 4, 1.0, 64, False]
    x = torch.randn(1, 5, 5, 8)
    return {
        "ms_deform_attn_backward": lambda: torch.ops.deformconv.ms_deform_attn_backward(
            torch.randn(1, 3, 8), value, shapes, starts, locations, weights, *DEFAULT_OPTIONS,
            mask),
        "dcnv3_backward": lambda: torch.ops.deformconv.dcnv3_backward(
            torch.randn(1, 5, 5, 8), x, torch.randn(1, 5, 5, 36), torch.rand(1, 5, 5, 18),
            *geometry, mask),
        "dcnv4_backward": lambda: torch.ops.deformconv.dcnv4_backward(
            torch.randn(1, 5, 5, 8), x, torch.randn(1, 5, 5, 54), *geometry, mask),
    }


@pytest.mark.parametrize("op", ["ms_deform_attn_backward", "dcnv3_backward", "dcnv4_backward"])
def test_backward_ops_check_the_length_of_output_mask(op):
    # The schema's bool[N] reaches the kernel as a list of any length.
    gradients = {"ms_deform_attn_backward": 3, "dcnv3_backward": 3, "dcnv4_backward": 2}[op]
    assert len(backward_calls_with_mask([True] * gradients)[op]()) == gradients
    for wrong in (gradients - 1, gradients + 1):
        with pytest.raises(ValueError, match=rf"{op}\(\): expected output_mask to have "
                                             rf"{gradients} entries, but got {wrong}"):
            backward_calls_with_mask([True] * wrong)[op]()


def backward_arguments():
    """Each backward op's valid arguments by schema name, output_mask asking for every
    gradient (deterministic left to its default)."""
    value, shapes, starts = torch.randn(1, 4, 2, 4), torch.tensor([[2, 2]]), torch.tensor([0])
    locations, weights = torch.rand(1, 3, 2, 1, 2, 2), torch.rand(1, 3, 2, 1, 2)
    geometry = [3, 3, 1, 1, 1, 1, 1, 1, 2, 4, 1.0, 64, False]
    x = torch.randn(1, 5, 5, 8)
    deform_conv2d = good_args()
    del deform_conv2d[4]  # the backward op takes no bias
    positional = {
        "deform_conv2d_backward": [torch.randn(2, 6, 5, 5), *deform_conv2d, [True] * 5],
        "ms_deform_attn_backward": [torch.randn(1, 3, 8), value, shapes, starts, locations,
                                    weights, *DEFAULT_OPTIONS, [True] * 3],
        "dcnv3_backward": [torch.randn(1, 5, 5, 8), x, torch.randn(1, 5, 5, 36),
                           torch.rand(1, 5, 5, 18), *geometry, [True] * 3],
        "dcnv4_backward": [torch.randn(1, 5, 5, 8), x, torch.randn(1, 5, 5, 54), *geometry,
                           [True] * 2],
    }
    return {op: dict(zip([a.name for a in getattr(torch.ops.deformconv, op).default._schema
                          .arguments], values))
            for op, values in positional.items()}


@pytest.mark.parametrize("op", ["deform_conv2d_backward", "ms_deform_attn_backward",
                                "dcnv3_backward", "dcnv4_backward"])
def test_fake_kernels_take_the_arguments_as_the_schema_names_them(op):
    # The fake kernels name the arguments by the live schema: positional, by keyword, with the
    # trailing deterministic left out (the dispatcher then passes none) or given either way;
    # and they check output_mask's length, which no checks op takes, as the real kernels do.
    arguments = backward_arguments()[op]
    overload = getattr(torch.ops.deformconv, op).default
    shapes = [g.shape for g in overload(**arguments)]
    with FakeTensorMode() as mode:
        fake = {name: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v
                for name, v in arguments.items()}
        calls = [lambda: overload(*fake.values()),
                 lambda: overload(*fake.values(), True),
                 lambda: overload(*fake.values(), deterministic=True),
                 lambda: overload(**fake)]
        for call in calls:
            assert [g.shape for g in call()] == shapes
        with pytest.raises(ValueError, match="expected output_mask to have"):
            overload(**{**fake, "output_mask": arguments["output_mask"][1:]})


def test_functional_rejects_bad_geometry_values():
    x, o, w = torch.randn(1, 2, 5, 5), torch.randn(1, 18, 3, 3), torch.randn(2, 2, 3, 3)
    with pytest.raises(ValueError, match=r"expected stride to be an int or a pair of ints"):
        deformconv.deform_conv2d(x, o, w, stride=(1, 1, 1))


def test_mixed_devices_rejected_by_fake_kernel():
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in good_args()]
        args[1] = mode.from_tensor(torch.randn(2, 36, 5, 5, device="meta"))
        with pytest.raises(ValueError, match=r"expected offset to be on the device of input"):
            OP(*args)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), 1e30, -1e30,
                                   2.0**31, -(2.0**31), 2.0**63, 1e300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_non_finite_and_huge_offsets_count_as_outside(value, dtype):
    torch.manual_seed(0)
    x = torch.randn(2, 4, 6, 5, dtype=dtype, requires_grad=True)
    w = torch.randn(3, 4, 3, 3, dtype=dtype, requires_grad=True)
    offset = torch.randn(2, 18, 6, 5, dtype=dtype)
    poisoned = torch.rand(offset.shape) < 0.3
    offset = torch.where(poisoned, torch.tensor(value, dtype=dtype), offset).requires_grad_()
    mask = torch.rand(2, 9, 6, 5, dtype=dtype, requires_grad=True)
    out = deformconv.deform_conv2d(x, offset, w, padding=1, mask=mask)
    # The poisoned samples contribute nothing: the same as a far-away finite offset.
    far = torch.where(poisoned, torch.tensor(1e6, dtype=dtype), offset.detach())
    expected = deformconv.deform_conv2d(x, far, w, padding=1, mask=mask)
    torch.testing.assert_close(out, expected)
    # Every gradient stays finite, that of the poisoned offsets too (they are outside: 0).
    grads = torch.autograd.grad(out.sum(), [x, offset, w, mask])
    assert all(torch.isfinite(grad).all() for grad in grads)
    assert not grads[1][poisoned].any()


def test_empty_batch_gives_empty_output_and_gradients():
    x = torch.randn(0, 4, 5, 5, requires_grad=True)
    offset = torch.randn(0, 18, 5, 5, requires_grad=True)
    w = torch.randn(3, 4, 3, 3, requires_grad=True)
    out = deformconv.deform_conv2d(x, offset, w, padding=1)
    assert out.shape == (0, 3, 5, 5)
    out.sum().backward()
    assert x.grad.shape == x.shape and offset.grad.shape == offset.shape
    assert torch.equal(w.grad, torch.zeros_like(w))
