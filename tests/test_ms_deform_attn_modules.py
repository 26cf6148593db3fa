"""MSDeformAttn (Deformable DETR's), MultiScaleDeformableAttention (mmcv's) and FlashDeformAttn
(DCNv4's): state_dicts of the originals' keys and shapes load strictly and give the output that the originals' forward,
written out here on the reference op, gives; their initialisation; training."""

import math

import pytest
import torch
import torch.nn.functional as F

import deformconv
from ms_deform_attn_reference import levels_of, ms_deform_attn_reference

pytestmark = pytest.mark.workflows

LEVELS = [(6, 8), (3, 4), (2, 2), (1, 1)]


def originals_state_dict(channels, heads, levels, points, value_channels=None, seed=0):
    """Random parameters under the originals' keys, in their shapes."""
    value_channels = value_channels or channels
    generator = torch.Generator().manual_seed(seed)
    samples = heads * levels * points

    def randn(*size):
        return torch.randn(*size, generator=generator) * 0.3

    return {
        "sampling_offsets.weight": randn(samples * 2, channels),
        "sampling_offsets.bias": randn(samples * 2),
        "attention_weights.weight": randn(samples, channels),
        "attention_weights.bias": randn(samples),
        "value_proj.weight": randn(value_channels, channels),
        "value_proj.bias": randn(value_channels),
        "output_proj.weight": randn(channels, value_channels),
        "output_proj.bias": randn(channels),
    }


def originals_attention(state, heads, levels, points, query, reference_points, values,
                        spatial_shapes, level_start_index, padding_mask=None):
    """The originals' attention, batch first, written out: the value projection (zero at
    padding), offsets and softmax-ed weights from the query, locations from the reference points
    (points in level pixels, boxes in half sizes per point), the reference op, the output
    projection."""
    N, Lq, _ = query.shape
    value = F.linear(values, state["value_proj.weight"], state["value_proj.bias"])
    if padding_mask is not None:
        value = value.masked_fill(padding_mask[..., None], 0.0)
    value = value.view(N, values.shape[1], heads, -1)
    offsets = F.linear(query, state["sampling_offsets.weight"], state["sampling_offsets.bias"])
    offsets = offsets.view(N, Lq, heads, levels, points, 2)
    weights = F.linear(query, state["attention_weights.weight"], state["attention_weights.bias"])
    weights = weights.view(N, Lq, heads, levels * points).softmax(-1)
    weights = weights.view(N, Lq, heads, levels, points)
    if reference_points.shape[-1] == 2:
        width_height = spatial_shapes.flip(-1).to(offsets.dtype)
        locations = (reference_points[:, :, None, :, None, :]
                     + offsets / width_height[None, None, None, :, None, :])
    else:
        centre, size = reference_points[..., :2], reference_points[..., 2:]
        locations = (centre[:, :, None, :, None, :]
                     + offsets / points * size[:, :, None, :, None, :] / 2)
    sampled = ms_deform_attn_reference(value, spatial_shapes, level_start_index, locations,
                                       weights)
    return F.linear(sampled, state["output_proj.weight"], state["output_proj.bias"])


def inputs(N=2, Lq=7, channels=16, box=False, seed=1):
    generator = torch.Generator().manual_seed(seed)
    spatial_shapes, level_start_index, S = levels_of(LEVELS)
    query = torch.randn(N, Lq, channels, generator=generator)
    values = torch.randn(N, S, channels, generator=generator)
    reference = torch.rand(N, Lq, len(LEVELS), 4 if box else 2, generator=generator)
    if box:
        reference[..., 2:] = reference[..., 2:] * 0.5 + 0.1
    padding = torch.rand(N, S, generator=generator) < 0.2
    return query, reference, values, spatial_shapes, level_start_index, padding


@pytest.mark.parametrize("box", [False, True], ids=["points", "boxes"])
@pytest.mark.parametrize("module_class", [deformconv.MSDeformAttn, deformconv.FlashDeformAttn],
                         ids=["MSDeformAttn", "FlashDeformAttn"])
