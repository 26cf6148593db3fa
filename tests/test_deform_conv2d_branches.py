"""Every path of the DCN v1/v2 driver and launchers, forced one at a time (by size, dtype, thread
count, the oneDNN switch or DEFORMCONV_FUSED_FORWARD) and checked to have run through the branch
trace (Note [Branch trace]), so that a change of a threshold cannot route a test around the path
it names. On each path, in four dtypes: the forward and all five gradients against the float64
reference, and every combination of operands that need a gradient (31 with a mask, 15 without)
through autograd against the gradients computed with all of them; each under every copy of
the CPU kernels that this CPU runs (the cpu_copy fixture). The same for the CUDA
launchers under the emulator; DCNv3 and DCNv4 are in tests/test_dcnv3_branches.py. The list of
branches and the tests that force them is in docs/testing.md."""

import contextlib
from dataclasses import dataclass, field
from typing import FrozenSet

import pytest
import torch

import deformconv
from branching import (assert_close_at, branch_trace, channel_loops, opmath_bytes,
                       requested_subsets, threads, vector_bytes)
from deform_conv2d_cases import Geometry, make_operands
from deform_conv2d_reference import deform_conv2d_reference

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
OPERANDS = ("input", "offset", "weight", "bias", "mask")


@dataclass(frozen=True)
class Path:
    """A path of the CPU op: its operands, and how it is forced. `onednn` runs in float32 only
    (the GEMMs as oneDNN convolutions); the others run in every dtype, float32 with oneDNN off.
    `expect` names branches that must run as well as those of the forward and backward kinds."""
    name: str
    geometry: Geometry
    onednn: bool
    fused: bool
    im2col_step: int = 0
    threads: int = 2
    modulated: bool = True
    bias: bool = True
    expect: FrozenSet[str] = field(default_factory=frozenset)

    def __str__(self):
        return self.name

    def dtypes(self):
        return [torch.float32] if self.onednn else DTYPES

    def forward_branch(self):
        if self.fused:
            return "deform_conv2d.forward.fused"
        return "deform_conv2d.forward." + ("onednn" if self.onednn else "bmm")

    def backward_branch(self):
        if not self.onednn:
            return "deform_conv2d.backward.bmm"
        # oneDNN's backward in the AVX-512 copy of the CPU kernels, ATen's mm in place in the
        # others (Note [Backward GEMMs in place]).
        return "deform_conv2d.backward." + ("onednn" if vector_bytes() == 64 else "mm")


# 7 x 7 output pixels: an odd count, which no block of pixels of the fused forward divides.
SMALL = Geometry("small", 2, 8, 6, 7, 7, (3, 3), padding=(1, 1))
# 2 conv groups, 3 deform groups: channel runs cut at both kinds of boundary; 60 output channels
# a conv group, which the fused forward takes in vectors of two registers, of one, and one by one.
GROUPED = Geometry("grouped", 3, 6, 120, 6, 7, (2, 3), stride=(1, 2), padding=(1, 1),
                   dilation=(2, 1), groups=2, offset_groups=3)
# 12 channels a deform group: the offset/mask gradient's 8-channel vector loop and its tail;
# 16 in each conv group: two vectors.
LANES = Geometry("lanes", 2, 24, 16, 6, 5, (3, 3), padding=(1, 1), offset_groups=2)
LANES_GROUPED = Geometry("lanes-grouped", 2, 32, 8, 5, 6, (3, 3), padding=(1, 1), groups=2)
# 300 input channels: the fused forward multiplies a weight panel over them in passes (of 128
# or 256 channels, Note [Weight panels]), the last one short, and samples a stretch's 30 pixels
# in runs of one or two blocks; 40 output channels: panels of two vectors, of one and the rest.
DEEP = Geometry("deep", 1, 300, 40, 5, 6, (3, 3), padding=(1, 1))
# 64 x 64 output pixels of 32 channels in blocks of 2 images: several windows in every dtype
# (the CPU's window budget is 4 MiB of columns and sampling plans), several blocks.
TILED = Geometry("tiled", 4, 32, 8, 64, 64, (3, 3), padding=(1, 1))
# One image of 80 x 80 output pixels and 64 channels: at least 4 forward windows of float32,
# 2 a thread.
WIDE = Geometry("wide", 1, 64, 8, 80, 80, (3, 3), padding=(1, 1))

