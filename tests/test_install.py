"""What a built deformconv records about its build, and the import guard against a torch it cannot
run under."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import deformconv
from deformconv import _build_info
from deformconv.ops import _common
import setup_py

pytestmark = pytest.mark.workflows


def test_build_records_the_torch_it_was_compiled_against():
    assert _build_info.TORCH_VERSION == torch.__version__


def test_build_info_agrees_with_the_kernels_registered():
    if deformconv.cuda_compiled():
        assert _build_info.CPU_ONLY_REASON is None and _build_info.CUDA_ARCH_LIST
    else:
        assert _build_info.CPU_ONLY_REASON and not _build_info.CUDA_ARCH_LIST


def test_the_module_is_built_for_every_python_from_3_10():
    # CPython's limited API (setup.py's PYTHON_ABI): the suffix of an abi3 build, and no symbol
    # of the full API, whose names start with an underscore (_Py..., _PyObject...).
    module = Path(deformconv._C.__file__)
    assert module.name == "_C.abi3.so", module.name
    undefined = subprocess.run(["nm", "-D", "--undefined-only", str(module)], capture_output=True,
                               text=True, check=True).stdout.split()
    assert not [name for name in undefined if name.startswith("_Py")], undefined


def test_build_records_the_oldest_torch_it_runs_under():
    assert _build_info.MINIMUM_TORCH == (2, 12)


def test_import_under_an_older_torch_names_the_minimum(tmp_path):
    # A fresh interpreter that imports this same deformconv under a torch that reports an older
    # release: the import must stop before loading _C, naming both and the fix.
    package_parent = Path(deformconv.__file__).resolve().parent.parent
    code = "import torch; torch.__version__ = '2.11.0+cpu'; import deformconv"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                            text=True, env={**os.environ, "PYTHONPATH": str(package_parent)})
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line == (f"ImportError: deformconv {deformconv.__version__} needs torch 2.12 or "
                         "newer, but torch 2.11.0+cpu is installed. Upgrade it: pip install "
                         "'torch>=2.12'.")


class _Build:
    MINIMUM_TORCH = (2, 12)

    def __init__(self, cuda_arch_list):
        self.CUDA_ARCH_LIST = cuda_arch_list


@pytest.mark.parametrize("version,cuda,archs,stops", [
    ("2.12.1+cu130", "13.0", "9.0", None),
    ("2.13.0+cpu", None, "", None),
    ("2.14.1", "13.0", "", None),
    ("3.0.0", None, "", None),
    ("2.11.0", "12.8", "", "needs torch 2.12 or newer"),
    ("1.13.1", None, "", "needs torch 2.12 or newer"),
    ("2.13.0+cpu", None, "9.0", "holds CUDA kernels"),
], ids=["cuda-build-cuda-torch", "cpu-build-cpu-torch", "cpu-build-cuda-torch", "newer-major",
        "older-minor", "older-major", "cuda-build-cpu-torch"])
def test_which_torch_a_build_loads_under(version, cuda, archs, stops):
    mismatch = deformconv._torch_mismatch(version, cuda, _Build(archs))
    if stops is None:
        assert mismatch is None
    else:
        assert stops in mismatch and version in mismatch
        if archs:
            assert "DEFORMCONV_WITH_CUDA=0" in mismatch


@pytest.mark.parametrize("macros,message", [
    ("#define __GNUC__ 10", "is GCC 10; deformconv needs GCC 11 or newer"),
    ("#define __GNUC__ 4\n#define __clang__ 1\n#define __clang_major__ 13",
     "is clang 13; deformconv needs clang 14 or newer"),
], ids=["gcc-10", "clang-13"])
def test_build_stops_below_the_minimum_compiler(tmp_path, macros, message):
    # A stand-in compiler that predefines what an old one does: setup.py must stop before any
    # compiling, naming the compiler and the minimum.
    if not setup_py.PATH.is_file():
        pytest.skip("no setup.py beside the tests")
    compiler = tmp_path / "old-c++"
    compiler.write_text(f"#!/bin/sh\ncat <<'MACROS'\n{macros}\nMACROS\n")
    compiler.chmod(0o755)
    result = subprocess.run([sys.executable, str(setup_py.PATH), "build_ext", "--inplace"],
                            cwd=setup_py.PATH.parent, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "CXX": str(compiler),
                                 "DEFORMCONV_WITH_CUDA": "0"})
    assert result.returncode != 0
    assert f"deformconv build: {compiler} {message}" in result.stderr


def test_the_reason_for_missing_cuda_kernels_is_the_builds():
    reason = _common._cuda_kernels_missing_reason()
    if deformconv.cuda_compiled():
        assert reason is None
    else:
        assert reason == _build_info.CPU_ONLY_REASON


OPS_ON_CUDA = {
    "deform_conv2d": lambda: deformconv.deform_conv2d(
        torch.empty(1, 2, 5, 5, device="cuda"), torch.empty(1, 18, 3, 3, device="cuda"),
        torch.empty(4, 2, 3, 3, device="cuda")),
    "dcnv3": lambda: deformconv.dcnv3(
        torch.empty(1, 5, 5, 8, device="cuda"), torch.empty(1, 3, 3, 36, device="cuda"),
        torch.empty(1, 3, 3, 18, device="cuda"), 3, 3, 1, 1, 0, 0, 1, 1, 2, 4, 1.0),
    "dcnv4": lambda: deformconv.dcnv4(
        torch.empty(1, 5, 5, 8, device="cuda"), torch.empty(1, 3, 3, 56, device="cuda"),
        3, 3, 1, 1, 0, 0, 1, 1, 2, 4, 1.0),
    "ms_deform_attn": lambda: deformconv.ms_deform_attn(
        torch.empty(1, 4, 2, 4, device="cuda"), torch.tensor([[2, 2]], device="cuda"),
        torch.tensor([0], device="cuda"), torch.empty(1, 3, 2, 1, 1, 2, device="cuda"),
        torch.empty(1, 3, 2, 1, 1, device="cuda")),
}


@pytest.mark.parametrize("op", OPS_ON_CUDA)
def test_an_op_on_cuda_without_cuda_kernels_names_force_cuda(op, monkeypatch):
    # Fake CUDA tensors, which need no GPU, and a build that says it has no CUDA kernels.
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(_common, "_cuda_kernels_missing_reason",
                        lambda: "no GPU visible (FORCE_CUDA=1 builds the CUDA kernels without one)")
    with FakeTensorMode(), pytest.raises(RuntimeError) as error:
        OPS_ON_CUDA[op]()
    assert str(error.value) == (
        f"{op}(): this build of deformconv has no CUDA kernels (no GPU visible (FORCE_CUDA=1 "
        "builds the CUDA kernels without one)), so it cannot run on cuda:0. Reinstall it with "
        "FORCE_CUDA=1 set (pip install --no-build-isolation --force-reinstall --no-deps . from "
        "its source folder, with a CUDA toolkit and a CUDA build of torch); python -m deformconv "
        "info shows the build.")


def test_the_headers_copy_is_kept_while_the_headers_are_the_same(tmp_path):
    """setup.py compiles against a copy of torch's headers in the build folder, so that the same
    torch release installed elsewhere recompiles nothing: the copy is left as it is (its
    timestamps too) while the headers' contents are the same, and replaced, newer than before,
    when they differ."""
    if not setup_py.PATH.is_file():
        pytest.skip("no setup.py beside the tests")
    module = setup_py.load_setup_py()
    headers, copy = tmp_path / "torch" / "include", tmp_path / "build" / "torch-include"
    (headers / "c10").mkdir(parents=True)
    (headers / "c10" / "a.h").write_text("int a;\n")
    (headers / "b.h").write_text("int b;\n")
    module.keep_headers_copy(headers, copy)
    assert (copy / "c10" / "a.h").read_text() == "int a;\n"
    assert (copy / "b.h").read_text() == "int b;\n"
    past = 1_000_000_000
    os.utime(copy / "b.h", (past, past))
    # The same contents from another folder (the venv's torch after the build environment's).
    other = tmp_path / "venv" / "include"
    shutil.copytree(headers, other)
    module.keep_headers_copy(other, copy)
    assert (copy / "b.h").stat().st_mtime == past
    (other / "b.h").write_text("int b, c;\n")
    module.keep_headers_copy(other, copy)
    assert (copy / "b.h").read_text() == "int b, c;\n"
    assert (copy / "b.h").stat().st_mtime > past
    assert (copy / "c10" / "a.h").read_text() == "int a;\n"
