"""Multi-scale deformable attention in the forms of today's detectors: a count of points per
level (RT-DETRv2's, D-FINE's and DEIMv2's decoders, transformers'
multi_scale_deformable_attention_v2), nearest sampling (its method="discrete") and the softmax
of the weights inside the op (DCNv4's flash deformable attention), on the CPU and through the
emulated CUDA launchers, against the readable reference
(ms_deform_attn_reference.py) and transformers' function, with gradcheck, every combination of
requested gradients, every dtype, the workflows and bad arguments."""

import pytest
import torch

import deformconv
from branching import branch_trace, requested_subsets
from export_models import EXPORTERS
from ms_deform_attn_reference import (assert_requested_gradients, levels_of, make_operands,
                                      ms_deform_attn_reference, nearest_rows)

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
SAMPLINGS = ["bilinear", "nearest"]
# The weights as given, or logits normalised by the op's softmax.
SOFTMAX = [False, True]
SOFTMAX_IDS = ["given", "softmax"]

# (levels, points per level or None for 3 on every level, heads, channels): D-FINE's decoder
# counts, a level with no points, one level, counts of one, the (L, P) layout; channels in
# vectors (8, 32), one at a time (3) and in several passes (33 on the emulated GPU).
LAYOUTS = [
    ([(4, 5), (2, 3), (1, 1)], [3, 6, 3], 2, 8),
    ([(4, 5), (2, 3)], [0, 2], 3, 3),
    ([(3, 3)], [5], 1, 32),
    ([(2, 7), (7, 2), (4, 4)], [1, 4, 1], 2, 33),
    ([(4, 5), (2, 3)], None, 2, 8),
]
LAYOUT_IDS = ["dfine-3-6-3", "empty-level", "one-level", "ones-and-four", "every-level-3"]


def operands_of(layout, dtype=torch.float64, **options):
    """(value, spatial_shapes, level_start_index, locations, weights), and the op's
    points_per_level ([] for the (L, P) layout)."""
    shapes, points_per_level, heads, channels = layout
    operands = make_operands(shapes, heads=heads, channels=channels, points=3,
                             points_per_level=points_per_level, dtype=dtype, **options)
    return operands, points_per_level or []


def expected_gradients(operands, points, grad_output, sampling, softmax=False):
    """The reference's output and gradients in float64 on the operands as given (zero for the
    locations of nearest sampling, which take no part in its graph and choose their pixels in
    their own dtype)."""
    value, shapes, starts, locations, weights = operands
    value, weights = (t.double().requires_grad_() for t in (value, weights))
    if sampling == "bilinear":
        locations = locations.double().requires_grad_()
    output = ms_deform_attn_reference(value, shapes, starts, locations, weights, points or None,
                                      sampling, softmax)
    if sampling == "bilinear":
        return output, torch.autograd.grad(output, (value, locations, weights),
                                           grad_output.double())
    grad_value, grad_weights = torch.autograd.grad(output, (value, weights),
                                                   grad_output.double())
    return output, [grad_value, torch.zeros_like(locations, dtype=torch.float64), grad_weights]


def layout_branches(points, sampling, softmax):
    return {"ms_deform_attn.points.per_level" if points else "ms_deform_attn.points.every_level",
            f"ms_deform_attn.sampling.{sampling}",
            "ms_deform_attn.weights.softmax" if softmax else "ms_deform_attn.weights.given"}


@pytest.mark.parametrize("softmax", SOFTMAX, ids=SOFTMAX_IDS)
@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_variants_match_the_reference(layout, sampling, softmax):
    operands, points = operands_of(layout)
    value, shapes, starts, locations, weights = operands
    leaves = [t.clone().requires_grad_() for t in (value, locations, weights)]
    with branch_trace() as taken:
        output = deformconv.ms_deform_attn(leaves[0], shapes, starts, leaves[1], leaves[2],
                                           points_per_level=points or None, sampling=sampling,
                                           softmax=softmax)
        grad_output = torch.randn_like(output)
        grads = torch.autograd.grad(output, leaves, grad_output)
    assert layout_branches(points, sampling, softmax) <= taken, sorted(taken)
    expected, expected_grads = expected_gradients(operands, points, grad_output, sampling,
                                                  softmax)
    torch.testing.assert_close(output, expected)
    for name, got, want in zip(("value", "sampling_locations", "attention_weights"), grads,
                               expected_grads):
        torch.testing.assert_close(got, want, msg=lambda m, name=name: f"{name}: {m}")
    if sampling == "nearest":
        assert torch.equal(grads[1], torch.zeros_like(grads[1]))