def test_deformable_detr_modules_load_the_originals_state_dict(module_class, box):
    """Deformable DETR's MSDeformAttn, and DCNv4's FlashDeformAttn, which has its parameters and
    forward (only the operand of its op differs: locations and logits packed, the softmax in
    the op)."""
    module = module_class(d_model=16, n_levels=4, n_heads=2, n_points=3)
    state = originals_state_dict(16, 2, 4, 3)
    assert {k: v.shape for k, v in module.state_dict().items()} == \
        {k: v.shape for k, v in state.items()}
    module.load_state_dict(state, strict=True)
    query, reference, values, shapes, starts, padding = inputs(box=box)
    out = module(query, reference, values, shapes, starts, padding)
    expected = originals_attention(state, 2, 4, 3, query, reference, values, shapes, starts,
                                   padding)
    torch.testing.assert_close(out, expected)


def test_flash_deform_attn_function_gradients():
    """flash_deform_attn's gradients, by gradcheck in float64, of the value and of the packed
    locations and logits (off the pixel grid)."""
    spatial_shapes, level_start_index, S = levels_of([(3, 4), (2, 2)])
    generator = torch.Generator().manual_seed(4)
    value = torch.randn(1, S, 2, 3, dtype=torch.float64, generator=generator)
    packed = torch.rand(1, 3, 2, 3 * 2 * 2, dtype=torch.float64, generator=generator)
    packed[..., :8] = packed[..., :8] * 1.2 - 0.1

    def attend(value, packed):
        return deformconv.flash_deform_attn(value, spatial_shapes, level_start_index, packed,
                                            64, 2)

    assert torch.autograd.gradcheck(attend, (value.requires_grad_(), packed.requires_grad_()))
    with pytest.raises(ValueError, match=r"expected sampling_loc_attn's last dimension to be "
                                         r"3 \* levels \* K = 18 \(2 levels, K=3"):
        deformconv.flash_deform_attn(value, spatial_shapes, level_start_index, packed, 64, 3)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("box", [False, True], ids=["points", "boxes"])
def test_mmcv_module_loads_the_originals_state_dict(batch_first, box):
    module = deformconv.MultiScaleDeformableAttention(
        embed_dims=16, num_heads=2, num_levels=4, num_points=3, dropout=0.0,
        batch_first=batch_first, value_proj_ratio=0.5)
    state = originals_state_dict(16, 2, 4, 3, value_channels=8)
    assert {k: v.shape for k, v in module.state_dict().items()} == \
        {k: v.shape for k, v in state.items()}
    module.load_state_dict(state, strict=True)
    query, reference, values, shapes, starts, padding = inputs(box=box)
    query_pos = torch.randn_like(query)
    identity = torch.randn_like(query)
    expected = originals_attention(state, 2, 4, 3, query + query_pos, reference, values,
                                   shapes, starts, padding) + identity

    def layout(t):
        return t if batch_first else t.transpose(0, 1)

    out = module(layout(query), value=layout(values), identity=layout(identity),
                 query_pos=layout(query_pos), key_padding_mask=padding,
                 reference_points=reference, spatial_shapes=shapes, level_start_index=starts)
    torch.testing.assert_close(layout(out), expected)
    # Without value and identity, the query is both (its position added to the query only).
    tokens = torch.randn(2, sum(h * w for h, w in LEVELS), 16)
    reference = torch.rand(2, tokens.shape[1], 4, 2)
    out = module(layout(tokens), reference_points=reference, spatial_shapes=shapes,
                 level_start_index=starts)
    expected = originals_attention(state, 2, 4, 3, tokens, reference, tokens, shapes,
                                   starts) + tokens
    torch.testing.assert_close(layout(out), expected)


