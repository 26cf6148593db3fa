"""The nn.Modules: shapes, mmcv parameter names, initialisation, argument checks."""

import pytest
import torch
import torch.nn.functional as F

import deformconv
from deform_conv2d_reference import deform_conv2d_reference

pytestmark = pytest.mark.workflows


def test_deform_conv2d_module_matches_functional():
    layer = deformconv.DeformConv2d(4, 6, (3, 2), stride=(2, 1), padding=1, dilation=(1, 2),
                                    groups=2, deform_groups=2, bias=True).double()
    x = torch.randn(2, 4, 9, 8, dtype=torch.float64)
    out_h, out_w = (9 + 2 - 3) // 2 + 1, (8 + 2 - 3) // 1 + 1
    offset = torch.randn(2, 2 * 2 * 6, out_h, out_w, dtype=torch.float64)
    out = layer(x, offset)
    assert out.shape == (2, 6, out_h, out_w)
    expected = deform_conv2d_reference(x, offset, layer.weight, layer.bias, layer.stride,
                                       layer.padding, layer.dilation)
    torch.testing.assert_close(out, expected)


def test_modulated_module_matches_functional():
    layer = deformconv.ModulatedDeformConv2d(3, 5, 3, padding=1, deform_groups=3).double()
    x = torch.randn(2, 3, 6, 7, dtype=torch.float64)
    offset = torch.randn(2, 3 * 2 * 9, 6, 7, dtype=torch.float64)
    mask = torch.rand(2, 3 * 9, 6, 7, dtype=torch.float64)
    expected = deform_conv2d_reference(x, offset, layer.weight, layer.bias, layer.stride,
                                       layer.padding, layer.dilation, mask)
    torch.testing.assert_close(layer(x, offset, mask), expected)


def test_parameter_names_follow_mmcv():
    v1 = deformconv.DeformConv2dPack(4, 8, 3, padding=1, deform_groups=2)
    assert set(v1.state_dict()) == {"weight", "conv_offset.weight", "conv_offset.bias"}
    assert v1.conv_offset.out_channels == 2 * 2 * 9
    v2 = deformconv.ModulatedDeformConv2dPack(4, 8, 3, padding=1, deform_groups=2)
    assert set(v2.state_dict()) == {"weight", "bias", "conv_offset.weight", "conv_offset.bias"}
    assert v2.conv_offset.out_channels == 3 * 2 * 9
    assert v2.weight.shape == (8, 4, 3, 3)


def test_pack_modules_start_as_plain_convolutions():
    torch.manual_seed(0)
    x = torch.randn(2, 4, 10, 9, dtype=torch.float64)
    v1 = deformconv.DeformConv2dPack(4, 6, 3, stride=2, padding=1, groups=2).double()
    torch.testing.assert_close(v1(x), F.conv2d(x, v1.weight, None, 2, 1, 1, 2))
    # v2: zero offsets and mask sigmoid(0) = 1/2 on every tap.
    v2 = deformconv.ModulatedDeformConv2dPack(4, 6, 3, padding=1).double()
    torch.testing.assert_close(v2(x), F.conv2d(x, v2.weight / 2, v2.bias, 1, 1))