@pytest.mark.parametrize("softmax", SOFTMAX, ids=SOFTMAX_IDS)
@pytest.mark.parametrize("sampling,method", [("bilinear", "default"), ("nearest", "discrete")])
@pytest.mark.parametrize("layout", LAYOUTS[:2], ids=LAYOUT_IDS[:2])
def test_variants_match_transformers(layout, sampling, method, softmax):
    """transformers' own function (D-FINE's modeling file), a second oracle: its output and,
    through autograd, its gradients of the value and the weights (and the locations',
    bilinear); with softmax, given the logits' torch.softmax, as D-FINE's attention computes
    it before the call."""
    pytest.importorskip("transformers")
    from transformers.models.d_fine.modeling_d_fine import multi_scale_deformable_attention_v2

    operands, points = operands_of(layout)
    value, shapes, starts, locations, weights = operands
    grad_output = torch.randn(2, 5, layout[2] * layout[3], dtype=torch.float64)
    differentiated = [value, weights] if sampling == "nearest" else [value, locations, weights]

    def output_and_gradients(attend):
        leaves = [t.clone().requires_grad_() for t in differentiated]
        output = attend(*leaves)
        return output, torch.autograd.grad(output, leaves, grad_output)

    def with_locations(attend):
        if sampling == "nearest":
            return lambda v, w: attend(v, locations, w)
        return attend

    ours = output_and_gradients(with_locations(lambda v, loc, w: deformconv.ms_deform_attn(
        v, shapes, starts, loc, w, points_per_level=points, sampling=sampling,
        softmax=softmax)))
    theirs = output_and_gradients(with_locations(
        lambda v, loc, w: multi_scale_deformable_attention_v2(
            v, shapes.tolist(), loc, w.softmax(-1) if softmax else w, points, method)))
    torch.testing.assert_close(ours[0], theirs[0])
    for got, want in zip(ours[1], theirs[1]):
        torch.testing.assert_close(got, want)


def row_numbers_case(dtype):
    """Value holding each pixel's row number (exact in every dtype: 221 rows), one head and
    channel, one point a query of weight 1 at locations spread over and past a 13 x 17 level,
    and at each x + 0.5 boundary of the pixels and the dtype's neighbours on either side: the
    output is the row of the pixel that the sampling chose."""
    spatial_shapes, starts, S = levels_of([(13, 17)])
    value = torch.arange(S, dtype=dtype).view(1, S, 1, 1)
    generator = torch.Generator().manual_seed(3)
    spread = torch.rand(300, 2, generator=generator, dtype=torch.float64) * 1.6 - 0.3
    edges = []
    for size in (17, 13):
        boundary = ((torch.arange(size + 1, dtype=torch.float64) - 0.5) / size).to(dtype)
        edges.append(torch.cat([torch.nextafter(boundary, torch.tensor(-2.0, dtype=dtype)),
                                boundary, torch.nextafter(boundary, torch.tensor(2.0, dtype=dtype))]))
    count = min(len(edges[0]), len(edges[1]))
    boundaries = torch.stack([edges[0][:count], edges[1][:count]], -1)
    locations = torch.cat([spread.to(dtype), boundaries]).view(1, -1, 1, 1, 1, 2)
    weights = torch.ones(locations.shape[:-1], dtype=dtype)
    rows = nearest_rows(locations[:, :, :, 0], 13, 17, 0).view(1, -1, 1)
    return (value, spatial_shapes, starts, locations, weights), rows


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nearest_pixel_at_the_boundaries_and_past_the_borders(emulated, dtype):
    """The chosen pixel, CPU and emulated GPU, is the one that the original's arithmetic in the
    dtype chooses, at every boundary, its neighbours and past the borders."""
    operands, rows = row_numbers_case(dtype)
    for ops in (torch.ops.deformconv, emulated):
        output = ops.ms_deform_attn(*operands, 64, [], "nearest")
        assert torch.equal(output.double(), rows.double()), ops


