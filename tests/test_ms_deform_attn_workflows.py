"""Multi-scale deformable attention in the PyTorch workflows: opcheck, torch.compile and
torch.export, TorchScript, autocast."""

import itertools

import pytest
import torch

import deformconv
from ms_deform_attn_reference import DEFAULT_OPTIONS, call, make_operands

pytestmark = pytest.mark.workflows


def test_opcheck():
    operands = make_operands([(4, 5), (2, 2)], dtype=torch.float32)
    floating = [t.requires_grad_() if t.is_floating_point() else t for t in operands]
    torch.library.opcheck(torch.ops.deformconv.ms_deform_attn.default, (*floating, 64))


@pytest.mark.parametrize("output_mask", list(itertools.product([False, True], repeat=3)))
def test_opcheck_backward(output_mask):
    operands = make_operands([(4, 5), (2, 2)], dtype=torch.float32)
    grad_output = torch.randn_like(deformconv.ms_deform_attn(*operands))
    torch.library.opcheck(torch.ops.deformconv.ms_deform_attn_backward.default,
                          (grad_output, *operands, *DEFAULT_OPTIONS, list(output_mask)))


def test_torch_compile_fullgraph_and_export():
    operands = make_operands([(4, 5), (2, 2)], dtype=torch.float32)

    def attend(value, shapes, starts, locations, weights):
        return deformconv.ms_deform_attn(value, shapes, starts, locations, weights).relu()

    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(*operands), attend(*operands))

    class Attend(torch.nn.Module):
        def forward(self, value, shapes, starts, locations, weights):
            return attend(value, shapes, starts, locations, weights)

    exported = torch.export.export(Attend(), tuple(operands))
    torch.testing.assert_close(exported.module()(*operands), attend(*operands))


def test_torchscript():
    operands = make_operands([(4, 5), (2, 2)], dtype=torch.float32)

    def attend(value: torch.Tensor, shapes: torch.Tensor, starts: torch.Tensor,
               locations: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return deformconv.ms_deform_attn(value, shapes, starts, locations, weights, 64)

    scripted = torch.jit.script(attend)
    assert torch.equal(scripted(*operands), attend(*operands))


def test_autocast_runs_in_float32():
    value, shapes, starts, locations, weights = make_operands([(4, 5)], dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = deformconv.ms_deform_attn(value.bfloat16(), shapes, starts, locations, weights)
    assert out.dtype == torch.float32
    expected = call([value.bfloat16().float(), shapes, starts, locations, weights])
    torch.testing.assert_close(out, expected)
