"""ONNX export of DCNv3 and DCNv4: the standard-operator forms (deformconv.decompositions')
against the ops over the geometry grid, and the modules and ops
exported by both exporters and run by onnxruntime against PyTorch."""

import pytest
import torch

import deformconv
import deformconv.onnx
from dcnv3_reference import GEOMETRIES, pack_offset_mask, random_operands
from export_models import EXPORTERS, Dcnv4Op

pytestmark = pytest.mark.workflows


@pytest.mark.parametrize("sampling_form", deformconv.decompositions.SAMPLING_FORMS)
@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("scale,remove_center", [(1.0, False), (0.5, True), (2.0, False)])
def test_standard_operator_form_matches_the_ops(geometry, scale, remove_center, sampling_form):
    (kh, kw), (sh, sw), (ph, pw), (dh, dw), G, D = geometry
    if remove_center and kh * kw == 1:
        pytest.skip("remove_center needs more than one point")
    # spread 3: many points far outside the image.
    input, offset, mask = random_operands(2, 5, 6, geometry, remove_center, spread=3.0)
    scalars = (kh, kw, sh, sw, ph, pw, dh, dw, G, D, scale)
    expected = deformconv.dcnv3(input, offset, mask, *scalars, 0, remove_center)
    torch.testing.assert_close(
        deformconv.decompositions.dcnv3(input, offset, mask, *scalars, 0, remove_center,
                                        sampling_form=sampling_form),
        expected, rtol=1e-11, atol=1e-11)
    offset_mask = pack_offset_mask(offset, mask, G)  # NaN padding
    torch.testing.assert_close(
        deformconv.decompositions.dcnv4(input, offset_mask, *scalars, 0, remove_center,
                                        sampling_form=sampling_form),
        expected, rtol=1e-11, atol=1e-11)


class DCNv4OnImage(torch.nn.Module):
    """DCNv4 with its non-square shape given, as FlashInternImage calls it."""

    def __init__(self, shape, **kwargs):
        super().__init__()
        self.shape = shape
        self.dcn = deformconv.DCNv4(**kwargs)

    def forward(self, x):
        return self.dcn(x, self.shape)


def onnx_cases():
    torch.manual_seed(0)
    input, offset, mask = random_operands(2, 5, 6, GEOMETRIES[2], True, dtype=torch.float32)
    return [
        (deformconv.DCNv3(32, group=4, center_feature_scale=True, offset_scale=0.5),
         (torch.randn(2, 5, 6, 32),)),
        (DCNv4OnImage((5, 6), channels=32, group=2, dw_kernel_size=3,
                      center_feature_scale=True), (torch.randn(2, 30, 32),)),
        (Dcnv4Op(), (input, pack_offset_mask(offset, mask, 1, padding_value=0.0))),
    ]


@pytest.mark.parametrize("dynamo", EXPORTERS)
@pytest.mark.parametrize("case", range(3), ids=["DCNv3", "DCNv4", "dcnv4-op"])
def test_export_runs_in_onnxruntime(tmp_path, dynamo, case):
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    model, args = onnx_cases()[case]
    # Random offsets and mask, so that the sampling is exercised away from the initial zeros.
    torch.manual_seed(1)
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    model.eval()
    path = tmp_path / "model.onnx"
    deformconv.onnx.export_onnx(model, args, str(path), dynamo=dynamo)

    proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    assert all(node.domain == "" for node in proto.graph.node)
    assert any(node.op_type == "GridSample" for node in proto.graph.node)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)}
    from_ort = torch.from_numpy(session.run(None, feeds)[0])
    expected = model(*args).detach()
    assert expected.abs().max() > 1
    torch.testing.assert_close(from_ort, expected, rtol=1e-5,
                               atol=1e-5 * expected.abs().max().item())