PATHS = [
    Path("fused-onednn", SMALL, onednn=True, fused=True),
    Path("gemm-onednn", SMALL, onednn=True, fused=False),
    Path("fused-bmm", SMALL, onednn=False, fused=True),
    Path("gemm-bmm", SMALL, onednn=False, fused=False),
    Path("v1-fused-onednn", SMALL, onednn=True, fused=True, modulated=False),
    Path("v1-gemm-bmm", SMALL, onednn=False, fused=False, modulated=False),
    # Without a bias the bmm forward writes its products (bmm_out) instead of adding them to
    # the bias (baddbmm); oneDNN's convolution takes the bias as an operand.
    Path("no-bias-gemm-bmm", SMALL, onednn=False, fused=False, bias=False),
    Path("no-bias-gemm-onednn", SMALL, onednn=True, fused=False, bias=False),
    Path("v1-no-bias-fused", SMALL, onednn=False, fused=True, modulated=False, bias=False),
    Path("groups-fused", GROUPED, onednn=False, fused=True),
    Path("deep-fused", DEEP, onednn=False, fused=True),
    Path("groups-gemm", GROUPED, onednn=False, fused=False),
    Path("offset-groups-onednn", LANES, onednn=True, fused=False),
    Path("offset-groups-bmm", LANES, onednn=False, fused=False),
    Path("lanes-groups", LANES_GROUPED, onednn=False, fused=False),
    Path("small-batch-stages", Geometry("one", 1, 8, 6, 7, 8, (3, 3), padding=(1, 1)),
         onednn=True, fused=False, expect=frozenset({"deform_conv2d.forward.stages"})),
    Path("images-per-thread-onednn", Geometry("four", 4, 8, 6, 7, 8, (3, 3), padding=(1, 1)),
         onednn=True, fused=False,
         expect=frozenset({"deform_conv2d.forward.images_per_thread"})),
    Path("images-per-thread-bmm", Geometry("four", 4, 8, 6, 7, 8, (3, 3), padding=(1, 1)),
         onednn=False, fused=False,
         expect=frozenset({"deform_conv2d.forward.images_per_thread"})),
    Path("windows-per-thread", WIDE, onednn=True, fused=False,
         expect=frozenset({"deform_conv2d.forward.windows_per_thread",
                           "deform_conv2d.forward.windows"})),
    Path("windows-blocks-onednn", TILED, onednn=True, fused=False, im2col_step=2,
         expect=frozenset({"deform_conv2d.forward.windows", "deform_conv2d.forward.blocks",
                           "deform_conv2d.backward.windows", "deform_conv2d.backward.blocks"})),
    Path("windows-blocks-bmm", TILED, onednn=False, fused=False, im2col_step=2,
         expect=frozenset({"deform_conv2d.forward.windows", "deform_conv2d.forward.blocks",
                           "deform_conv2d.backward.windows", "deform_conv2d.backward.blocks"})),
    Path("one-thread", SMALL, onednn=True, fused=False, threads=1,
         expect=frozenset({"deform_conv2d.forward.stages"})),
]

FORWARD_KINDS = {"deform_conv2d.forward.fused", "deform_conv2d.forward.onednn",
                 "deform_conv2d.forward.bmm"}
BACKWARD_KINDS = {"deform_conv2d.backward.onednn", "deform_conv2d.backward.mm",
                  "deform_conv2d.backward.bmm"}


def path_cases():
    return [pytest.param(path, dtype, id=f"{path}-{str(dtype).removeprefix('torch.')}")
            for path in PATHS for dtype in path.dtypes()]


@pytest.fixture
def forced(monkeypatch):
    """A context in which a path's switches (variables of the environment) are set."""
    @contextlib.contextmanager
    def apply(path):
        with monkeypatch.context() as patch:
            patch.setenv("DEFORMCONV_FUSED_FORWARD", "1" if path.fused else "0")
            patch.setenv("DEFORMCONV_ONEDNN_GEMMS", "1" if path.onednn else "0")
            yield
    return apply


def operands_of(path, dtype):
    """The path's operands in `dtype` (offsets off integer coordinates), in order
    (input, offset, weight, bias, mask), mask None for DCN v1."""
    input, offset, weight, bias, mask = make_operands(path.geometry, with_mask=path.modulated,
                                                      with_bias=path.bias, offset_scale=2.0,
                                                      seed=3)
    offset = offset + 0.0625  # never an exact integer after rounding to bfloat16
    return [None if t is None else t.to(dtype) for t in (input, offset, weight, bias, mask)]


def run(path, operands, requested, grad_output=None):
    """Output and the gradients of the operands in `requested` through autograd (None for the
    others), and the branches that ran."""
    g = path.geometry
    leaves = [None if t is None else t.detach().clone().requires_grad_(wanted)
              for t, wanted in zip(operands, requested)]
    x, o, w, b, m = leaves
    with branch_trace() as taken:
        out = deformconv.deform_conv2d(x, o, w, b, g.stride, g.padding, g.dilation, m,
                                       im2col_step=path.im2col_step)
        if grad_output is None:
            grads = [None] * 5
        else:
            wanted = [t for t in leaves if t is not None and t.requires_grad]
            computed = iter(torch.autograd.grad(out, wanted, grad_output))
            grads = [next(computed) if t is not None and t.requires_grad else None
                     for t in leaves]
    return out, grads, taken


