"""What a built deformconv records about its build, and the import guard against a torch it was
not compiled for."""

import os
import subprocess
import sys
from pathlib import Path

import torch

import deformconv
from deformconv import _build_info


def test_build_records_the_torch_it_was_compiled_against():
    assert _build_info.TORCH_VERSION == torch.__version__


def test_build_info_agrees_with_the_kernels_registered():
    if deformconv.cuda_compiled():
        assert _build_info.CPU_ONLY_REASON is None and _build_info.CUDA_ARCH_LIST
    else:
        assert _build_info.CPU_ONLY_REASON and not _build_info.CUDA_ARCH_LIST


def test_import_under_another_torch_names_both_versions(tmp_path):
    # A fresh interpreter that imports this same deformconv under a torch that reports another
    # version: the import must stop before loading _C, with both versions and the fix.
    package_parent = Path(deformconv.__file__).resolve().parent.parent
    code = "import torch; torch.__version__ = '0.0.1+elsewhere'; import deformconv"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                            text=True, env={**os.environ, "PYTHONPATH": str(package_parent)})
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("ImportError: deformconv")
    assert f"compiled against torch {torch.__version__}" in last_line
    assert "torch 0.0.1+elsewhere is installed" in last_line
    assert "pip install --no-build-isolation" in last_line
