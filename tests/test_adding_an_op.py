"""docs/design.md's "Adding an op", kept true: every op of torch.ops.deformconv (a forward with
its <op>_backward) has each thing that the section lists in a shared file or suite: its
decomposition in deformconv.decompositions.table(), in both sampling forms; its kernels
registered with its CUDA launchers in the emulated build (tests/cuda_emulation/emulated_ops.cpp);
its tests in .ci/run's each_op_tests, which the wheel and torches stages run; and its case in
the suites that run every op: op_cases.py (autograd registrations, torch.func, DTensor),
test_runtimes.py (the inference runtimes, and Core ML through test_coreml.py's list),
test_cpu_copies.py (every copy of the CPU kernels) and test_install.py (the refusal on CUDA
without CUDA kernels)."""

import re
from pathlib import Path

import pytest
import torch

import deformconv
import op_cases
import test_cpu_copies
import test_install
import test_runtimes

# A check of the repository, as test_sources.py: with the workflows, not the kernels' tests.
pytestmark = pytest.mark.workflows

ROOT = Path(__file__).resolve().parent.parent


def deformconv_ops():
    """The ops that have a backward op: the public ones (the others are checks and controls)."""
    names = {name.split("::", 1)[1] for name in torch._C._dispatch_get_all_op_names()
             if name.startswith("deformconv::")}
    return sorted(name for name in names if f"{name}_backward" in names)


OPS = deformconv_ops()


def test_the_ops_are_found():
    assert "deform_conv2d" in OPS and "ms_deform_attn" in OPS, OPS


@pytest.mark.parametrize("sampling_form", deformconv.decompositions.SAMPLING_FORMS)
@pytest.mark.parametrize("op", OPS)
def test_each_op_has_its_decomposition(op, sampling_form):
    assert getattr(torch.ops.deformconv, op).default in deformconv.decompositions.table(
        sampling_form)


@pytest.mark.parametrize("op", OPS)
def test_each_op_is_registered_in_the_emulated_build(op):
    source = (ROOT / "tests" / "cuda_emulation" / "emulated_ops.cpp").read_text()
    registration = re.compile(rf"register_device_kernels<(\w+), CudaDevice, {op}_forward,"
                              rf"\s*{op}_backward,")
    (description,) = registration.findall(source)
    assert f"m.def({description}::kSchema);" in source
    assert f"m.def({description}::kBackwardSchema);" in source


def each_op_tests():
    script = (ROOT / ".ci" / "run").read_text()
    body = re.search(r"^each_op_tests\(\) \{\n(.*?)^\}", script, re.S | re.M)
    assert body, "no each_op_tests() in .ci/run"
    return re.findall(r"tests/(test_\w+\.py)", body.group(1))


@pytest.mark.parametrize("op", OPS)
def test_each_op_tests_runs_the_op_s_suite(op):
    assert f"test_{op}.py" in each_op_tests()
    assert (ROOT / "tests" / f"test_{op}.py").is_file()


@pytest.mark.parametrize("op", OPS)
def test_the_suites_of_every_op_have_its_case(op):
    assert op in op_cases.CASES and op in op_cases.GRADIENTS
    assert op in test_runtimes.OPS
    assert op in test_install.OPS_ON_CUDA
    assert op in test_cpu_copies.every_op(torch.float64)