@pytest.mark.parametrize("make", [
    lambda: deformconv.MSDeformAttn(d_model=32, n_levels=2, n_heads=4, n_points=3),
    lambda: deformconv.MultiScaleDeformableAttention(embed_dims=32, num_heads=4, num_levels=2,
                                                     num_points=3),
    lambda: deformconv.FlashDeformAttn(d_model=32, n_levels=2, n_heads=4, n_points=3),
], ids=["MSDeformAttn", "MultiScaleDeformableAttention", "FlashDeformAttn"])
def test_initialisation_of_the_originals(make):
    module = make()
    # Head h points along angle 2 pi h / 4: (1, 0), (0, 1), (-1, 0), (0, -1), scaled so that the
    # larger coordinate is 1, point k at k + 1 times that, on every level.
    bias = module.sampling_offsets.bias.detach().view(4, 2, 3, 2)
    directions = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]])
    for h in range(4):
        for k in range(3):
            torch.testing.assert_close(bias[h, :, k], (k + 1) * directions[h].expand(2, 2),
                                       atol=1e-6, rtol=0)
    assert (module.sampling_offsets.weight == 0).all()
    assert (module.attention_weights.weight == 0).all()
    assert (module.attention_weights.bias == 0).all()
    for projection in (module.value_proj, module.output_proj):
        assert (projection.bias == 0).all()
        fan_in, fan_out = projection.weight.shape[1], projection.weight.shape[0]
        bound = math.sqrt(6.0 / (fan_in + fan_out))  # Xavier uniform
        assert projection.weight.abs().max() <= bound and projection.weight.std() > bound / 4


def test_msdeformattn_trains():
    torch.manual_seed(0)
    module = deformconv.MSDeformAttn(d_model=16, n_levels=4, n_heads=2, n_points=2)
    query, reference, values, shapes, starts, padding = inputs()
    out = module(query, reference, values, shapes, starts, padding)
    out.square().mean().backward()
    for name, parameter in module.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), name
        assert parameter.grad.abs().sum() > 0, name


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="multiple of n_heads"):
        deformconv.MSDeformAttn(d_model=30, n_heads=8)
    with pytest.raises(ValueError, match="multiple of num_heads"):
        deformconv.MultiScaleDeformableAttention(embed_dims=30, num_heads=8)
    module = deformconv.MSDeformAttn(d_model=16, n_levels=4, n_heads=2, n_points=2)
    query, reference, values, shapes, starts, padding = inputs()
    with pytest.raises(ValueError, match="2 \\(x, y\\) or 4 \\(x, y, w, h\\)"):
        module(query, reference[..., :1], values, shapes, starts)
    with pytest.raises(ValueError, match="as many rows"):
        module(query, reference, values[:, :-1], shapes, starts)


def test_msdeformattn_compiles_fullgraph():
    module = deformconv.MSDeformAttn(d_model=16, n_levels=4, n_heads=2, n_points=2)
    query, reference, values, shapes, starts, padding = inputs()
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(query, reference, values, shapes, starts, padding),
                               module(query, reference, values, shapes, starts, padding))


def listed_attention(state, heads, points_per_level, query, reference_points, values,
                     spatial_shapes, level_start_index, padding_mask=None, sampling="bilinear"):
    """originals_attention with a count of points per level (D-FINE's decoder), written out
    level by level: a level's stretch of the offsets placed on its pixels or box (a box's
    offsets divided by the level's count), the reference op with points_per_level and
    `sampling`."""
    N, Lq, _ = query.shape
    value = F.linear(values, state["value_proj.weight"], state["value_proj.bias"])
    if padding_mask is not None:
        value = value.masked_fill(padding_mask[..., None], 0.0)
    value = value.view(N, values.shape[1], heads, -1)
    offsets = F.linear(query, state["sampling_offsets.weight"], state["sampling_offsets.bias"])
    offsets = offsets.view(N, Lq, heads, sum(points_per_level), 2)
    weights = F.linear(query, state["attention_weights.weight"], state["attention_weights.bias"])
    weights = weights.view(N, Lq, heads, -1).softmax(-1)
    locations, first = [], 0
    for level, points in enumerate(points_per_level):
        level_offsets = offsets[:, :, :, first:first + points]
        reference = reference_points[:, :, None, level, None, :]  # (N, Lq, 1, 1, 2 or 4)
        if reference_points.shape[-1] == 2:
            height, width = spatial_shapes[level].tolist()
            pixel = torch.tensor([width, height], dtype=offsets.dtype)
            locations.append(reference + level_offsets / pixel)
        else:
            locations.append(reference[..., :2]
                             + level_offsets / points * reference[..., 2:] / 2)
        first += points
    sampled = ms_deform_attn_reference(value, spatial_shapes, level_start_index,
                                       torch.cat(locations, 3), weights, points_per_level,
                                       sampling)
    return F.linear(sampled, state["output_proj.weight"], state["output_proj.bias"])


