"""The PyTorch workflows of dcnv3 and dcnv4, each test over both ops: double backward (refused),
TorchScript, opcheck, torch.compile(fullgraph=True) and torch.export, and the CUDA launchers
run by the emulator (tests/cuda_emulation) against the CPU op."""

import itertools

import pytest
import torch

import deformconv
from dcnv3_reference import GEOMETRIES, pack_offset_mask, random_operands

pytestmark = pytest.mark.workflows

OPS = ["dcnv3", "dcnv4"]


def operands_of(op, geometry, *shape, dtype=torch.float64, remove_center=False,
                padding_value=0.0):
    """The op's tensor operands: DCNv3's input, offset and mask, or DCNv4's input and the same
    offsets and mask packed into offset_mask, its padding channels `padding_value`."""
    input, offset, mask = random_operands(*shape, geometry, remove_center=remove_center,
                                          dtype=dtype)
    if op == "dcnv3":
        return [input, offset, mask]
    return [input, pack_offset_mask(offset, mask, geometry[4], padding_value=padding_value)]


def flat_arguments(geometry, offset_scale, im2col_step=0, remove_center=False):
    (kh, kw), (sh, sw), (ph, pw), (dh, dw), G, D = geometry
    return (kh, kw, sh, sw, ph, pw, dh, dw, G, D, offset_scale, im2col_step, remove_center)


@pytest.mark.parametrize("op", OPS)
def test_double_backward_raises(op):
    geometry = GEOMETRIES[1]
    operands = [t.requires_grad_() for t in operands_of(op, geometry, 1, 4, 4)]
    out = getattr(deformconv, op)(*operands, *flat_arguments(geometry, 1.0))
    (grad_input,) = torch.autograd.grad(out.sum(), operands[0], create_graph=True)
    with pytest.raises(NotImplementedError, match=f"{op}: double backward"):
        grad_input.sum().backward()


@pytest.mark.parametrize("op", OPS)
def test_torchscript(op):
    operands = operands_of(op, GEOMETRIES[1], 1, 4, 4)
    tail = (3, 3, 1, 1, 1, 1, 1, 1, 2, 3, 1.0, 256, False)
    if op == "dcnv3":
        def call(input: torch.Tensor, offset: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return deformconv.dcnv3(input, offset, mask, 3, 3, 1, 1, 1, 1, 1, 1, 2, 3, 1.0, 256,
                                    False)
    else:
        def call(input: torch.Tensor, offset_mask: torch.Tensor) -> torch.Tensor:
            return deformconv.dcnv4(input, offset_mask, 3, 3, 1, 1, 1, 1, 1, 1, 2, 3, 1.0, 256,
                                    False)

    scripted = torch.jit.script(call)
    assert torch.equal(scripted(*operands), getattr(deformconv, op)(*operands, *tail))


@pytest.mark.parametrize("op", OPS)
def test_opcheck(op):
    geometry = GEOMETRIES[2]
    operands = [t.requires_grad_() for t in operands_of(op, geometry, 2, 5, 6,
                                                        dtype=torch.float32)]
    torch.library.opcheck(getattr(torch.ops.deformconv, op).default,
                          (*operands, *flat_arguments(geometry, 0.5)))


@pytest.mark.parametrize("op", OPS)
def test_opcheck_backward(op):
    # Every subset of gradients, each checked by opcheck against the fake kernel's shapes.
    geometry = GEOMETRIES[2]
    operands = operands_of(op, geometry, 2, 5, 6, dtype=torch.float32)
    grad_output = getattr(deformconv, op)(*operands, *flat_arguments(geometry, 0.5))
    backward = getattr(torch.ops.deformconv, f"{op}_backward").default
    for output_mask in itertools.product([False, True], repeat=len(operands)):
        torch.library.opcheck(backward, (torch.randn_like(grad_output), *operands,
                                         *flat_arguments(geometry, 0.5), list(output_mask)))


@pytest.mark.parametrize("op", OPS)
def test_torch_compile_fullgraph_and_export(op):
    geometry = GEOMETRIES[1]
    operands = operands_of(op, geometry, 2, 4, 5, dtype=torch.float32)
    function = getattr(deformconv, op)

    class Core(torch.nn.Module):
        def forward(self, *tensors):
            return function(*tensors, 3, 3, 1, 1, 1, 1, 1, 1, 2, 3, 0.5)

    expected = Core()(*operands)
    compiled = torch.compile(Core(), fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(*operands), expected)
    program = torch.export.export(Core(), tuple(operands))
    torch.testing.assert_close(program.module()(*operands), expected)


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("op", OPS)
def test_emulated_cuda_matches_cpu(emulated, op, geometry):
    emulated.configure(2, 2, 3, 1234, 7, 0, False)  # shuffled blocks and threads, 3 blocks
    remove_center = geometry[0] == (3, 3)
    # DCNv4's padding NaN: a kernel that read it would make NaN.
    operands = operands_of(op, geometry, 2, 5, 6, remove_center=remove_center,
                           padding_value=float("nan"))
    tail = flat_arguments(geometry, 0.5, remove_center=remove_center)
    results = []
    for library in (torch.ops.deformconv, emulated):
        out = getattr(library, op)(*operands, *tail)
        grads = getattr(library, op + "_backward")(torch.ones_like(out) * 0.5 + out, *operands,
                                                   *tail, [True] * len(operands))
        results.append([out, *grads])
    counts = emulated.take_bookkeeping()
    assert counts[0] > 0 and counts[1] == counts[0] and sum(counts[2:]) == 0
    emulated.configure(0, 0, 0, 0, 7, 0, False)
    assert torch.isfinite(results[1][0]).all()
    for cpu, emulated_cuda in zip(*results):
        torch.testing.assert_close(emulated_cuda, cpu, rtol=1e-12, atol=1e-12)
