"""The originals' own CUDA ops as contenders, where tools/originals.py built them (their code
stays outside deformconv): InternImage's DCNv3 beside dcnv3, DCNv4's DCNv4 beside dcnv4, and
Deformable DETR's MultiScaleDeformableAttention beside ms_deform_attn. Each is called as its
own Python code calls it: DCNv4's and Deformable DETR's through their own autograd functions,
InternImage's through the two calls its function makes (its module reads its own installed
version through pkg_resources, which a build outside pip does not have). One that did not build,
does not import, or fails on the operands (a dtype its kernels lack) is left out with the
reason, as torchvision's op is in bfloat16."""

import importlib
import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Callable, Dict, Tuple

import torch

# Each original by its name in tools/originals.py: the name the reports give it, and which of
# deformconv's ops it is timed against.
ORIGINALS = {"internimage_dcnv3": ("InternImage DCNv3", "dcnv3"),
             "dcnv4": ("DCNv4's DCNv4", "dcnv4"),
             "deformable_detr": ("Deformable DETR's MSDA", "ms_deform_attn")}
PEERS = dict(ORIGINALS.values())

# The im2col_step that the originals' modules pass: InternImage's and FlashInternImage's 256,
# Deformable DETR's 64.
DCNV3_IM2COL_STEP = 256
MSDA_IM2COL_STEP = 64


def _extension(module_name: str, library: str):
    spec = importlib.util.spec_from_file_location(module_name, library)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def _source_module(module_name: str, path: Path):
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _InternImageDcnv3(torch.autograd.Function):
    """InternImage's DCNv3Function, its two calls: ext.dcnv3_forward(input, offset, mask,
    *geometry, im2col_step, remove_center) and ext.dcnv3_backward(input, offset, mask, *geometry,
    grad_output, im2col_step, remove_center), geometry being (kh, kw, sh, sw, ph, pw, dh, dw,
    group, group_channels, offset_scale)."""

    @staticmethod
    def forward(ctx, ext, input, offset, mask, geometry):
        ctx.ext, ctx.geometry = ext, geometry
        ctx.save_for_backward(input, offset, mask)
        return ext.dcnv3_forward(input, offset, mask, *geometry, DCNV3_IM2COL_STEP, False)

    @staticmethod
    def backward(ctx, grad_output):
        input, offset, mask = ctx.saved_tensors
        grads = ctx.ext.dcnv3_backward(input, offset, mask, *ctx.geometry,
                                       grad_output.contiguous(), DCNV3_IM2COL_STEP, False)
        return (None, *grads, None)


def _load(name: str, status: dict):
    """The original `name`'s callable, from its built library and its sources."""
    source = Path(status["source"])
    if name == "internimage_dcnv3":
        ext = _extension("DCNv3", status["library"])
        return lambda input, offset, mask, *geometry: _InternImageDcnv3.apply(
            ext, input, offset, mask, tuple(geometry))
    if name == "dcnv4":
        # Its package, with the built library as DCNv4.ext, without its __init__ (which also
        # imports its nn.Modules).
        package = types.ModuleType("DCNv4")
        package.__path__ = [str(source / "DCNv4")]
        sys.modules["DCNv4"] = package
        package.ext = _extension("DCNv4.ext", status["library"])
        function = importlib.import_module("DCNv4.functions.dcnv4_func").DCNv4Function
        return lambda input, offset_mask, *geometry: function.apply(
            input, offset_mask, *geometry, DCNV3_IM2COL_STEP, False)
    if name == "deformable_detr":
        _extension("MultiScaleDeformableAttention", status["library"])
        function = _source_module("deformable_detr_ms_deform_attn_func",
                                  source / "functions" / "ms_deform_attn_func.py")
        return lambda *operands: function.MSDeformAttnFunction.apply(*operands, MSDA_IM2COL_STEP)
    raise ValueError(f"no original named {name}")


def load_originals(directory: str
                   ) -> Tuple[Dict[str, Callable], Dict[str, str], Dict[str, str]]:
    """The originals that built into `directory` (tools/originals.py build), by their report
    names; why each other one is missing; and the repository and commit each loaded one was
    built from."""
    statuses = json.loads((Path(directory) / "status.json").read_text())
    loaded, missing, commits = {}, {}, {}
    for name, status in statuses.items():
        report_name = ORIGINALS[name][0]
        if not status["built"]:
            missing[report_name] = "did not build: " + status["why"].splitlines()[-1]
            continue
        try:
            loaded[report_name] = _load(name, status)
        except Exception as error:  # their import, not ours: say why and go on
            missing[report_name] = f"did not import: {type(error).__name__}: {error}"
            continue
        commits[report_name] = status["commit"]
    return loaded, missing, commits


def original_contenders(originals: Dict[str, Callable], runs: Dict[str, tuple],
                        dcnv3_geometry: tuple = ()) -> Tuple[Dict[str, tuple], Dict[str, str]]:
    """Each loaded original whose peer is among runs ({name: (run, inputs)}), with its peer's
    inputs (and, beside dcnv3 and dcnv4, their geometry: kh, kw, sh, sw, ph, pw, dh, dw, group,
    group_channels, offset_scale), and why each that fails on them was left out."""
    added, failed = {}, {}
    for name, run in originals.items():
        peer = PEERS[name]
        if peer not in runs:
            continue
        inputs = runs[peer][1]
        if peer != "ms_deform_attn":
            run = (lambda original: lambda *operands: original(*operands, *dcnv3_geometry))(run)
        try:
            with torch.no_grad():
                run(*inputs)
        except Exception as error:  # a dtype or a shape its kernels lack
            failed[name] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
            print(f"  {name}: not run: {failed[name]}")
            continue
        added[name] = (run, inputs)
    return added, failed
