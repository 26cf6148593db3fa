"""The DCNv3 and DCNv4 modules against the originals' (docs/dcnv3_dcnv4.md, The modules):
state_dict keys and shapes as the originals have them, checkpoints built to those keys loaded
with strict=True and run against a forward written out step by step over the pure-PyTorch
reference op, initialisation, errors, TorchScript and torch.compile."""

import math

import pytest
import torch
import torch.nn.functional as F

import deformconv
from dcnv3_reference import dcnv3_reference, unpack_offset_mask

pytestmark = pytest.mark.workflows


def dcnv3_keys(C, P, G, dwk, norm="LN", center_feature_scale=False):
    """The original DCNv3's parameters: key -> shape."""
    keys = {"dw_conv.0.weight": (C, 1, dwk, dwk), "dw_conv.0.bias": (C,),
            "offset.weight": (G * P * 2, C), "offset.bias": (G * P * 2,),
            "mask.weight": (G * P, C), "mask.bias": (G * P,),
            "input_proj.weight": (C, C), "input_proj.bias": (C,),
            "output_proj.weight": (C, C), "output_proj.bias": (C,)}
    if norm == "LN":
        keys.update({"dw_conv.1.1.weight": (C,), "dw_conv.1.1.bias": (C,)})
    else:
        keys.update({"dw_conv.1.0.weight": (C,), "dw_conv.1.0.bias": (C,),
                     "dw_conv.1.0.running_mean": (C,), "dw_conv.1.0.running_var": (C,),
                     "dw_conv.1.0.num_batches_tracked": ()})
    if center_feature_scale:
        keys.update({"center_feature_scale_proj_weight": (G, C),
                     "center_feature_scale_proj_bias": (G,)})
    return keys


def dcnv4_keys(C, P, G, dwk=None, center_feature_scale=False, output_bias=True,
               without_pointwise=False):
    """The original DCNv4's parameters: key -> shape."""
    padded = math.ceil(3 * G * P / 8) * 8
    keys = {"offset_mask.weight": (padded, C), "offset_mask.bias": (padded,)}
    if dwk is not None:
        keys.update({"offset_mask_dw.weight": (C, 1, dwk, dwk), "offset_mask_dw.bias": (C,)})
    if not without_pointwise:
        keys.update({"value_proj.weight": (C, C), "value_proj.bias": (C,),
                     "output_proj.weight": (C, C)})
        if output_bias:
            keys["output_proj.bias"] = (C,)
    if center_feature_scale:
        keys.update({"center_feature_scale_proj_weight": (G, C),
                     "center_feature_scale_proj_bias": (G,)})
    return keys


