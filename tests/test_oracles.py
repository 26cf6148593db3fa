"""Agreement with independent implementations: torchvision.ops.deform_conv2d and the numeric
vectors published with mmcv's tests (tests/mmcv_vectors.json: the figures of mmcv's
tests/test_ops/test_deform_conv.py and test_modulated_deform_conv.py at commit a8073c74)."""

import json
from pathlib import Path

import pytest
import torch

import deformconv
from deform_conv2d_cases import GEOMETRIES, forward_and_grads, make_operands

VECTORS = json.loads((Path(__file__).parent / "mmcv_vectors.json").read_text())


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
@pytest.mark.parametrize("with_mask", [False, True], ids=["v1", "v2"])
def test_matches_torchvision(geometry, with_mask):
    ops = pytest.importorskip("torchvision.ops")
    operands = make_operands(geometry, with_mask=with_mask, offset_scale=3.0)
    out, grads = forward_and_grads(deformconv.deform_conv2d, *operands, geometry)
    tv_out, tv_grads = forward_and_grads(ops.deform_conv2d, *operands, geometry)
    torch.testing.assert_close(out, tv_out, atol=1e-10, rtol=1e-10)
    for ours, theirs in zip(grads, tv_grads):
        torch.testing.assert_close(ours, theirs, atol=1e-10, rtol=1e-10)


def tensor(values, dtype):
    return torch.tensor(values, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mmcv_dcn_v1_vectors(dtype):
    v = VECTORS["dcn_v1"]
    layer = deformconv.DeformConv2dPack(1, 1, 2, stride=1, padding=0, dilation=1, groups=1,
                                        deform_groups=1, bias=False).to(dtype)
    with torch.no_grad():
        layer.conv_offset.weight.copy_(tensor(v["offset_weight"], dtype).reshape(8, 1, 2, 2))
        layer.conv_offset.bias.copy_(tensor(v["offset_bias"], dtype))
        layer.weight.copy_(tensor(v["weight"], dtype).reshape(1, 1, 2, 2))
    batch = v["batch"]
    x = tensor(v["input"], dtype).repeat(batch, 1, 1, 1).requires_grad_()
    out = layer(x)
    out.sum().backward()

    tol = dict(atol=v["tolerance"], rtol=0)
    for n in range(batch):
        torch.testing.assert_close(out[n:n + 1], tensor(v["expected_out"], dtype), **tol)
        torch.testing.assert_close(x.grad[n:n + 1], tensor(v["expected_x_grad"], dtype), **tol)
    torch.testing.assert_close(
        layer.conv_offset.weight.grad / batch,
        tensor(v["expected_offset_weight_grad_per_sample"], dtype), **tol)
    torch.testing.assert_close(layer.conv_offset.bias.grad / batch,
                               tensor(v["expected_offset_bias_grad_per_sample"], dtype), **tol)
    torch.testing.assert_close(layer.weight.grad / batch,
                               tensor(v["expected_weight_grad_per_sample"], dtype), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mmcv_dcn_v2_vectors(dtype):
    v = VECTORS["dcn_v2"]
    layer = deformconv.ModulatedDeformConv2dPack(1, 1, 2, stride=1, padding=1, dilation=1,
                                                 deform_groups=1, bias=False).to(dtype)
    with torch.no_grad():
        layer.weight.fill_(1.0)
    # The Pack variant's conv_offset starts at zero: offsets 0, mask sigmoid(0) = 0.5.
    assert not layer.conv_offset.weight.any() and not layer.conv_offset.bias.any()
    x = tensor(v["input"], dtype).requires_grad_()
    out = layer(x)
    out.sum().backward()

    tol = dict(atol=v["tolerance"], rtol=0)
    torch.testing.assert_close(out, tensor(v["expected_out"], dtype), **tol)
    torch.testing.assert_close(x.grad, tensor(v["expected_x_grad"], dtype), **tol)
    torch.testing.assert_close(layer.weight.grad, tensor(v["expected_weight_grad"], dtype), **tol)
    torch.testing.assert_close(layer.conv_offset.weight.grad,
                               tensor(v["expected_offset_conv_weight_grad"], dtype), **tol)
    torch.testing.assert_close(layer.conv_offset.bias.grad,
                               tensor(v["expected_offset_conv_bias_grad"], dtype), **tol)
