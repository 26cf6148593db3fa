"""ONNX export of multi-scale deformable attention: the standard-operator form
(deformconv.decompositions.ms_deform_attn) against the op, and both modules and the op exported by both
exporters, checked by onnx.checker and run by onnxruntime against PyTorch."""

import inspect

import pytest
import torch

import deformconv
import deformconv.onnx
from export_models import EXPORTERS
from ms_deform_attn_reference import GRID, call, levels_of, make_operands

pytestmark = pytest.mark.workflows

LEVELS = [(6, 5), (3, 3), (2, 1), (1, 1)]


SAMPLING_FORMS = deformconv.decompositions.SAMPLING_FORMS


@pytest.mark.parametrize("sampling_form", SAMPLING_FORMS)
@pytest.mark.parametrize("shapes,heads,channels,points", GRID)
@pytest.mark.parametrize("spread", [1.4, 4.0], ids=["near", "far-outside"])
def test_standard_operator_form_matches_the_op(shapes, heads, channels, points, spread,
                                               sampling_form):
    operands = make_operands(shapes, heads=heads, channels=channels, points=points,
                             spread=spread)
    torch.testing.assert_close(
        deformconv.decompositions.ms_deform_attn(*operands, sampling_form=sampling_form),
        call(operands), rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("sampling_form", SAMPLING_FORMS)
def test_standard_operator_form_on_level_borders(sampling_form):
    # Locations on every level's edges and corners, where grid_sample's and the op's
    # zero-outside conventions meet.
    operands = list(make_operands([(4, 6), (1, 1), (3, 2)], points=4))
    edges = torch.tensor([0.0, 1.0, 0.5, -0.5 / 6, 1 + 0.5 / 6], dtype=torch.float64)
    grid = torch.cartesian_prod(edges, edges)  # 25 (x, y) pairs
    operands[3] = grid[torch.randint(0, 25, operands[3].shape[:-1])]
    torch.testing.assert_close(
        deformconv.decompositions.ms_deform_attn(*operands, sampling_form=sampling_form),
        call(operands), rtol=1e-11, atol=1e-11)


class MmcvStyleCall(torch.nn.Module):
    """mmcv's module called as mmdet's deformable DETR encoder calls it: keywords, batch first,
    the query as its own value."""

    def __init__(self):
        super().__init__()
        self.attention = deformconv.MultiScaleDeformableAttention(
            embed_dims=16, num_heads=2, num_levels=len(LEVELS), num_points=3, dropout=0.0,
            batch_first=True)

    def forward(self, query, reference_points, spatial_shapes, level_start_index):
        return self.attention(query, reference_points=reference_points,
                              spatial_shapes=spatial_shapes,
                              level_start_index=level_start_index)


class Op(torch.nn.Module):
    def forward(self, value, spatial_shapes, level_start_index, locations, weights):
        return deformconv.ms_deform_attn(value, spatial_shapes, level_start_index, locations,
                                         weights)


def onnx_case(case):
    generator = torch.Generator().manual_seed(2)
    spatial_shapes, level_start_index, S = levels_of(LEVELS)
    N, Lq, C, L = 2, 7, 16, len(LEVELS)
    reference = torch.rand(N, Lq, L, 2, generator=generator)
    if case == "MSDeformAttn":
        model = deformconv.MSDeformAttn(d_model=C, n_levels=L, n_heads=2, n_points=3)
        padding = torch.rand(N, S, generator=generator) < 0.2
        args = (torch.randn(N, Lq, C, generator=generator), reference,
                torch.randn(N, S, C, generator=generator), spatial_shapes, level_start_index,
                padding)
    elif case == "MultiScaleDeformableAttention":
        model = MmcvStyleCall()
        args = (torch.randn(N, S, C, generator=generator), torch.rand(N, S, L, 2),
                spatial_shapes, level_start_index)
    else:
        model = Op()
        value, _, _, locations, weights = make_operands(LEVELS, queries=Lq, heads=2,
                                                        channels=3, points=3, spread=3.0,
                                                        dtype=torch.float32)
        args = (value, spatial_shapes, level_start_index, locations, weights)
    # Random offsets and weights, so that the sampling is exercised away from the initial ones.
    torch.manual_seed(1)
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    return model.eval(), args


def input_names(model):
    return list(inspect.signature(model.forward).parameters)


def export(model, args, path, dynamo=True):
    deformconv.onnx.export_onnx(model, args, str(path), dynamo=dynamo,
                                input_names=input_names(model))


def run_in_onnxruntime(path, model, args):
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    # By name: the TorchScript-based exporter drops the inputs it recorded as constants.
    arguments = dict(zip(input_names(model), args))
    feeds = {i.name: arguments[i.name].numpy() for i in session.get_inputs()}
    return torch.from_numpy(session.run(None, feeds)[0])


@pytest.mark.parametrize("dynamo", EXPORTERS)
@pytest.mark.parametrize("case", ["MSDeformAttn", "MultiScaleDeformableAttention", "op"])
def test_export_runs_in_onnxruntime(tmp_path, dynamo, case):
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    model, args = onnx_case(case)
    path = tmp_path / "model.onnx"
    export(model, args, path, dynamo)

    proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    assert all(node.domain == "" for node in proto.graph.node)
    assert sum(node.op_type == "GridSample" for node in proto.graph.node) == len(LEVELS)
    from_ort = run_in_onnxruntime(path, model, args)
    expected = model(*args).detach()
    assert expected.abs().max() > 0.5
    torch.testing.assert_close(from_ort, expected, rtol=1e-5,
                               atol=1e-5 * expected.abs().max().item())


def test_dynamo_export_reads_the_levels_from_its_inputs(tmp_path):
    # The torch.export-based graph takes the levels' sizes from spatial_shapes and
    # level_start_index when it runs: the same rows split into other levels give the op's
    # result on those levels.
    pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    model, args = onnx_case("op")
    path = tmp_path / "model.onnx"
    export(model, args, path)
    other_shapes, other_starts, S = levels_of([(4, 8), (1, 6), (1, 3), (1, 1)])
    assert S == args[0].shape[1]
    other = (args[0], other_shapes, other_starts, args[3], args[4])
    torch.testing.assert_close(run_in_onnxruntime(path, model, other), model(*other), rtol=1e-5,
                               atol=1e-5)
