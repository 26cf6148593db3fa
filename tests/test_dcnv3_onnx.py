"""ONNX export of DCNv3 and DCNv4: the standard-operator forms (deformconv.decompositions')
against the ops over the geometry grid, and the modules and ops
exported by both exporters and run by onnxruntime against PyTorch."""

import pytest
import torch

import deformconv
import deformconv.onnx
from dcnv3_reference import GEOMETRIES, pack_offset_mask, random_operands

pytestmark = pytest.mark.workflows


# torch.export's exporter, and the legacy TorchScript one, which torch deprecates when asked
# for it (dynamo=False): that warning is torch's answer to the request.
EXPORTERS = [pytest.param(True, id="dynamo"),
             pytest.param(False, id="torchscript", marks=pytest.mark.filterwarnings(
                 "ignore:You are using the legacy TorchScript-based ONNX export"))]


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("scale,remove_center", [(1.0, False), (0.5, True), (2.0, False)])
def test_standard_operator_form_matches_the_ops(geometry, scale, remove_center):
    (kh, kw), (sh, sw), (ph, pw), (dh, dw), G, D = geometry
    if remove_center and kh * kw == 1:
        pytest.skip("remove_center needs more than one point")
    # spread 3: many points far outside the image.
    input, offset, mask = random_operands(2, 5, 6, geometry, remove_center, spread=3.0)
    scalars = (kh, kw, sh, sw, ph, pw, dh, dw, G, D, scale)
    expected = deformconv.dcnv3(input, offset, mask, *scalars, 0, remove_center)
    torch.testing.assert_close(
        deformconv.decompositions.dcnv3(input, offset, mask, *scalars, 0, remove_center),
        expected, rtol=1e-11, atol=1e-11)
    offset_mask = pack_offset_mask(offset, mask, G)  # NaN padding
    torch.testing.assert_close(
        deformconv.decompositions.dcnv4(input, offset_mask, *scalars, 0, remove_center),
        expected, rtol=1e-11, atol=1e-11)


class DCNv4OnImage(torch.nn.Module):
    """DCNv4 with its non-square shape given, as FlashInternImage calls it."""

    def __init__(self, shape, **kwargs):
        super().__init__()
        self.shape = shape
        self.dcn = deformconv.DCNv4(**kwargs)

    def forward(self, x):
        return self.dcn(x, self.shape)


class Dcnv4Op(torch.nn.Module):
    """The functional op at a geometry the modules cannot have: stride 2, unequal padding,
    a non-square kernel with dilation, remove_center."""

    def forward(self, input, offset_mask):
        return deformconv.dcnv4(input, offset_mask, 2, 3, 2, 1, 1, 2, 2, 1, 1, 2, 0.5, 0, True)


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