@pytest.mark.parametrize("sampling", ["bilinear", "nearest"])
@pytest.mark.parametrize("box", [False, True], ids=["points", "boxes"])
def test_points_per_level_in_both_modules(box, sampling):
    """A list of points per level (D-FINE's [3, 6, 3]-style counts, a level of none among
    them), each sampling: the state_dict's shapes hold the counts' sum, and both modules give
    the attention written out level by level."""
    points = [3, 6, 0, 2]
    state = originals_state_dict(16, 2, 1, sum(points))
    query, reference, values, shapes, starts, padding = inputs(box=box)
    expected = listed_attention(state, 2, points, query, reference, values, shapes, starts,
                                padding, sampling)
    module = deformconv.MSDeformAttn(d_model=16, n_levels=4, n_heads=2, n_points=points,
                                     sampling=sampling)
    module.load_state_dict(state, strict=True)
    torch.testing.assert_close(module(query, reference, values, shapes, starts, padding),
                               expected)
    mmcv_style = deformconv.MultiScaleDeformableAttention(
        embed_dims=16, num_heads=2, num_levels=4, num_points=points, dropout=0.0,
        batch_first=True, sampling=sampling)
    mmcv_style.load_state_dict(state, strict=True)
    out = mmcv_style(query, value=values, identity=torch.zeros_like(query),
                     key_padding_mask=padding, reference_points=reference,
                     spatial_shapes=shapes, level_start_index=starts)
    torch.testing.assert_close(out, expected)


def test_equal_counts_per_level_are_the_int():
    """n_points=[3] * L loads the state_dict of n_points=3 and gives its output."""
    state = originals_state_dict(16, 2, 4, 3)
    query, reference, values, shapes, starts, padding = inputs(box=True)
    outputs = []
    for n_points in (3, [3, 3, 3, 3]):
        module = deformconv.MSDeformAttn(d_model=16, n_levels=4, n_heads=2, n_points=n_points)
        module.load_state_dict(state, strict=True)
        outputs.append(module(query, reference, values, shapes, starts, padding))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=1e-6)


def test_points_per_level_initial_offsets():
    """Each level's k-th point starts k + 1 steps along its head's direction, as with equal
    counts."""
    module = deformconv.MSDeformAttn(d_model=16, n_levels=3, n_heads=4, n_points=[1, 3, 2])
    bias = module.sampling_offsets.bias.view(4, 6, 2)
    steps = torch.tensor([1.0, 1, 2, 3, 1, 2])
    torch.testing.assert_close(bias, bias[:, :1] * steps[None, :, None])
    torch.testing.assert_close(bias[:, 0], torch.tensor([[1.0, 0], [0, 1], [-1, 0], [0, -1]]),
                               atol=1e-6, rtol=0)


@pytest.mark.parametrize("points", [[3, 6], [3, -1, 2, 1], [3.0, 1, 1, 1]])
def test_bad_points_per_level_are_refused(points):
    with pytest.raises(ValueError, match="expected the points to be an int or 4 counts of at "
                                         "least 0, one per level"):
        deformconv.MSDeformAttn(d_model=16, n_levels=4, n_heads=2, n_points=points)


def test_nearest_sampling_with_points_on_every_level():
    """sampling="nearest" with an int of points: the originals' forward on the reference op's
    nearest pixels."""
    state = originals_state_dict(16, 2, 4, 3)
    query, reference, values, shapes, starts, padding = inputs(box=True)
    module = deformconv.MSDeformAttn(d_model=16, n_levels=4, n_heads=2, n_points=3,
                                     sampling="nearest")
    module.load_state_dict(state, strict=True)
    expected = listed_attention(state, 2, [3] * 4, query, reference, values, shapes, starts,
                                padding, "nearest")
    torch.testing.assert_close(module(query, reference, values, shapes, starts, padding),
                               expected)


def test_unknown_sampling_is_refused():
    for make in (lambda: deformconv.MSDeformAttn(sampling="bicubic"),
                 lambda: deformconv.MultiScaleDeformableAttention(sampling="bicubic")):
        with pytest.raises(ValueError, match='expected sampling to be "bilinear" or "nearest", '
                                             "but got 'bicubic'"):
            make()
