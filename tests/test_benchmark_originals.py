"""The benchmark's originals (deformconv/benchmarks/originals.py, tools/originals.py) without a
GPU: their status file read into contenders and reasons, stand-ins timed beside their peers
with the ratios and agreement a GPU run reports, one that fails on the operands left out with
its reason, and the one edit their sources get."""

import importlib.util
import json
from argparse import Namespace
from pathlib import Path

import pytest

import deformconv
from deformconv.__main__ import main
from deformconv.benchmarks.originals import load_originals
from deformconv.benchmarks.run import benchmark_shape
from deformconv.benchmarks.shapes import SHAPES

pytestmark = pytest.mark.workflows

ROOT = Path(__file__).resolve().parent.parent


def tools_originals():
    spec = importlib.util.spec_from_file_location("tools_originals",
                                                  ROOT / "tools" / "originals.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_status_file_gives_the_reason_of_each_missing_original(tmp_path):
    (tmp_path / "status.json").write_text(json.dumps({
        "internimage_dcnv3": {"built": False, "why": "nvcc: long log\nerror: no conversion"},
        "deformable_detr": {"built": True, "library": str(tmp_path / "absent.so"),
                            "source": str(tmp_path)},
        "dcnv4": {"built": False, "why": "not copied into originals/src"},
    }))
    loaded, missing, commits = load_originals(str(tmp_path))
    assert loaded == {} and commits == {}
    assert missing["InternImage DCNv3"] == "did not build: error: no conversion"
    assert missing["DCNv4's DCNv4"] == "did not build: not copied into originals/src"
    assert missing["Deformable DETR's MSDA"].startswith("did not import: ")


def test_originals_are_timed_beside_their_peers(capsys):
    """Stand-ins with the originals' signatures: InternImage's DCNv3 as deformconv's dcnv3 (the
    same output, so the agreement is 0), DCNv4's failing on the operands as a kernel without
    the dtype would."""
    def internimage_dcnv3(input, offset, mask, *geometry):
        return deformconv.dcnv3(input, offset, mask, *geometry)

    def dcnv4_without_the_dtype(input, offset_mask, *geometry):
        raise RuntimeError('"dcnv4_forward" not implemented for \'Float\'\nmore detail')

    args = Namespace(dtype="float32", device="cpu", repeats=1, warmup=0,
                     loaded_originals={"InternImage DCNv3": internimage_dcnv3,
                                       "DCNv4's DCNv4": dcnv4_without_the_dtype})
    result = benchmark_shape(SHAPES["fit-stage4"], args)
    for phase in ("forward", "forward+backward"):
        ratio = result["ratios"][f"InternImage DCNv3/dcnv3 {phase}"]
        medians = result["median_seconds"]
        assert ratio == medians[f"InternImage DCNv3 {phase}"] / medians[f"dcnv3 {phase}"]
        assert f"DCNv4's DCNv4/dcnv4 {phase}" not in result["ratios"]
    assert result["agreement"]["InternImage DCNv3 max abs difference"] == 0
    assert result["originals_not_run"] == {
        "DCNv4's DCNv4": "RuntimeError: \"dcnv4_forward\" not implemented for 'Float'"}
    assert "DCNv4's DCNv4: not run" in capsys.readouterr().out


def test_originals_need_the_gpu(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["benchmark", "--originals", "originals/build"])
    assert exit_info.value.code == 2
    assert "--originals: the originals' ops are CUDA ops" in capsys.readouterr().err


def test_sources_dispatch_on_scalar_type(tmp_path):
    source = tmp_path / "cuda" / "op.cu"
    source.parent.mkdir()
    source.write_text('AT_ASSERTM(value.type().is_cuda(), "value must be CUDA");\n'
                      'AT_DISPATCH_FLOATING_TYPES(value.type(), "forward", ([&] {\n'
                      'AT_DISPATCH_FLOATING_TYPES_AND_HALF(\n    input.type(), "backward", x);\n')
    assert tools_originals().dispatch_on_scalar_type(tmp_path) == 2
    assert source.read_text() == (
        'AT_ASSERTM(value.type().is_cuda(), "value must be CUDA");\n'
        'AT_DISPATCH_FLOATING_TYPES(value.scalar_type(), "forward", ([&] {\n'
        'AT_DISPATCH_FLOATING_TYPES_AND_HALF(\n    input.scalar_type(), "backward", x);\n')


def test_report_tables_the_originals_against_ours(tmp_path):
    # One DCNv3 shape where InternImage's DCNv3 ran and DCNv4's did not: one row.
    result = {"shape": {"name": "fit-stage2-batch64"},
              "ratios": {"InternImage DCNv3/dcnv3 forward": 1.5,
                         "InternImage DCNv3/dcnv3 forward+backward": 2.25,
                         "grid_sample formulation/dcnv3 forward": 11.0},
              "agreement": {"InternImage DCNv3 max abs difference": 2e-6}}
    source = tmp_path / "run.json"
    source.write_text(json.dumps({"setup": {}, "results": [result]}))
    document = tmp_path / "performance.md"
    document.write_text(f"<!-- table: {source.name} originals -->\n<!-- end table -->\n")
    assert main(["benchmark", "--report", str(document)]) == 0
    rows = document.read_text().splitlines()[1:-1]
    assert rows[2:] == ["| fit-stage2-batch64 | InternImage DCNv3 | dcnv3 | 1.50× | 2.25× | "
                        "2.0e-06 |"]
