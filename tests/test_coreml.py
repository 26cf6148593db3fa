"""Core ML: coremltools converts every op's decomposed program in the gather form, in float32
at two shapes per op (test_runtimes's cases), with its default float16 compute precision.
Conversion is all that runs off Apple hardware, so each model is checked by what conversion
gives: the inputs and output of the program, and in its MIL program the four corner gathers
of each bilinear sampling, where grid_sample would have been. The two refusals that
docs/deployment.md gives are checked by their messages: the GridSample form, which
coremltools has no conversion for, and multi-scale deformable attention's (N, Lq, M, L, P, 2)
locations, of a rank above Core ML's 5, which the same attention in the op's points-per-level
layout avoids, as MSDeformAttn does with its points given per level."""

import collections
import warnings

import pytest
import torch

import deformconv
from ms_deform_attn_reference import levels_of
import test_runtimes
from test_runtimes import SHAPES, MsDeformAttnOp, decomposed_case

ct = pytest.importorskip("coremltools")

pytestmark = pytest.mark.workflows

# Deformable DETR's attention (P points on every level) in the op's points-per-level layout,
# (N, Lq, M, L P, 2): the rank Core ML takes.
LEVELS_AS_SAMPLES = "ms_deform_attn-equal-per-level"
OPS = [LEVELS_AS_SAMPLES if op == "ms_deform_attn" else op for op in test_runtimes.OPS]


def equal_points_case(shape):
    """The "ms_deform_attn" case of test_runtimes at `shape`, its (L, P) axes of locations and
    weights as one axis of samples with P points on each level."""
    model, (value, locations, weights) = test_runtimes.case("ms_deform_attn", shape)
    N, Lq, M, L, P, _ = locations.shape
    listed = MsDeformAttnOp([tuple(size) for size in model.spatial_shapes.tolist()],
                            dict(points_per_level=[P] * L))
    args = (value, locations.reshape(N, Lq, M, L * P, 2), weights.reshape(N, Lq, M, L * P))
    program = torch.export.export(listed, args)
    return listed, args, program.run_decompositions(deformconv.decompositions.table("gather"))


def converted(program):
    with warnings.catch_warnings():
        # coremltools warns that it was not tested with this torch release.
        warnings.simplefilter("ignore")
        return ct.convert(program, convert_to="mlprogram")


def mil_operations(model):
    functions = model._mil_program.functions.values()
    return collections.Counter(operation.op_type for function in functions
                               for operation in function.operations)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("op", OPS)
def test_core_ml_converts_the_gather_form(op, shape):
    if op == LEVELS_AS_SAMPLES:
        model, args, program = equal_points_case(shape)
    else:
        model, args, program = decomposed_case(op, shape, "gather")
    mlmodel = converted(program)
    description = mlmodel.get_spec().description
    assert [tuple(entry.type.multiArrayType.shape) for entry in description.input] == \
        [tuple(arg.shape) for arg in args]
    (output,) = description.output
    assert tuple(output.type.multiArrayType.shape) == tuple(model(*args).shape)
    # Each of the program's gathers (the corners of the bilinear samples, nearest's pixels)
    # is one of Core ML's, and nothing samples a grid.
    gathers = [node for node in program.graph.nodes if node.target == torch.ops.aten.gather.default]
    operations = mil_operations(mlmodel)
    assert operations["gather_along_axis"] == len(gathers) > 0, operations
    assert not [name for name in operations if "resample" in name], operations


def test_core_ml_has_no_conversion_for_grid_sample():
    _, _, program = decomposed_case("deform_conv2d", 0, "grid_sample")
    with pytest.raises(NotImplementedError, match="Unsupported fx node grid_sampler_2d"):
        converted(program)


def test_core_ml_refuses_the_rank_6_locations_of_the_levels_layout():
    _, _, program = decomposed_case("ms_deform_attn", 0, "gather")
    with pytest.raises(ValueError, match="Core ML only supports tensors with rank <= 5"):
        converted(program)


class LevelsHeld(torch.nn.Module):
    """Deformable DETR's MSDeformAttn over two levels of fixed sizes, held as buffers."""

    def __init__(self, points):
        super().__init__()
        torch.manual_seed(0)
        self.attention = deformconv.MSDeformAttn(d_model=32, n_levels=2, n_heads=4,
                                                 n_points=points)
        spatial_shapes, level_start_index, _ = levels_of([(6, 5), (3, 3)])
        self.register_buffer("spatial_shapes", spatial_shapes)
        self.register_buffer("level_start_index", level_start_index)

    def forward(self, query, reference_points, values):
        return self.attention(query, reference_points, values, self.spatial_shapes,
                              self.level_start_index)


def test_core_ml_converts_ms_deform_attn_with_its_points_per_level():
    """n_points=[2, 2] is n_points=2 in the op's rank-5 layout: the same state_dict and outputs,
    and Core ML converts it."""
    generator = torch.Generator().manual_seed(0)
    args = (torch.randn(1, 7, 32, generator=generator),
            torch.rand(1, 7, 2, 2, generator=generator),
            torch.randn(1, 39, 32, generator=generator))
    listed, levels = LevelsHeld([2, 2]).eval(), LevelsHeld(2).eval()
    torch.nn.init.normal_(listed.attention.sampling_offsets.weight, std=0.3)
    levels.load_state_dict(listed.state_dict())
    torch.testing.assert_close(listed(*args), levels(*args), rtol=1e-6, atol=1e-6)
    program = torch.export.export(listed, args)
    program = program.run_decompositions(deformconv.decompositions.table("gather"))
    (output,) = converted(program).get_spec().description.output
    assert tuple(output.type.multiArrayType.shape) == (1, 7, 32)