def gradient_for(out, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(out.shape, generator=generator, dtype=torch.float64).to(out.dtype)


def expected_branches(path, dtype):
    names = {path.forward_branch(), path.backward_branch()} | set(path.expect)
    if path.threads > 1:
        # Tasks ran on a thread besides the caller's: the library has no OpenMP flags of its
        # own (Note [Parallel regions through ATen]), so this is ATen's region at work; and the
        # mm backward's GEMMs, a share of the columns a thread, in a region of their own.
        names.add("parallel.other_threads")
        if path.backward_branch() == "deform_conv2d.backward.mm":
            names.add("deform_conv2d.backward.mm.other_threads")
    if path.fused:
        width = vector_bytes() // opmath_bytes(dtype)
        per_group = path.geometry.out_channels // path.geometry.groups
        names |= channel_loops("deform_conv2d.cpu.fused_forward", per_group,
                               [2 * width, width])
    return names


def assert_path_ran(path, dtype, taken, *, backward):
    expected = expected_branches(path, dtype)
    if not backward:
        expected = {name for name in expected if ".backward." not in name}
    assert expected <= taken, f"expected {sorted(expected - taken)} to run; ran {sorted(taken)}"
    assert len(taken & FORWARD_KINDS) == 1, sorted(taken)
    if path.threads == 1:
        assert not {name for name in taken if name.endswith(".other_threads")}, sorted(taken)
    if backward:
        assert len(taken & BACKWARD_KINDS) == 1, sorted(taken)


@pytest.mark.parametrize("path,dtype", path_cases())
def test_path_matches_reference_with_every_gradient(cpu_copy, path, dtype, forced):
    operands = operands_of(path, dtype)
    exact = [None if t is None else t.double().requires_grad_() for t in operands]
    g = path.geometry
    expected = deform_conv2d_reference(exact[0], exact[1], exact[2], exact[3], g.stride,
                                       g.padding, g.dilation, exact[4])
    grad_output = gradient_for(expected)
    present = [t for t in exact if t is not None]
    expected_grads = iter(torch.autograd.grad(expected, present, grad_output))
    with threads(path.threads), forced(path):
        out, grads, taken = run(path, operands, [t is not None for t in operands],
                                grad_output.to(dtype))
    assert_path_ran(path, dtype, taken, backward=True)
    assert out.dtype == dtype
    assert_close_at(out, expected, dtype, "output")
    for name, grad, operand in zip(OPERANDS, grads, exact):
        if operand is not None:
            assert grad.dtype == dtype
            assert_close_at(grad, next(expected_grads), dtype, name)


@pytest.mark.parametrize("path,dtype", path_cases())
def test_path_with_every_combination_of_requested_gradients(cpu_copy, path, dtype, forced):
    operands = operands_of(path, dtype)
    present = [t is not None for t in operands]
    with threads(path.threads), forced(path):
        out, _, _ = run(path, operands, present)
        grad_output = gradient_for(out)
        _, all_grads, _ = run(path, operands, present, grad_output)
        for subset in requested_subsets(sum(present)):
            flags = iter(subset)
            requested = [next(flags) if here else False for here in present]
            _, grads, taken = run(path, operands, requested, grad_output)
            if requested[:3] != [False] * 3 or requested[4]:
                assert_path_ran(path, dtype, taken, backward=True)
            for name, wanted, grad, full in zip(OPERANDS, requested, grads, all_grads):
                if wanted:
                    assert_close_at(grad, full, dtype, f"{name} of {requested}")


@pytest.mark.parametrize("path", [path for path in PATHS if path.modulated], ids=str)
def test_backward_op_computes_only_what_is_asked(cpu_copy, path, forced):
    # The backward op itself, every output_mask: the gradients asked for equal those of the
    # full set, the others come back as None (not computed).
    operands = operands_of(path, torch.float32)
    x, o, w, b, m = operands
    g = path.geometry
    arguments = ([*g.stride], [*g.padding], [*g.dilation], g.groups, g.offset_groups,
                 path.im2col_step)
    with threads(path.threads), forced(path):
        grad_output = gradient_for(run(path, operands, [False] * 5)[0])
        backward = torch.ops.deformconv.deform_conv2d_backward
        full = backward(grad_output, x, o, w, m, *arguments, [True] * 5)
        for output_mask in requested_subsets(5):
            grads = backward(grad_output, x, o, w, m, *arguments, list(output_mask))
            for name, wanted, grad, expected in zip(("input", "offset", "weight", "mask",
                                                     "bias"), output_mask, grads, full):
                if wanted:
                    assert_close_at(grad, expected, torch.float32, f"{name} of {output_mask}")
                else:
                    assert grad is None, f"{name} of {output_mask}"


@pytest.mark.parametrize("path", PATHS, ids=str)
def test_path_in_inference_mode(path, forced):
    # The worker threads of a parallel region carry none of the caller's thread-local state, and
    # run ATen ops (the GEMMs) outside "below autograd": with grad mode on there, oneDNN's
    # convolution with the bias of a module (which requires grad) would save an inference tensor
    # for backward, which raises (Note [Parallel regions through ATen]). Forward and backward op
    # in inference mode give the same bits as outside it.
    operands = operands_of(path, torch.float32)
    x, o, w, b, m = [None if t is None else t.requires_grad_() for t in operands]
    g = path.geometry
    arguments = ([*g.stride], [*g.padding], [*g.dilation], g.groups, g.offset_groups,
                 path.im2col_step)
    forward = torch.ops.deformconv.deform_conv2d
    backward = torch.ops.deformconv.deform_conv2d_backward
    with threads(path.threads), forced(path), torch.no_grad():
        expected = forward(x, o, w, m, b, *arguments)
        expected_grads = backward(gradient_for(expected), x, o, w, m, *arguments, [True] * 5)
    with threads(path.threads), forced(path):
        with torch.inference_mode(), branch_trace() as taken:
            out = forward(x, o, w, m, b, *arguments)
            grads = backward(gradient_for(out), x, o, w, m, *arguments, [True] * 5)
    assert_path_ran(path, torch.float32, taken, backward=True)
    assert out.is_inference()
    assert torch.equal(out, expected)
    for name, grad, expected_grad in zip(("input", "offset", "weight", "mask", "bias"), grads,
                                         expected_grads):
        assert (grad is None) == (expected_grad is None), name
        if grad is not None:
            assert torch.equal(grad, expected_grad), name


# 60 output channels: the in-place transposition of a contiguous weight gradient goes in shares
# of 8 output channels, the last one short (4); a 2 x 3 kernel, whose (C_in, K) matrices are not
# square.
WEIGHT_LAYOUT_GEOMETRY = Geometry("weight-layouts", 2, 5, 60, 6, 7, (2, 3), padding=(1, 1))
WEIGHT_LAYOUTS = {
    # (C_out, kh, kw, C_in) in memory: weight_rows' order, the GEMMs add into grad_weight.
    "channels-last": ("rows_layout", lambda w: w.to(memory_format=torch.channels_last)),
    # (C_out, C_in, kh, kw): summed in grad_weight's memory, transposed in place.
    "contiguous": ("transposed_in_place", lambda w: w.contiguous()),
    # (C_out, C_in, kw, kh) in memory, dense but neither: a buffer of its own.
    "kernel-transposed": ("own_buffer",
                          lambda w: w.transpose(2, 3).contiguous().transpose(2, 3)),
}


@pytest.mark.parametrize("layout", WEIGHT_LAYOUTS)
@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "bmm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_weight_gradient_in_each_layout(cpu_copy, layout, onednn, dtype, forced):
    # Note [The weight gradient in its own memory]: the weight gradient keeps the weight's
    # strides and equals the reference's, whichever way it was summed.
    if onednn and dtype != torch.float32:
        pytest.skip("oneDNN's GEMMs run in float32 only")
    branch, relayout = WEIGHT_LAYOUTS[layout]
    path = Path(f"weight-{layout}", WEIGHT_LAYOUT_GEOMETRY, onednn=onednn, fused=False)
    operands = operands_of(path, dtype)
    operands[2] = relayout(operands[2])
    g = path.geometry
    exact = [t.double().requires_grad_() for t in operands]
    expected = deform_conv2d_reference(exact[0], exact[1], exact[2], exact[3], g.stride,
                                       g.padding, g.dilation, exact[4])
    grad_output = gradient_for(expected)
    (expected_weight_grad,) = torch.autograd.grad(expected, [exact[2]], grad_output)
    with threads(path.threads), forced(path):
        _, grads, taken = run(path, operands, [True, True, True, True, True],
                              grad_output.to(dtype))
    assert_path_ran(path, dtype, taken, backward=True)
    assert f"deform_conv2d.weight_gradient.{branch}" in taken, sorted(taken)
    assert grads[2].stride() == operands[2].stride()
    assert_close_at(grads[2], expected_weight_grad, dtype, "weight")
