import os
import sys
from pathlib import Path

import pytest

# Under `pytest -n auto` (pytest-xdist: a process per core), OpenMP's threads that spin while
# they wait for work hold the cores the other processes need: a DCN v1/v2 branch test took 15 s
# in one process, 73 s in two spinning, 17 s in two waiting passively. Set before torch loads
# OpenMP, in every process.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

TESTS = Path(__file__).resolve().parent
REPOSITORY = TESTS.parent

# `python -m pytest` puts the working directory first on sys.path. From the repository root,
# the source folder deformconv/ would then shadow the installed package, and unless it was
# built in place (an editable install, or `setup.py build_ext --inplace`) it has no compiled _C.
if not any((REPOSITORY / "deformconv").glob("_C.*.so")):
    sys.path[:] = [entry for entry in sys.path
                   if Path(entry or ".").resolve() != REPOSITORY]

# The tests import the reference implementation as a plain module beside them.
sys.path.insert(0, str(TESTS))


@pytest.fixture
def im2col_forward(monkeypatch):
    """The CPU forward as im2col and GEMMs, as it runs for weights too large for the fused
    forward (Note [Fused forward]), which the tests' small ones would otherwise take."""
    monkeypatch.setenv("DEFORMCONV_FUSED_FORWARD", "0")


def expected_cpu_copies():
    from cpu_levels import expected_cpu_copies

    return expected_cpu_copies()


@pytest.fixture(params=expected_cpu_copies())
def cpu_copy(request):
    """Each copy of the CPU kernels that this CPU runs (Note [CPU copies],
    csrc/cpu/cpu_copies.h), as its flags say (tests/cpu_levels.py), not as the library says:
    a copy that the library wrongly refuses fails the test instead of vanishing from it.
    Selected for the test, and the previous one restored after it."""
    import torch

    previous = torch.ops.deformconv._select_cpu_capability(request.param)
    yield request.param
    torch.ops.deformconv._select_cpu_capability(previous)


@pytest.fixture(scope="session")
def emulated():
    """torch.ops.deformconv_emulated: the CUDA launchers and kernels of csrc/cuda compiled
    against the CPU emulator (tests/emulated_cuda.py), built on first use."""
    from emulated_cuda import load

    return load()


@pytest.fixture
def emulator_settings(emulated):
    """The emulator as it starts (emulation.set_emulator's defaults), with its bookkeeping
    emptied, before the test and again after it."""
    from emulation import set_emulator

    set_emulator(emulated)
    emulated.take_bookkeeping()
    yield
    set_emulator(emulated)


def pytest_collection_modifyitems(items):
    # The marker follows the fixture, so that no emulated test can miss it.
    for item in items:
        if "emulated" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.emulated)