def test_nearest_non_finite_locations_take_a_pixel_of_the_level(emulated):
    """NaN takes pixel 0 of its axis, -inf the first pixel and +inf the last, on the CPU and
    the emulated GPU alike; no read outside the level."""
    operands, _ = row_numbers_case(torch.float32)
    value, shapes, starts, _, _ = operands
    inf, nan = float("inf"), float("nan")
    locations = torch.tensor([[nan, nan], [-inf, inf], [inf, -inf], [inf, inf], [0.5, nan]])
    locations = locations.view(1, 5, 1, 1, 1, 2)
    weights = torch.ones(1, 5, 1, 1, 1)
    # (x, y) -> row y * 17 + x of the 13 x 17 level; 0.5 * 17 + 0.5 is pixel 9.
    rows = torch.tensor([0.0, 12 * 17, 16, 12 * 17 + 16, 9]).view(1, 5, 1)
    for ops in (torch.ops.deformconv, emulated):
        output = ops.ms_deform_attn(value, shapes, starts, locations, weights, 64, [], "nearest")
        assert torch.equal(output, rows), ops


def test_nearest_gradcheck_of_value_and_weights():
    """The value's and the weights' gradients by gradcheck (locations held); the locations'
    gradient is zero."""
    (value, shapes, starts, locations, weights), points = operands_of(
        ([(3, 4), (2, 2)], [1, 3], 2, 2), batch=1, queries=3)

    def attend(value, weights):
        return deformconv.ms_deform_attn(value, shapes, starts, locations, weights,
                                         points_per_level=points, sampling="nearest")

    assert torch.autograd.gradcheck(attend, [value.requires_grad_(), weights.requires_grad_()])
    locations.requires_grad_()
    output = deformconv.ms_deform_attn(value, shapes, starts, locations, weights,
                                       points_per_level=points, sampling="nearest")
    (grad,) = torch.autograd.grad(output.sum(), locations)
    assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_softmax_weights_are_torch_softmax_over_the_exponent_range(emulated, dtype):
    """The op's normalised weights, read back as the value's gradient (64 samples, each on a
    pixel centre of a 1 x 64 level: d out / d value[s] = a_s), against torch.softmax, on the CPU
    (whose exponentials are its own, vectorised) and the emulated GPU, for logits from 0 down
    past the smallest normal exponential, -inf and a NaN-free row: to a few units in the last
    place; below the smallest normal number (tiny), 0 on the CPU where torch's may be a
    denormal."""
    samples = 64
    spatial_shapes, starts, _ = levels_of([(1, samples)])
    value = torch.zeros(1, samples, 1, 1, dtype=dtype)
    x = (torch.arange(samples, dtype=dtype) + 0.5) / samples
    locations = torch.stack([x, torch.full_like(x, 0.5)], -1).view(1, 1, 1, 1, samples, 2)
    logits = torch.cat([torch.linspace(0, -120, samples - 4, dtype=dtype),
                        torch.tensor([-float("inf"), -745.0, 3.5, 1e-3], dtype=dtype)])
    logits = logits.view(1, 1, 1, 1, samples)
    expected = torch.softmax(logits.flatten(), 0)
    for ops in (torch.ops.deformconv, emulated):
        grad_value, _, _ = ops.ms_deform_attn_backward(
            torch.ones(1, 1, 1, dtype=dtype), value, spatial_shapes, starts, locations, logits,
            64, [], "bilinear", True, [True, False, False])
        weights = grad_value.flatten()
        torch.testing.assert_close(weights, expected, rtol=8 * torch.finfo(dtype).eps,
                                   atol=torch.finfo(dtype).tiny)
        if ops is torch.ops.deformconv:
            # The CPU's exponential flushes what would be denormal to 0 (the GPU's keeps it).
            assert torch.equal(weights == 0, expected < torch.finfo(dtype).tiny)


