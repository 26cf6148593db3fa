"""deformconv.integrations.use_for: model files that import and build their core op as
InternImage's, FlashInternImage's and Deformable DETR's do (tests/original_style_models), each run in a fresh
interpreter that sees no GPU, no CUDA toolkit and neither original op package."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import deformconv
from deformconv import integrations

pytestmark = pytest.mark.workflows

MODELS = Path(__file__).resolve().parent / "original_style_models"

# Run first in each child: what it must not have.
WITHOUT_THE_ORIGINALS = """
import importlib.util, json, sys
import torch
assert not torch.cuda.is_available()
for name in ("DCNv3", "ops_dcnv3", "DCNv4", "MultiScaleDeformableAttention"):
    assert importlib.util.find_spec(name) is None, name + " is installed"
"""


def run_without_cuda(tmp_path, model_dir, code):
    """Runs code in a fresh interpreter with model_dir on its path, no GPU visible and no CUDA
    toolkit to find; returns the JSON it prints last."""
    package_parent = Path(deformconv.__file__).resolve().parent.parent
    path = os.pathsep.join(entry for entry in os.environ.get("PATH", "").split(os.pathsep)
                           if "cuda" not in entry.lower())
    env = {key: value for key, value in os.environ.items()
           if key not in ("CUDA_HOME", "CUDA_PATH")}
    env.update(PATH=path, CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join(
        [str(MODELS / model_dir), str(package_parent)]))
    result = subprocess.run([sys.executable, "-c", WITHOUT_THE_ORIGINALS + code], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_internimage_model_file_builds_deformconv_dcnv3(tmp_path):
    report = run_without_cuda(tmp_path, "internimage", """
try:
    import models.intern_image
except ModuleNotFoundError as error:
    before = error.name
import deformconv, deformconv.integrations
deformconv.integrations.use_for("internimage")
from models.intern_image import build
model = build("DCNv3")
images = torch.randn(2, 3, 32, 32)
logits = model(images)
logits.square().sum().backward()
pure = build("DCNv3_pytorch")
pure.load_state_dict(model.state_dict(), strict=True)
from ops_dcnv3.functions import DCNv3Function, dcnv3_core_pytorch
x, offset = torch.randn(1, 5, 5, 8), torch.randn(1, 5, 5, 2 * 2 * 9)
mask = torch.rand(1, 5, 5, 2 * 9)
arguments = (3, 3, 1, 1, 1, 1, 1, 1, 2, 4, 1.0)
print(json.dumps({
    "before": before,
    "core_ops": sorted({type(m).__module__ + "." + type(m).__name__ for m in model.levels}),
    "pure_core_ops": sorted({type(m).__name__ for m in pure.levels}),
    "logits": list(logits.shape),
    "gradients": all(p.grad is not None for p in model.levels.parameters()),
    "same_keys": sorted(pure.state_dict()) == sorted(model.state_dict()),
    "same_logits": bool(torch.equal(pure(images), model(images))),
    "function": bool(torch.equal(DCNv3Function.apply(x, offset, mask, *arguments, 64, False),
                                 deformconv.dcnv3(x, offset, mask, *arguments))),
    "core": bool(torch.equal(dcnv3_core_pytorch(x, offset, mask, *arguments),
                             deformconv.dcnv3(x, offset, mask, *arguments))),
}))
""")
    # Without the stand-in the model file cannot even be imported, as the issue found.
    assert report["before"] == "ops_dcnv3"
    assert report["core_ops"] == ["deformconv.nn.dcnv3.DCNv3"]
    assert report["pure_core_ops"] == ["DCNv3"]
    assert report["logits"] == [2, 10]
    assert report["gradients"]
    assert report["same_keys"] and report["same_logits"]
    assert report["function"] and report["core"]


def test_flash_internimage_model_file_builds_deformconv_dcnv4(tmp_path):
    report = run_without_cuda(tmp_path, "flash_internimage", """
try:
    import models.flash_intern_image
except ModuleNotFoundError as error:
    before = error.name