def test_pack_modules_train():
    torch.manual_seed(0)
    layer = deformconv.ModulatedDeformConv2dPack(3, 4, 3, padding=1)
    x = torch.randn(4, 3, 8, 8)
    target = torch.randn(4, 4, 8, 8)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = F.mse_loss(layer(x), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert layer.conv_offset.weight.abs().sum() > 0  # the offset branch receives gradients


def test_weight_initialised_like_conv2d():
    torch.manual_seed(0)
    layer = deformconv.ModulatedDeformConv2d(16, 32, 3)
    bound = 1 / (16 * 9) ** 0.5  # kaiming_uniform(a=sqrt(5)) gives U(-1/sqrt(fan_in), ...)
    assert layer.weight.abs().max() <= bound
    assert layer.weight.abs().max() > 0.9 * bound
    assert layer.bias.abs().max() <= bound


def test_extra_repr():
    text = repr(deformconv.DeformConv2dPack(4, 8, 3, padding=1, deform_groups=2))
    assert text.startswith("DeformConv2dPack(") and "4, 8, kernel_size=(3, 3)" in text
    assert "deform_groups=2" in text and "bias=False" in text and "conv_offset" in text


@pytest.mark.parametrize("kwargs,match", [
    (dict(in_channels=4, out_channels=6, kernel_size=3, groups=4), "out_channels .* groups"),
    (dict(in_channels=6, out_channels=8, kernel_size=3, groups=4), "in_channels .* groups"),
    (dict(in_channels=6, out_channels=6, kernel_size=3, deform_groups=4),
     "in_channels .* deform_groups"),
    (dict(in_channels=4, out_channels=4, kernel_size=0), "kernel_size to be at least 1"),
    (dict(in_channels=4, out_channels=4, kernel_size=3, stride=0), "stride to be at least 1"),
    (dict(in_channels=4, out_channels=4, kernel_size=3, padding=-1),
     "padding to be at least 0"),
    (dict(in_channels=4, out_channels=4, kernel_size=3, im2col_step=-1), "im2col_step"),
    (dict(in_channels=0, out_channels=4, kernel_size=3), "in_channels to be at least 1"),
])
def test_constructor_checks(kwargs, match):
    with pytest.raises(ValueError, match=match):
        deformconv.DeformConv2d(**kwargs)


def test_op_reports_bad_offset_channels():
    x = torch.randn(1, 2, 5, 5)
    weight = torch.randn(3, 2, 3, 3)
    offset = torch.randn(1, 16, 3, 3)
    with pytest.raises(ValueError, match=r"expected offset to have 18 channels "
                                         r"\(2 \* offset_groups \* kH \* kW\), but got 16"):
        deformconv.deform_conv2d(x, offset, weight)


def _randomise_offsets(layer):
    """Nonzero offset layers, so that samples fall between pixels."""
    with torch.no_grad():
        for name, parameter in layer.named_parameters():
            if "offset" in name or "mask" in name:
                parameter.normal_(0, 0.3, generator=torch.Generator().manual_seed(7))
    return layer


MODULES = {
    "DeformConv2d": lambda: (deformconv.DeformConv2d(8, 8, 3, padding=1),
                             lambda layer, x: layer(x, _FIELDS["offset"])),
    "ModulatedDeformConv2d": lambda: (deformconv.ModulatedDeformConv2d(8, 8, 3, padding=1),
                                      lambda layer, x: layer(x, _FIELDS["offset"],
                                                             _FIELDS["mask"])),
    "DeformConv2dPack": lambda: (deformconv.DeformConv2dPack(8, 8, 3, padding=1),
                                 lambda layer, x: layer(x)),
    "ModulatedDeformConv2dPack": lambda: (deformconv.ModulatedDeformConv2dPack(8, 8, 3,
                                                                               padding=1),
                                          lambda layer, x: layer(x)),
    "DCNv3": lambda: (deformconv.DCNv3(16, group=2),
                      lambda layer, x: layer(x.permute(0, 2, 3, 1))),
    "DCNv4": lambda: (deformconv.DCNv4(16, group=2),
                      lambda layer, x: layer(x.flatten(2).transpose(1, 2))),
}
_FIELDS = {"offset": torch.randn(1, 18, 9, 9, generator=torch.Generator().manual_seed(5)),
           "mask": torch.rand(1, 9, 9, 9, generator=torch.Generator().manual_seed(6))}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name", sorted(MODULES))
def test_frozen_module_gives_the_input_gradient(name, dtype):
    # Fine-tuning under a frozen layer, or a saliency map: only the input needs a gradient,
    # which must equal the one computed with every parameter trainable too.
    layer, call = MODULES[name]()
    layer = _randomise_offsets(layer).to(dtype)
    channels = 16 if name.startswith("DCN") else 8
    x = torch.randn(1, channels, 9, 9, generator=torch.Generator().manual_seed(8), dtype=dtype)
    for field in _FIELDS:
        _FIELDS[field] = _FIELDS[field].to(dtype)
    trainable_x = x.clone().requires_grad_()
    call(layer, trainable_x).sum().backward()
    for parameter in layer.parameters():
        assert parameter.grad is not None
        parameter.requires_grad_(False)
    frozen_x = x.clone().requires_grad_()
    call(layer, frozen_x).sum().backward()
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(frozen_x.grad, trainable_x.grad, atol=tolerance, rtol=tolerance)
