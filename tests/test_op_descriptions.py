"""The compile-time checks of the ops' descriptions (Note [Op descriptions],
csrc/infrastructure/op_description.h): the descriptions as they are pass, and each check fails,
with its message, on a copy of csrc/ with one schema, one gradient place or one driver broken.
Syntax-only compiles against torch's headers, under a second each."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths

ROOT = Path(__file__).resolve().parents[1]
COMPILER = os.environ.get("CXX", "g++")

# A check of the build, as test_sources.py: with the workflows, not the kernels' tests.
pytestmark = [pytest.mark.workflows,
              pytest.mark.skipif(shutil.which(COMPILER) is None, reason=f"no {COMPILER}")]

DESCRIPTIONS = """
#include "csrc/core/dcnv3.h"
#include "csrc/core/deform_conv2d.h"
#include "csrc/core/ms_deform_attn.h"
#include "csrc/infrastructure/op_description.h"
using namespace deformconv;
static_assert(DescriptionChecks<DeformConv2dOp>::kChecked);
static_assert(DescriptionChecks<Dcnv3Op>::kChecked);
static_assert(DescriptionChecks<Dcnv4Op>::kChecked);
static_assert(DescriptionChecks<MsDeformAttnOp>::kChecked);
"""

# A registration of dcnv4's kernels with the forward driver DRIVER.
REGISTRATION = """
#include "csrc/core/dcnv3.h"
#include "csrc/infrastructure/device_kernels.h"
namespace deformconv {
Tensor swapped_forward(const Dcnv3Launchers&, const Tensor&, const Tensor&, int64_t, int64_t,
                       int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                       int64_t, double, bool);
const Dcnv3Launchers& table();
void registration(torch::stable::detail::StableLibrary& m) {
  register_device_kernels<Dcnv4Op, CpuDevice, DRIVER, dcnv4_backward, table>(m);
}
}  // namespace deformconv
"""


def compile_source(tmp_path, source, edit=None, defines=()):
    """Syntax-checks source against a copy of csrc/ with edit = (file, old, new) applied."""
    shutil.copytree(ROOT / "csrc", tmp_path / "csrc")
    if edit is not None:
        path, old, new = edit
        text = (tmp_path / path).read_text()
        assert old in text, f"{path} no longer holds {old!r}"
        (tmp_path / path).write_text(text.replace(old, new, 1))
    (tmp_path / "check.cpp").write_text(source)
    return subprocess.run(
        [COMPILER, "-std=c++20", "-fsyntax-only", *(f"-I{p}" for p in include_paths()),
         *(f"-D{d}" for d in defines), "check.cpp"],
        cwd=tmp_path, capture_output=True, text=True)


def test_the_descriptions_pass(tmp_path):
    result = compile_source(tmp_path, DESCRIPTIONS)
    assert result.returncode == 0, result.stderr


BROKEN = {
    "backward arguments out of order": (
        ("csrc/core/deform_conv2d.h", "Tensor? mask, SymInt[2] stride, SymInt[2] padding",
         "Tensor? mask, SymInt[2] padding, SymInt[2] stride"),
        "kBackwardSchema's arguments after grad_output are not among kSchema's"),
    "an argument renamed in one schema": (
        ("csrc/core/dcnv3.h", "int im2col_step, bool remove_center) -> Tensor\";\n"
         "  // Gradients of (input, offset_mask)",
         "int im2col_step, bool remove_centre) -> Tensor\";\n"
         "  // Gradients of (input, offset_mask)"),
        "kBackwardSchema's arguments after grad_output are not among kSchema's"),
    "an output_mask of the wrong length": (
        ("csrc/core/dcnv3.h", "bool[3] output_mask", "bool[2] output_mask"),
        "kBackwardSchema's output_mask is not bool[N]"),
    "a gradient at a non-tensor": (
        ("csrc/core/ms_deform_attn.h", "kGradientArguments = {0, 3, 4}",
         "kGradientArguments = {0, 3, 5}"),
        "kGradientArguments are not places of kSchema's tensors"),
    "a checks schema out of order": (
        ("csrc/core/ms_deform_attn.h",
         "int im2col_step, int[] points_per_level, str sampling, bool softmax) -> int[]",
         "int im2col_step, str sampling, int[] points_per_level, bool softmax) -> int[]"),
        "kChecksSchema is not _check_<kName>_arguments"),
    "a backward schema of another op": (
        ("csrc/core/ms_deform_attn.h", '"ms_deform_attn_backward(', '"ms_deform_attn_grad('),
        "kBackwardSchema is not that of the op kName followed by _backward"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_broken_description_does_not_compile(tmp_path, case):
    edit, message = BROKEN[case]
    result = compile_source(tmp_path, DESCRIPTIONS, edit)
    assert result.returncode != 0
    assert message in result.stderr


def test_a_driver_must_take_the_schema_s_types_in_order(tmp_path):
    assert compile_source(tmp_path / "real", REGISTRATION,
                          defines=["DRIVER=dcnv4_forward"]).returncode == 0
    result = compile_source(tmp_path / "swapped", REGISTRATION,
                            defines=["DRIVER=swapped_forward"])
    assert result.returncode != 0
    assert "the forward driver does not take the launcher table" in result.stderr
