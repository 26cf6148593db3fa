"""Drop-in compatibility: torchvision's call forms, mmcv's keywords and state_dict keys, and
converting an existing model."""

import pytest
import torch
from torch import nn

import deformconv
from deform_conv2d_cases import GEOMETRIES, make_operands

pytestmark = pytest.mark.workflows


@pytest.fixture
def operands():
    geometry = GEOMETRIES[2]  # groups 2, offset groups 3, non-square everything
    return geometry, make_operands(geometry)


def call_forms(x, o, w, b, m, geometry):
    """Every way of calling torchvision.ops.deform_conv2d, as (args, kwargs)."""
    s, p, d = geometry.stride, geometry.padding, geometry.dilation
    return [
        ((x, o, w, b, s, p, d, m), {}),
        ((x, o, w), dict(bias=b, stride=s, padding=p, dilation=d, mask=m)),
        ((), dict(input=x, offset=o, weight=w, bias=b, stride=s, padding=p, dilation=d, mask=m)),
        ((x, o, w, b, list(s), list(p), list(d)), dict(mask=m)),
    ]


def test_torchvision_call_forms(operands):
    ops = pytest.importorskip("torchvision.ops")
    geometry, (x, o, w, b, m) = operands
    for args, kwargs in call_forms(x, o, w, b, m, geometry):
        torch.testing.assert_close(deformconv.deform_conv2d(*args, **kwargs),
                                   ops.deform_conv2d(*args, **kwargs))
    # int geometry and the defaults
    x1, o1, w1, _, _ = make_operands(GEOMETRIES[0])
    torch.testing.assert_close(deformconv.deform_conv2d(x1, o1, w1),
                               ops.deform_conv2d(x1, o1, w1))
    x3, o3, w3, b3, m3 = make_operands(GEOMETRIES[1])
    torch.testing.assert_close(deformconv.deform_conv2d(x3, o3, w3, b3, 1, 1, 1, m3),
                               ops.deform_conv2d(x3, o3, w3, b3, 1, 1, 1, m3))


def test_deformable_groups_alias_warns():
    with pytest.warns(DeprecationWarning, match="deformable_groups"):
        layer = deformconv.ModulatedDeformConv2dPack(4, 4, 3, padding=1, deformable_groups=2)
    assert layer.deform_groups == 2
    assert layer.conv_offset.out_channels == 3 * 2 * 9


# The keys mmcv's modules produce (mmcv/ops/deform_conv.py, modulated_deform_conv.py).
MMCV_KEYS = {
    deformconv.DeformConv2d: {"weight"},
    deformconv.ModulatedDeformConv2d: {"weight", "bias"},
    deformconv.DeformConv2dPack: {"weight", "conv_offset.weight", "conv_offset.bias"},
    deformconv.ModulatedDeformConv2dPack: {"weight", "bias", "conv_offset.weight",
                                           "conv_offset.bias"},
}


@pytest.mark.parametrize("cls", list(MMCV_KEYS), ids=lambda c: c.__name__)
def test_state_dict_round_trip_with_mmcv_keys(cls):
    torch.manual_seed(0)
    source = cls(4, 8, 3, padding=1, deform_groups=2)
    state = source.state_dict()
    assert set(state) == MMCV_KEYS[cls]
    target = cls(4, 8, 3, padding=1, deform_groups=2)
    target.load_state_dict(state, strict=True)
    for key, value in target.state_dict().items():
        assert torch.equal(value, state[key])


class OldMmdetBlock(nn.Module):
    """How early mmdet kept a DCN layer: the offset conv beside it as conv2_offset."""

    def __init__(self, modulated):
        super().__init__()
        cls = deformconv.ModulatedDeformConv2dPack if modulated else deformconv.DeformConv2dPack
        self.conv2 = cls(4, 4, 3, padding=1)


@pytest.mark.parametrize("modulated", [False, True])
def test_old_mmdet_keys_load_like_mmcv(modulated):
    torch.manual_seed(0)
    channels = (3 if modulated else 2) * 9
    old = {"conv2.weight": torch.randn(4, 4, 3, 3),
           "conv2_offset.weight": torch.randn(channels, 4, 3, 3),
           "conv2_offset.bias": torch.randn(channels)}
    if modulated:
        old["conv2.bias"] = torch.randn(4)
    block = OldMmdetBlock(modulated)
    # Checkpoints of that era carry no version (or version 1) for the layer.
    block.load_state_dict(deformconv.upgrade_mmcv_state_dict(block, old), strict=True)
    assert torch.equal(block.conv2.conv_offset.weight, old["conv2_offset.weight"])
    assert torch.equal(block.conv2.conv_offset.bias, old["conv2_offset.bias"])


def test_version_2_state_dicts_are_left_alone():
    block = OldMmdetBlock(modulated=False)
    state = block.state_dict()
    assert state._metadata["conv2"]["version"] == 2
    state["conv2_offset.weight"] = torch.zeros(1)  # a stray key, not an old-style one
    upgraded = deformconv.upgrade_mmcv_state_dict(block, state)
    assert "conv2_offset.weight" in upgraded
    assert torch.equal(upgraded["conv2.conv_offset.weight"], state["conv2.conv_offset.weight"])


def test_convert_resnet50_stages_2_to_4():
    models = pytest.importorskip("torchvision.models")
    torch.manual_seed(0)
    model = models.resnet50(weights=None).eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        expected = model(x)
    replaced = deformconv.convert_to_deformable(model, "layer[234].*.conv2")
    assert len(replaced) == 4 + 6 + 3
    assert all(isinstance(model.get_submodule(name), deformconv.DeformConv2dPack)
               for name in replaced)
    assert model.layer2[0].conv2.stride == (2, 2)  # geometry carried over
    with torch.no_grad():
        # Zero-initialised offsets: the converted model computes what the original did.
        torch.testing.assert_close(model(x), expected, atol=1e-4, rtol=1e-4)
    model.train()
    model(x).sum().backward()
    assert model.layer3[1].conv2.conv_offset.weight.grad is not None


def test_convert_modulated_and_torchvision_layers():
    ops = pytest.importorskip("torchvision.ops")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), ops.DeformConv2d(4, 4, 3, padding=1))
    replaced = deformconv.convert_to_deformable(model, ["0", "1"], modulated=True)
    assert replaced == ["0", "1"]
    assert isinstance(model[0], deformconv.ModulatedDeformConv2dPack)
    assert isinstance(model[1], deformconv.DeformConv2d)
    x = torch.randn(2, 4, 5, 5)
    offset = torch.randn(2, 18, 5, 5)
    mask = torch.rand(2, 9, 5, 5)
    reference = ops.DeformConv2d(4, 4, 3, padding=1)
    reference.load_state_dict(model[1].state_dict())
    torch.testing.assert_close(model[1](x, offset, mask), reference(x, offset, mask))


def test_convert_rejects_unsupported_layers():
    with pytest.raises(ValueError, match="no nn.Conv2d"):
        deformconv.convert_to_deformable(nn.Sequential(nn.ReLU()), "*")
    with pytest.raises(ValueError, match="padding"):
        deformconv.convert_to_deformable(nn.Sequential(nn.Conv2d(2, 2, 3, padding="same")), "0")