import deformconv, deformconv.integrations
deformconv.integrations.use_for("flash_internimage")
from models.flash_intern_image import build
import DCNv4
model = build()
logits = model(torch.randn(2, 3, 32, 32))
logits.square().sum().backward()
x, offset_mask = torch.randn(1, 5, 5, 8), torch.randn(1, 5, 5, 56)
arguments = (3, 3, 1, 1, 1, 1, 1, 1, 2, 4, 1.0)
# A detector's use of the flash deformable attention: the module, and the function on packed
# locations and logits (2 levels, K = 3 points), against the op on softmax-ed weights.
from DCNv4 import FlashDeformAttn, FlashDeformAttnFunction
shapes, starts = torch.tensor([[4, 4], [2, 2]]), torch.tensor([0, 16])
attention_module = FlashDeformAttn(d_model=32, n_levels=2, n_heads=4, n_points=3)
query, inputs = torch.randn(2, 6, 32, requires_grad=True), torch.randn(2, 20, 32)
attended = attention_module(query, torch.rand(2, 6, 2, 2), inputs, shapes, starts)
attended.sum().backward()
value, packed = torch.randn(2, 20, 4, 8), torch.rand(2, 6, 4, 2 * 3 * 3)
locations = packed[..., :12].reshape(2, 6, 4, 2, 3, 2)
weights = packed[..., 12:].softmax(-1).reshape(2, 6, 4, 2, 3)
attention = {
    "type": type(attention_module).__module__ + "." + type(attention_module).__name__,
    "output": list(attended.shape),
    "query_gradient": query.grad is not None,
    "function": torch.allclose(FlashDeformAttnFunction.apply(value, shapes, starts, packed, 64, 3),
                               deformconv.ms_deform_attn(value, shapes, starts, locations,
                                                         weights)),
}
print(json.dumps({
    "before": before,
    "core_ops": sorted({type(m).__module__ + "." + type(m).__name__ for m in model.levels}),
    "found_by_isinstance": sum(isinstance(m, DCNv4.DCNv4) for m in model.modules()),
    "logits": list(logits.shape),
    "gradients": all(p.grad is not None for p in model.levels.parameters()),
    "function": bool(torch.equal(DCNv4.DCNv4Function.apply(x, offset_mask, *arguments, 64,
                                                           False),
                                 deformconv.dcnv4(x, offset_mask, *arguments))),
    "submodules": DCNv4.modules.DCNv4 is DCNv4.DCNv4
                  and DCNv4.functions.DCNv4Function is DCNv4.DCNv4Function
                  and DCNv4.modules.FlashDeformAttn is DCNv4.FlashDeformAttn
                  and DCNv4.functions.FlashDeformAttnFunction is DCNv4.FlashDeformAttnFunction,
    "attention": attention,
}))
""")
    assert report["before"] == "DCNv4"
    assert report["core_ops"] == ["deformconv.nn.dcnv3.DCNv4"]
    assert report["found_by_isinstance"] == 2
    assert report["logits"] == [2, 10]
    assert report["gradients"]
    assert report["function"] and report["submodules"]
    assert report["attention"] == {"type": "deformconv.nn.ms_deform_attn.FlashDeformAttn",
                                   "output": [2, 6, 32], "query_gradient": True,
                                   "function": True}


def test_deformable_detr_ops_run_on_deformconv(tmp_path):
    report = run_without_cuda(tmp_path, "deformable_detr", """
try:
    import models.ops.modules
except ModuleNotFoundError as error:
    before = error.name
import deformconv, deformconv.integrations
deformconv.integrations.use_for("deformable_detr")
from models.ops.modules import MSDeformAttn
from models.ops.functions import MSDeformAttnFunction
torch.manual_seed(0)
original = MSDeformAttn(d_model=32, n_levels=3, n_heads=4, n_points=2)
ours = deformconv.MSDeformAttn(d_model=32, n_levels=3, n_heads=4, n_points=2)
ours.load_state_dict(original.state_dict(), strict=True)
shapes = torch.tensor([[6, 5], [3, 3], [1, 2]])
starts = torch.tensor([0, 30, 39])
query, values = torch.randn(2, 7, 32), torch.randn(2, 41, 32)
reference = torch.rand(2, 7, 3, 2)
padding = torch.rand(2, 41) < 0.2
out = original(query, reference, values, shapes, starts, padding)
expected = ours(query, reference, values, shapes, starts, padding)
out.square().sum().backward()
expected.square().sum().backward()
value = torch.randn(1, 41, 2, 3, dtype=torch.float64, requires_grad=True)
locations = (torch.rand(1, 4, 2, 3, 2, 2, dtype=torch.float64) * 1.4 - 0.2).requires_grad_()
weights = torch.randn(1, 4, 2, 3, 2, dtype=torch.float64, requires_grad=True)
print(json.dumps({
    "before": before,
    # Within rounding: ours normalises the logits inside the op, the original's module by
    # F.softmax before it.
    "same_output": torch.allclose(out, expected, rtol=1e-5, atol=1e-6),
    "same_gradients": all(torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-5) for a, b in
                          zip(original.parameters(), ours.parameters())),
    "gradcheck": torch.autograd.gradcheck(
        lambda v, l, w: MSDeformAttnFunction.apply(v, shapes, starts, l, w, 64),
        (value, locations, weights)),
}))
""")
    assert report["before"] == "MultiScaleDeformableAttention"
    assert report["same_output"] and report["same_gradients"]
    assert report["gradcheck"]


def test_unknown_codebase_is_refused(monkeypatch):
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    with pytest.raises(ValueError, match="'deformable_detr', 'transformers', got 'mmdet'"):
        integrations.use_for("mmdet")
    assert "ops_dcnv3" not in sys.modules and "DCNv4" not in sys.modules


def test_stand_ins_replace_what_was_there(monkeypatch):
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    sys.modules["ops_dcnv3"] = object()  # an original that failed half-way, say
    integrations.use_for("internimage")
    from ops_dcnv3 import modules as opsm

    assert opsm.DCNv3 is deformconv.DCNv3 and opsm.DCNv3_pytorch is deformconv.DCNv3
