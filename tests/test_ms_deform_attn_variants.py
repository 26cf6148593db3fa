"""Multi-scale deformable attention in the forms of today's detectors: a count of points per
level (RT-DETRv2's, D-FINE's and DEIMv2's decoders, transformers'
multi_scale_deformable_attention_v2), on the CPU and through the emulated CUDA launchers, against
the readable reference (ms_deform_attn_reference.py), with gradcheck, every combination of
requested gradients, every dtype, the workflows and bad arguments."""

import pytest
import torch

import deformconv
from branching import branch_trace, requested_subsets
from export_models import EXPORTERS
from ms_deform_attn_reference import (assert_requested_gradients, make_operands,
                                      ms_deform_attn_reference)

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]

# (levels, points per level, heads, channels): D-FINE's decoder counts, a level with no points,
# one level, counts of one; channels in vectors (8, 32), one at a time (3) and in several passes
# (33 on the emulated GPU).
LAYOUTS = [
    ([(4, 5), (2, 3), (1, 1)], [3, 6, 3], 2, 8),
    ([(4, 5), (2, 3)], [0, 2], 3, 3),
    ([(3, 3)], [5], 1, 32),
    ([(2, 7), (7, 2), (4, 4)], [1, 4, 1], 2, 33),
]
LAYOUT_IDS = ["dfine-3-6-3", "empty-level", "one-level", "ones-and-four"]


def operands_of(layout, dtype=torch.float64, **options):
    shapes, points_per_level, heads, channels = layout
    return make_operands(shapes, heads=heads, channels=channels, points_per_level=points_per_level,
                         dtype=dtype, **options), points_per_level


def expected_gradients(operands, points_per_level, grad_output):
    """The reference's output and gradients in float64 on the operands as given."""
    value, shapes, starts, locations, weights = operands
    leaves = [t.double().requires_grad_() for t in (value, locations, weights)]
    output = ms_deform_attn_reference(leaves[0], shapes, starts, leaves[1], leaves[2],
                                      points_per_level)
    return output, torch.autograd.grad(output, leaves, grad_output.double())


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_points_per_level_match_the_reference(layout):
    operands, points_per_level = operands_of(layout)
    value, shapes, starts, locations, weights = operands
    leaves = [t.clone().requires_grad_() for t in (value, locations, weights)]
    with branch_trace() as taken:
        output = deformconv.ms_deform_attn(leaves[0], shapes, starts, leaves[1], leaves[2],
                                           points_per_level=points_per_level)
        grad_output = torch.randn_like(output)
        grads = torch.autograd.grad(output, leaves, grad_output)
    assert "ms_deform_attn.points.per_level" in taken
    assert "ms_deform_attn.points.every_level" not in taken
    expected, expected_grads = expected_gradients(operands, points_per_level, grad_output)
    torch.testing.assert_close(output, expected)
    for name, got, want in zip(("value", "sampling_locations", "attention_weights"), grads,
                               expected_grads):
        torch.testing.assert_close(got, want, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("layout", LAYOUTS[:2], ids=LAYOUT_IDS[:2])
def test_points_per_level_match_transformers(layout):
    """transformers' own function (D-FINE's modeling file), a second oracle: its output and,
    through autograd, its gradients."""
    pytest.importorskip("transformers")
    from transformers.models.d_fine.modeling_d_fine import multi_scale_deformable_attention_v2

    operands, points_per_level = operands_of(layout)
    value, shapes, starts, locations, weights = operands
    grad_output = torch.randn(2, 5, layout[2] * layout[3], dtype=torch.float64)

    def output_and_gradients(attend):
        leaves = [t.clone().requires_grad_() for t in (value, locations, weights)]
        output = attend(*leaves)
        return output, torch.autograd.grad(output, leaves, grad_output)

    ours = output_and_gradients(lambda v, loc, w: deformconv.ms_deform_attn(
        v, shapes, starts, loc, w, points_per_level=points_per_level))
    theirs = output_and_gradients(lambda v, loc, w: multi_scale_deformable_attention_v2(
        v, shapes.tolist(), loc, w, points_per_level, "default"))
    torch.testing.assert_close(ours[0], theirs[0])
    for name, got, want in zip(("value", "sampling_locations", "attention_weights"), ours[1],
                               theirs[1]):
        torch.testing.assert_close(got, want, msg=lambda m, name=name: f"{name}: {m}")


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
                                                             [True] * 3)
    assert "ms_deform_attn.points.every_level" in taken
    flat_output = deformconv.ms_deform_attn(*flat, points_per_level=[4, 4, 4])
    flat_grads = torch.ops.deformconv.ms_deform_attn_backward(grad_output, *flat, 64, [4, 4, 4],
                                                              [True] * 3)
    assert torch.equal(output, flat_output)
    for got, want in zip(flat_grads, grads):
        assert torch.equal(got, want.reshape(got.shape))


def test_gradcheck_with_points_per_level():
    # Random locations lie off the levels' pixel grids.
    (value, shapes, starts, locations, weights), points = operands_of(
        ([(3, 4), (2, 2)], [1, 3], 2, 2), batch=1, queries=3)

    def attend(value, locations, weights):
        return deformconv.ms_deform_attn(value, shapes, starts, locations, weights,
                                         points_per_level=points)

    assert torch.autograd.gradcheck(attend, [t.requires_grad_() for t in (value, locations,
                                                                         weights)])


