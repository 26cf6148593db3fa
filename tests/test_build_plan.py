"""setup.py's choice of CUDA kernels and their architectures, with the torch, the toolkit and the
GPUs stood in for: built as torchvision and mmcv build theirs (a visible GPU, or FORCE_CUDA=1),
the newest derived architecture also as PTX, and each refusal naming the variable that changes
it."""

from pathlib import Path
from types import SimpleNamespace

import pytest

import setup_py

if not setup_py.PATH.is_file():
    pytest.skip("no setup.py beside the tests", allow_module_level=True)

pytestmark = pytest.mark.workflows

SWITCHES = ("DEFORMCONV_WITH_CUDA", "FORCE_CUDA", "TORCH_CUDA_ARCH_LIST", "CUDA_HOME",
            "CUDA_PATH")


@pytest.fixture
def setup_module(monkeypatch):
    module = setup_py.load_setup_py()
    for variable in SWITCHES:
        monkeypatch.delenv(variable, raising=False)
    # A CUDA 13.0 toolkit that compiles sm_75 to sm_120.
    monkeypatch.setattr(module, "find_cuda_home", lambda notes: Path("/opt/cuda"))
    monkeypatch.setattr(module, "nvcc_release", lambda cuda_home: (13, 0))
    monkeypatch.setattr(module, "supported_gpu_codes",
                        lambda cuda_home: {"sm_75", "sm_80", "sm_86", "sm_90", "sm_100",
                                           "sm_120"})
    return module


def stand_in_torch(cuda="13.0", gpus=()):
    """A torch whose build and visible GPUs (compute capabilities) are given."""
    return SimpleNamespace(
        __version__="2.14.1+cu130",
        version=SimpleNamespace(cuda=cuda),
        cuda=SimpleNamespace(
            is_available=lambda: bool(gpus),
            device_count=lambda: len(gpus),
            get_device_capability=lambda index: gpus[index],
            get_arch_list=lambda: ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"],
        ),
    )


def plan(setup_module, monkeypatch, torch, **environment):
    for variable, value in environment.items():
        monkeypatch.setenv(variable, value)
    return setup_module.plan_cuda(torch)


def test_without_a_gpu_the_cpu_kernels_only_naming_force_cuda(setup_module, monkeypatch):
    with_cuda, reason = plan(setup_module, monkeypatch, stand_in_torch())
    assert not with_cuda
    assert reason == "no GPU visible (FORCE_CUDA=1 builds the CUDA kernels without one)"


@pytest.mark.parametrize("variable", ["FORCE_CUDA", "DEFORMCONV_WITH_CUDA"])
def test_asked_for_without_a_gpu_torchs_architectures_newest_as_ptx(setup_module, monkeypatch,
                                                                    variable):
    with_cuda, archs = plan(setup_module, monkeypatch, stand_in_torch(), **{variable: "1"})
    assert with_cuda
    assert archs == "7.5;8.0;8.6;9.0;10.0;12.0+PTX"


def test_a_visible_gpu_builds_for_its_architecture_and_ptx(setup_module, monkeypatch):
    torch = stand_in_torch(gpus=[(9, 0), (8, 0), (9, 0)])
    with_cuda, archs = plan(setup_module, monkeypatch, torch)
    assert with_cuda and archs == "8.0;9.0+PTX"


def test_an_explicit_architecture_list_is_taken_as_given(setup_module, monkeypatch):
    with_cuda, archs = plan(setup_module, monkeypatch, stand_in_torch(), FORCE_CUDA="1",
                            TORCH_CUDA_ARCH_LIST="9.0")
    assert with_cuda and archs == "9.0"


def test_force_cuda_0_means_not_forced(setup_module, monkeypatch):
    assert not plan(setup_module, monkeypatch, stand_in_torch(), FORCE_CUDA="0")[0]
    assert plan(setup_module, monkeypatch, stand_in_torch(gpus=[(9, 0)]), FORCE_CUDA="0")[0]


def test_deformconv_with_cuda_0_wins_over_force_cuda(setup_module, monkeypatch):
    with_cuda, reason = plan(setup_module, monkeypatch, stand_in_torch(gpus=[(9, 0)]),
                             FORCE_CUDA="1", DEFORMCONV_WITH_CUDA="0")
    assert not with_cuda and reason == "DEFORMCONV_WITH_CUDA=0"


def test_asked_for_with_a_cpu_torch_stops_naming_both_variables(setup_module, monkeypatch):
    with pytest.raises(SystemExit, match=r"FORCE_CUDA=1 or DEFORMCONV_WITH_CUDA=1\), but they "
                                         r"cannot be built: torch 2.14.1\+cu130 is a CPU-only"):
        plan(setup_module, monkeypatch, stand_in_torch(cuda=None), FORCE_CUDA="1")


@pytest.mark.parametrize("variable", ["FORCE_CUDA", "DEFORMCONV_WITH_CUDA"])
def test_a_switch_of_another_value_stops_naming_it(setup_module, monkeypatch, variable):
    with pytest.raises(SystemExit, match=f"{variable} must be 0, 1 or auto, got 'maybe'"):
        plan(setup_module, monkeypatch, stand_in_torch(), **{variable: "maybe"})