def test_equal_counts_give_the_bits_of_the_layout_by_level():
    """[P] * L in the flat layout computes what P points on every level in the (L, P) layout
    do, bit for bit."""
    shapes = [(4, 5), (2, 3), (1, 1)]
    by_level = make_operands(shapes, heads=2, channels=8, points=4, dtype=torch.float32)
    value, spatial_shapes, starts, locations, weights = by_level
    flat = (value, spatial_shapes, starts, locations.flatten(3, 4), weights.flatten(3, 4))
    grad_output = torch.randn(2, 5, 16)
    with branch_trace() as taken:
        output = deformconv.ms_deform_attn(*by_level)
        grads = torch.ops.deformconv.ms_deform_attn_backward(grad_output, *by_level, 64, [],
                                                             "bilinear", False, [True] * 3)
    assert "ms_deform_attn.points.every_level" in taken
    flat_output = deformconv.ms_deform_attn(*flat, points_per_level=[4, 4, 4])
    flat_grads = torch.ops.deformconv.ms_deform_attn_backward(grad_output, *flat, 64, [4, 4, 4],
                                                              "bilinear", False, [True] * 3)
    assert torch.equal(output, flat_output)
    for got, want in zip(flat_grads, grads):
        assert torch.equal(got, want.reshape(got.shape))


@pytest.mark.parametrize("softmax", SOFTMAX, ids=SOFTMAX_IDS)
def test_gradcheck_with_points_per_level(softmax):
    # Random locations lie off the levels' pixel grids.
    (value, shapes, starts, locations, weights), points = operands_of(
        ([(3, 4), (2, 2)], [1, 3], 2, 2), batch=1, queries=3)

    def attend(value, locations, weights):
        return deformconv.ms_deform_attn(value, shapes, starts, locations, weights,
                                         points_per_level=points, softmax=softmax)

    assert torch.autograd.gradcheck(attend, [t.requires_grad_() for t in (value, locations,
                                                                         weights)])