def random_checkpoint(keys, seed):
    """A state_dict as the originals would save it: every key of the table, random values
    (variances positive, the batch counter an integer)."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for key, shape in keys.items():
        if key.endswith("num_batches_tracked"):
            state[key] = torch.tensor(5)
        elif key.endswith("running_var"):
            state[key] = torch.rand(shape, generator=generator, dtype=torch.float64) + 0.5
        else:
            state[key] = torch.randn(shape, generator=generator, dtype=torch.float64) * 0.5
    return state


def blend_with_centre_feature_scale(state, y, value, query, group_channels):
    """The centre-feature-scale blend of both modules, when the checkpoint has its parameters."""
    if "center_feature_scale_proj_weight" not in state:
        return y
    a = torch.sigmoid(F.linear(query, state["center_feature_scale_proj_weight"],
                               state["center_feature_scale_proj_bias"]))
    a = a[..., None].repeat(1, 1, 1, 1, group_channels).flatten(-2)
    return y * (1 - a) + value * a


def dcnv3_module_reference(state, x, kernel_size, group, offset_scale, norm, act,
                           remove_center):
    """The DCNv3 module's forward, step by step, on the checkpoint's tensors (eval mode for
    BN)."""
    N, H, W, C = x.shape
    D = C // group
    value = F.linear(x, state["input_proj.weight"], state["input_proj.bias"])
    dwk = state["dw_conv.0.weight"].shape[-1]
    feature = F.conv2d(x.permute(0, 3, 1, 2), state["dw_conv.0.weight"],
                       state["dw_conv.0.bias"], padding=(dwk - 1) // 2, groups=C)
    if norm == "LN":
        feature = F.layer_norm(feature.permute(0, 2, 3, 1), (C,), state["dw_conv.1.1.weight"],
                               state["dw_conv.1.1.bias"], eps=1e-6)
    else:
        feature = F.batch_norm(feature, state["dw_conv.1.0.running_mean"],
                               state["dw_conv.1.0.running_var"], state["dw_conv.1.0.weight"],
                               state["dw_conv.1.0.bias"]).permute(0, 2, 3, 1)
    feature = {"GELU": F.gelu, "ReLU": F.relu, "SiLU": F.silu}[act](feature)
    offset = F.linear(feature, state["offset.weight"], state["offset.bias"])
    mask = F.linear(feature, state["mask.weight"], state["mask.bias"])
    mask = F.softmax(mask.reshape(N, H, W, group, -1), -1).reshape(N, H, W, -1)
    pad = (kernel_size - 1) // 2
    y = dcnv3_reference(value, offset, mask, kernel_size, kernel_size, 1, 1, pad, pad, 1, 1,
                        group, D, offset_scale, remove_center)
    y = blend_with_centre_feature_scale(state, y, value, feature, D)
    return F.linear(y, state["output_proj.weight"], state["output_proj.bias"])


def dcnv4_module_reference(state, x, H, W, kernel_size, group, offset_scale, remove_center):
    """The DCNv4 module's forward, step by step; the op as DCNv3 on the unpacked
    offset_mask."""
    N, L, C = x.shape
    D = C // group
    P = kernel_size * kernel_size - int(remove_center)
    value = x
    if "value_proj.weight" in state:
        value = F.linear(x, state["value_proj.weight"], state["value_proj.bias"])
    value = value.reshape(N, H, W, C)
    t = x
    if "offset_mask_dw.weight" in state:
        dwk = state["offset_mask_dw.weight"].shape[-1]
        t = F.conv2d(x.reshape(N, H, W, C).permute(0, 3, 1, 2), state["offset_mask_dw.weight"],
                     state["offset_mask_dw.bias"], padding=(dwk - 1) // 2, groups=C)
        t = t.permute(0, 2, 3, 1).reshape(N, L, C)
    offset_mask = F.linear(t, state["offset_mask.weight"], state["offset_mask.bias"])
    offset, mask, _ = unpack_offset_mask(offset_mask.reshape(N, H, W, -1), group, P)
    pad = (kernel_size - 1) // 2
    y = dcnv3_reference(value, offset, mask, kernel_size, kernel_size, 1, 1, pad, pad, 1, 1,
                        group, D, offset_scale, remove_center)
    y = blend_with_centre_feature_scale(state, y, value, y, D)
    y = y.reshape(N, L, C)
    if "output_proj.weight" in state:
        y = F.linear(y, state["output_proj.weight"], state.get("output_proj.bias"))
    return y


DCNV3_CONFIGS = [
    # (constructor kwargs, norm, act)
    (dict(channels=16, group=4), "LN", "GELU"),
    (dict(channels=24, group=3, dw_kernel_size=5, center_feature_scale=True, offset_scale=0.5,
          norm_layer="BN", act_layer="SiLU"), "BN", "SiLU"),
    (dict(channels=12, kernel_size=5, pad=2, group=2, remove_center=True, offset_scale=2.0,
          act_layer="ReLU"), "LN", "ReLU"),
]


@pytest.mark.parametrize("kwargs,norm,act", DCNV3_CONFIGS)
def test_dcnv3_checkpoint_loads_strictly_and_matches_reference(kwargs, norm, act):
    module = deformconv.DCNv3(**kwargs).double().eval()
    k = kwargs.get("kernel_size", 3)
    P = k * k - int(kwargs.get("remove_center", False))
    keys = dcnv3_keys(kwargs["channels"], P, kwargs["group"], kwargs.get("dw_kernel_size", k),
                      norm, kwargs.get("center_feature_scale", False))
    assert {key: tuple(v.shape) for key, v in module.state_dict().items()} == keys
    state = random_checkpoint(keys, seed=1)
    module.load_state_dict(state, strict=True)
    x = torch.randn(2, 6, 7, kwargs["channels"], dtype=torch.float64)
    expected = dcnv3_module_reference(state, x, k, kwargs["group"],
                                      kwargs.get("offset_scale", 1.0), norm, act,
                                      kwargs.get("remove_center", False))
    torch.testing.assert_close(module(x), expected, rtol=1e-10, atol=1e-10)


DCNV4_CONFIGS = [
    dict(channels=16, group=4),
    dict(channels=32, group=2, dw_kernel_size=3, center_feature_scale=True, output_bias=False,
         offset_scale=0.5),
    dict(channels=12, group=3, remove_center=True, without_pointwise=True, offset_scale=2.0),
]


@pytest.mark.parametrize("kwargs", DCNV4_CONFIGS)
def test_dcnv4_checkpoint_loads_strictly_and_matches_reference(kwargs):
    module = deformconv.DCNv4(**kwargs).double()
    P = 9 - int(kwargs.get("remove_center", False))
    keys = dcnv4_keys(kwargs["channels"], P, kwargs["group"], kwargs.get("dw_kernel_size"),
                      kwargs.get("center_feature_scale", False), kwargs.get("output_bias", True),
                      kwargs.get("without_pointwise", False))
    assert {key: tuple(v.shape) for key, v in module.state_dict().items()} == keys
    assert module.K == kwargs["group"] * P
    state = random_checkpoint(keys, seed=2)
    module.load_state_dict(state, strict=True)
    H, W = 5, 7
    x = torch.randn(2, H * W, kwargs["channels"], dtype=torch.float64)
    expected = dcnv4_module_reference(state, x, H, W, 3, kwargs["group"],
                                      kwargs.get("offset_scale", 1.0),
                                      kwargs.get("remove_center", False))
    torch.testing.assert_close(module(x, shape=(H, W)), expected, rtol=1e-10, atol=1e-10)


def test_dcnv4_square_input_without_shape():
    module = deformconv.DCNv4(16, group=2).double()
    module.load_state_dict(random_checkpoint(dcnv4_keys(16, 9, 2), seed=3))
    x = torch.randn(1, 36, 16, dtype=torch.float64)
    torch.testing.assert_close(module(x), module(x, shape=(6, 6)), rtol=0, atol=0)


def test_initialisation():
    torch.manual_seed(0)
    v3 = deformconv.DCNv3(16, group=4, center_feature_scale=True)
    for name in ("offset.weight", "offset.bias", "mask.weight", "mask.bias",
                 "center_feature_scale_proj_weight", "center_feature_scale_proj_bias",
                 "input_proj.bias", "output_proj.bias"):
        assert torch.count_nonzero(v3.state_dict()[name]) == 0, name
    bound = math.sqrt(6 / 32)  # Xavier-uniform for 16 x 16
    for name in ("input_proj.weight", "output_proj.weight"):
        weight = v3.state_dict()[name]
        assert weight.abs().max() <= bound and weight.std() > bound / 3, name
    # Zero offsets and a uniform mask: the op averages the 3x3 neighbourhood (zero padded).
    x = torch.randn(1, 5, 5, 16)
    value = v3.input_proj(x)
    averaged = F.avg_pool2d(value.permute(0, 3, 1, 2), 3, 1, 1, count_include_pad=True)
    centre_scale = 0.5  # sigmoid(0)
    expected = v3.output_proj(averaged.permute(0, 2, 3, 1) * (1 - centre_scale)
                              + value * centre_scale)
    torch.testing.assert_close(v3(x), expected, rtol=1e-5, atol=1e-5)
    # DCNv4: offset_mask zero, so the op's output, and the module's, are exactly zero.
    v4 = deformconv.DCNv4(16, group=4, dw_kernel_size=3)
    assert torch.count_nonzero(v4.offset_mask.weight) == 0
    assert torch.count_nonzero(v4(torch.randn(2, 25, 16))) == 0
    # The originals' models call _reset_parameters() again after their own init.
    with torch.no_grad():
        v4.offset_mask.weight.fill_(1.0)
    v4._reset_parameters()
    assert torch.count_nonzero(v4.offset_mask.weight) == 0


def test_trains():
    torch.manual_seed(0)
    for module, x in ((deformconv.DCNv3(16, group=4), torch.randn(2, 6, 6, 16)),
                      (deformconv.DCNv4(16, group=4), torch.randn(2, 36, 16))):
        # Linear in the output: DCNv4's output starts at zero, which squares would hide.
        out = module(x)
        (out * torch.randn_like(out)).sum().backward()
        grads = {name: p.grad for name, p in module.named_parameters()}
        assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
        # Offsets start at zero and learn from the first step.
        name = "offset.weight" if isinstance(module, deformconv.DCNv3) else "offset_mask.weight"
        assert torch.count_nonzero(grads[name]) > 0


@pytest.mark.parametrize("cls", [deformconv.DCNv3, deformconv.DCNv4])
@pytest.mark.parametrize("kwargs,pattern", [
    (dict(stride=2), "stride 1 and pad = dilation \\* \\(kernel_size - 1\\) / 2 = 1"),
    (dict(pad=0), "got stride 1 and pad 0"),
    (dict(kernel_size=5), "pad = dilation \\* \\(kernel_size - 1\\) / 2 = 2"),
    (dict(channels=18), "channels \\(18\\) to be divisible by group \\(4\\)"),
    (dict(group=0), "group to be at least 1"),
])
def test_bad_configurations_raise(cls, kwargs, pattern):
    arguments = dict(channels=16, group=4)
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=f"{cls.__name__}: .*{pattern}"):
        cls(**arguments)


def test_dcnv3_specific_errors():
    with pytest.raises(ValueError, match="remove_center needs an odd kernel_size"):
        deformconv.DCNv3(16, kernel_size=2, pad=0, dilation=1, remove_center=True)
    with pytest.raises(NotImplementedError, match="norm_layer"):
        deformconv.DCNv3(16, norm_layer="GN")
    with pytest.raises(NotImplementedError, match="act_layer"):
        deformconv.DCNv3(16, act_layer="Tanh")
    with pytest.raises(ValueError, match="input of shape \\(N, H, W, 16\\)"):
        deformconv.DCNv3(16)(torch.randn(1, 16, 5, 5))


def test_dcnv4_specific_errors_and_extra_keywords():
    module = deformconv.DCNv4(16, act_layer="GELU", norm_layer="LN")  # ignored, as upstream
    with pytest.raises(ValueError, match="L is not a square: pass shape"):
        module(torch.randn(1, 30, 16))
    with pytest.raises(ValueError, match="H \\* W = L = 30, but got \\(5, 5\\)"):
        module(torch.randn(1, 30, 16), shape=(5, 5))
    with pytest.raises(ValueError, match="input of shape \\(N, L, 16\\)"):
        module(torch.randn(1, 5, 5, 16))


@pytest.mark.parametrize("module,x", [
    (deformconv.DCNv3(16, group=4, center_feature_scale=True), torch.randn(2, 5, 6, 16)),
    (deformconv.DCNv4(16, group=4, dw_kernel_size=3, center_feature_scale=True),
     torch.randn(2, 30, 16)),
    (deformconv.DCNv4(16, group=2, without_pointwise=True), torch.randn(2, 30, 16)),
])
def test_torchscript_and_compile(module, x):
    # Non-zero offsets and mask, so that the sampling takes part.
    torch.manual_seed(4)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.3)
    args = (x, (5, 6)) if isinstance(module, deformconv.DCNv4) else (x,)
    expected = module(*args)
    torch.testing.assert_close(torch.jit.script(module)(*args), expected)
    compiled = torch.compile(module, fullgraph=True)
    torch.testing.assert_close(compiled(*args), expected, rtol=1e-5, atol=1e-5)