def each_subset_against_the_reference(backward, layout, dtype):
    """backward(grad_output, operands, points, requested) for every subset of the gradients,
    against the float64 reference on the operands rounded to dtype."""
    operands, points_per_level = operands_of(layout, dtype)
    grad_output = torch.randn(2, 5, layout[2] * layout[3], dtype=torch.float64).to(dtype)
    _, expected = expected_gradients(operands, points_per_level, grad_output)
    for requested in requested_subsets(3):
        grads = backward(grad_output, operands, points_per_level, list(requested))
        assert_requested_gradients(requested, grads, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_cpu_every_requested_subset_in_every_dtype(layout, dtype):
    def backward(grad_output, operands, points, requested):
        with branch_trace() as taken:
            grads = torch.ops.deformconv.ms_deform_attn_backward(grad_output, *operands, 64,
                                                                 points, requested)
        assert "ms_deform_attn.points.per_level" in taken
        return grads

    each_subset_against_the_reference(backward, layout, dtype)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_adds", "gathered"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_emulated_cuda_every_requested_subset_in_every_dtype(emulated, layout, dtype,
                                                             deterministic):
    """The CUDA launchers, forward and backward, with the value gradient added by atomics or
    gathered (deterministic mode)."""
    operands, points_per_level = operands_of(layout, dtype)
    with branch_trace(emulated) as taken:
        output = emulated.ms_deform_attn(*operands, 64, points_per_level)
    assert "ms_deform_attn.points.per_level" in taken
    expected, _ = expected_gradients(operands, points_per_level,
                                     torch.zeros_like(output, dtype=torch.float64))
    assert_requested_gradients([True], [output], [expected], dtype)

    def backward(grad_output, operands, points, requested):
        with branch_trace(emulated) as taken:
            grads = emulated.ms_deform_attn_backward(grad_output, *operands, 64, points,
                                                     requested, deterministic)
        if requested[0]:
            path = "gathered" if deterministic else "atomic_adds"
            assert f"ms_deform_attn.cuda.backward.value_gradient.{path}" in taken, sorted(taken)
        return grads

    each_subset_against_the_reference(backward, layout, dtype)


def test_emulated_cuda_stages_many_points_in_several_rounds(emulated):
    """More points a (query, head) than a block stages at once: the rounds cross the levels'
    boundaries."""
    layout = ([(4, 5), (2, 3), (1, 1)], [3, 250, 3], 2, 8)
    operands, points_per_level = operands_of(layout, torch.float32)
    grad_output = torch.randn(2, 5, 16, dtype=torch.float64)
    with branch_trace(emulated) as taken:
        output = emulated.ms_deform_attn(*operands, 64, points_per_level)
        grads = emulated.ms_deform_attn_backward(grad_output.float(), *operands, 64,
                                                 points_per_level, [True] * 3, False)
    assert "ms_deform_attn.cuda.samples.several_rounds" in taken, sorted(taken)
    expected, expected_grads = expected_gradients(operands, points_per_level, grad_output)
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
])
def test_bad_points_per_level_are_refused(call, message):
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
def test_opcheck_forward_and_backward():
    operands, points = operands_of(LAYOUTS[0], torch.float32)
    grad_output = torch.randn(2, 5, 16)
    torch.library.opcheck(torch.ops.deformconv.ms_deform_attn.default, (*operands, 64, points))
    for output_mask in ([True, True, True], [True, False, False], [False, True, True]):
        torch.library.opcheck(torch.ops.deformconv.ms_deform_attn_backward.default,
                              (grad_output, *operands, 64, points, output_mask))


@pytest.mark.workflows
def test_torch_compile_export_and_the_decomposition():
    operands, points = operands_of(LAYOUTS[0], torch.float32)

    def attend(value, shapes, starts, locations, weights):
        return deformconv.ms_deform_attn(value, shapes, starts, locations, weights,
                                         points_per_level=points).relu()

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
                                         [3, 6, 3])

    scripted = torch.jit.script(attend)
    assert torch.equal(scripted(*operands), attend(*operands))
    value, shapes, starts, locations, weights = operands
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = deformconv.ms_deform_attn(value.bfloat16(), shapes, starts, locations, weights,
                                        points_per_level=points)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, attend(value.bfloat16().float(), shapes, starts, locations,
                                           weights))


class PointsPerLevel(torch.nn.Module):
    def forward(self, value, spatial_shapes, level_start_index, locations, weights):
        return deformconv.ms_deform_attn(value, spatial_shapes, level_start_index, locations,
                                         weights, points_per_level=[3, 6, 3])


@pytest.mark.workflows
@pytest.mark.parametrize("dynamo", EXPORTERS)
def test_onnx_export_runs_in_onnxruntime(tmp_path, dynamo):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    operands, _ = operands_of(LAYOUTS[0], torch.float32, spread=3.0)
    names = ["value", "spatial_shapes", "level_start_index", "locations", "weights"]
    path = tmp_path / "model.onnx"
    model = PointsPerLevel().eval()
    deformconv.onnx.export_onnx(model, tuple(operands), str(path), dynamo=dynamo,
                                input_names=names)
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    assert sum(node.op_type == "GridSample" for node in proto.graph.node) == 3
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    arguments = dict(zip(names, operands))
    feeds = {i.name: arguments[i.name].numpy() for i in session.get_inputs()}
    from_ort = torch.from_numpy(session.run(None, feeds)[0])
    torch.testing.assert_close(from_ort, model(*operands), rtol=1e-5, atol=1e-5)