def each_subset_against_the_reference(backward, layout, sampling, softmax, dtype):
    """backward(grad_output, operands, points, requested) for every subset of the gradients,
    against the float64 reference on the operands rounded to dtype."""
    operands, points = operands_of(layout, dtype)
    grad_output = torch.randn(2, 5, layout[2] * layout[3], dtype=torch.float64).to(dtype)
    _, expected = expected_gradients(operands, points, grad_output, sampling, softmax)
    for requested in requested_subsets(3):
        grads = backward(grad_output, operands, points, list(requested))
        assert_requested_gradients(requested, grads, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("softmax", SOFTMAX, ids=SOFTMAX_IDS)
@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_cpu_every_requested_subset_in_every_dtype(layout, sampling, softmax, dtype):
    def backward(grad_output, operands, points, requested):
        with branch_trace() as taken:
            grads = torch.ops.deformconv.ms_deform_attn_backward(
                grad_output, *operands, 64, points, sampling, softmax, requested)
        assert layout_branches(points, sampling, softmax) <= taken, sorted(taken)
        return grads

    each_subset_against_the_reference(backward, layout, sampling, softmax, dtype)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_adds", "gathered"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("softmax", SOFTMAX, ids=SOFTMAX_IDS)
@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_emulated_cuda_every_requested_subset_in_every_dtype(emulated, layout, sampling, softmax,
                                                             dtype, deterministic):
    """The CUDA launchers, forward and backward, with the value gradient added by atomics or
    gathered (deterministic mode)."""
    operands, points = operands_of(layout, dtype)
    with branch_trace(emulated) as taken:
        output = emulated.ms_deform_attn(*operands, 64, points, sampling, softmax)
    assert layout_branches(points, sampling, softmax) <= taken, sorted(taken)
    expected, _ = expected_gradients(operands, points,
                                     torch.zeros_like(output, dtype=torch.float64), sampling,
                                     softmax)
    assert_requested_gradients([True], [output], [expected], dtype)

    def backward(grad_output, operands, points, requested):
        with branch_trace(emulated) as taken:
            grads = emulated.ms_deform_attn_backward(grad_output, *operands, 64, points,
                                                     sampling, softmax, requested, deterministic)
        if requested[0]:
            path = "gathered" if deterministic else "atomic_adds"
            assert f"ms_deform_attn.cuda.backward.value_gradient.{path}" in taken, sorted(taken)
        return grads

    each_subset_against_the_reference(backward, layout, sampling, softmax, dtype)


@pytest.mark.parametrize("softmax", SOFTMAX, ids=SOFTMAX_IDS)
def test_emulated_cuda_stages_many_points_in_several_rounds(emulated, softmax):
    """More points a (query, head) than a block stages at once: the rounds cross the levels'
    boundaries, and the softmax normalises over all of them."""
    layout = ([(4, 5), (2, 3), (1, 1)], [3, 250, 3], 2, 8)
    operands, points = operands_of(layout, torch.float32)
    grad_output = torch.randn(2, 5, 16, dtype=torch.float64)
    with branch_trace(emulated) as taken:
        output = emulated.ms_deform_attn(*operands, 64, points, "bilinear", softmax)
        grads = emulated.ms_deform_attn_backward(grad_output.float(), *operands, 64, points,
                                                 "bilinear", softmax, [True] * 3, False)
    assert "ms_deform_attn.cuda.samples.several_rounds" in taken, sorted(taken)
    expected, expected_grads = expected_gradients(operands, points, grad_output, "bilinear",
                                                  softmax)
    assert_requested_gradients([True] * 3, grads, expected_grads, torch.float32)
    assert_requested_gradients([True], [output], [expected], torch.float32)


def bad_call(**changes):
    operands, points = operands_of(LAYOUTS[0])
    arguments = dict(zip(("value", "spatial_shapes", "level_start_index", "sampling_locations",
                          "attention_weights"), operands), points_per_level=points)
    arguments.update(changes)
    return lambda: deformconv.ms_deform_attn(**arguments)


@pytest.mark.parametrize("call,message", [
    (bad_call(points_per_level=[3, 9]),
     "expected points_per_level to give a count for each of the 3 levels of spatial_shapes, "
     "but got 2 counts"),
    (bad_call(points_per_level=[3, 6, 3, 1]), "each of the 3 levels of spatial_shapes, but got 4"),
    (bad_call(points_per_level=[3, -1, 10]), r"expected points_per_level\[1\] to be 0 to"),
    (bad_call(points_per_level=[4, 6, 3]),
     r"expected sampling_locations of shape \[2, 5, 2, 13, 2\] \(batch, queries, heads, sum of "
     r"points_per_level, 2\), but got \[2, 5, 2, 12, 2\]"),
    (bad_call(attention_weights=torch.zeros(2, 5, 2, 11, dtype=torch.float64)),
     r"expected attention_weights of shape \[2, 5, 2, 12\] \(batch, queries, heads, sum of "
     r"points_per_level\), but got \[2, 5, 2, 11\]"),
    (bad_call(sampling_locations=torch.zeros(2, 5, 2, 3, 4, 2, dtype=torch.float64)),
     "expected sampling_locations to be a 5-D tensor .* with points_per_level, but got a 6-D"),
    (bad_call(sampling="bicubic"),
     'expected sampling to be "bilinear" or "nearest", but got "bicubic"'),
])
def test_bad_variants_are_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_more_levels_than_points_per_level_can_list_are_refused():
    shapes = [(1, 1)] * 17
    value, spatial_shapes, starts, locations, weights = make_operands(
        shapes, points_per_level=[1] * 17)
    with pytest.raises(ValueError, match="expected points_per_level to list at most 16 levels, "
                                         "but got 17"):
        deformconv.ms_deform_attn(value, spatial_shapes, starts, locations, weights,
                                  points_per_level=[1] * 17)


@pytest.mark.workflows
@pytest.mark.parametrize("softmax", SOFTMAX, ids=SOFTMAX_IDS)
@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_opcheck_forward_and_backward(sampling, softmax):
    operands, points = operands_of(LAYOUTS[0], torch.float32)
    grad_output = torch.randn(2, 5, 16)
    torch.library.opcheck(torch.ops.deformconv.ms_deform_attn.default,
                          (*operands, 64, points, sampling, softmax))
    for output_mask in ([True, True, True], [True, False, False], [False, True, True]):
        torch.library.opcheck(torch.ops.deformconv.ms_deform_attn_backward.default,
                              (grad_output, *operands, 64, points, sampling, softmax,
                               output_mask))


@pytest.mark.workflows
@pytest.mark.parametrize("softmax", SOFTMAX, ids=SOFTMAX_IDS)
@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_torch_compile_export_and_the_decomposition(sampling, softmax):
    operands, points = operands_of(LAYOUTS[0], torch.float32)

    def attend(value, shapes, starts, locations, weights):
        return deformconv.ms_deform_attn(value, shapes, starts, locations, weights,
                                         points_per_level=points, sampling=sampling,
                                         softmax=softmax).relu()

    expected = attend(*operands)
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(*operands), expected)

    class Attend(torch.nn.Module):
        def forward(self, value, shapes, starts, locations, weights):
            return attend(value, shapes, starts, locations, weights)

    exported = torch.export.export(Attend(), tuple(operands))
    torch.testing.assert_close(exported.module()(*operands), expected)
    decomposed = exported.run_decompositions(deformconv.decompositions.table())
    assert not any("deformconv" in str(node.target) for node in decomposed.graph.nodes)
    torch.testing.assert_close(decomposed.module()(*operands), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.workflows
def test_torchscript_and_autocast():
    operands, points = operands_of(LAYOUTS[0], torch.float32)

    def attend(value: torch.Tensor, shapes: torch.Tensor, starts: torch.Tensor,
               locations: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return deformconv.ms_deform_attn(value, shapes, starts, locations, weights, 64,
                                         [3, 6, 3], "nearest")

    scripted = torch.jit.script(attend)
    assert torch.equal(scripted(*operands), attend(*operands))
    value, shapes, starts, locations, weights = operands
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = deformconv.ms_deform_attn(value.bfloat16(), shapes, starts, locations, weights,
                                        points_per_level=points, sampling="nearest")
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, attend(value.bfloat16().float(), shapes, starts, locations,
                                           weights))


class Variants(torch.nn.Module):
    def __init__(self, sampling, softmax):
        super().__init__()
        self.sampling = sampling
        self.softmax = softmax

    def forward(self, value, spatial_shapes, level_start_index, locations, weights):
        return deformconv.ms_deform_attn(value, spatial_shapes, level_start_index, locations,
                                         weights, points_per_level=[3, 6, 3],
                                         sampling=self.sampling, softmax=self.softmax)


@pytest.mark.workflows
@pytest.mark.parametrize("softmax", SOFTMAX, ids=SOFTMAX_IDS)
@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("dynamo", EXPORTERS)
def test_onnx_export_runs_in_onnxruntime(tmp_path, dynamo, sampling, softmax):
    """Both exporters, in standard operators: a GridSample a level for bilinear sampling,
    integer gathers and none for nearest; the op's softmax as a Softmax node."""
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    operands, _ = operands_of(LAYOUTS[0], torch.float32, spread=3.0)
    names = ["value", "spatial_shapes", "level_start_index", "locations", "weights"]
    path = tmp_path / "model.onnx"
    model = Variants(sampling, softmax).eval()
    deformconv.onnx.export_onnx(model, tuple(operands), str(path), dynamo=dynamo,
                                input_names=names)
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    operators = [node.op_type for node in proto.graph.node]
    assert operators.count("GridSample") == (3 if sampling == "bilinear" else 0)
    assert sampling == "bilinear" or "GatherElements" in operators, operators
    assert operators.count("Softmax") == int(softmax), operators
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    arguments = dict(zip(names, operands))
    feeds = {i.name: arguments[i.name].numpy() for i in session.get_inputs()}
    from_ort = torch.from_numpy(session.run(None, feeds)[0])
    torch.testing.assert_close(from_ort, model(*operands), rtol=1e-5, atol=1e-5)
