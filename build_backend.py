"""PEP 517 build backend: setuptools', except that building a wheel stops at once where torch is
not importable.

deformconv compiles against the torch it will run with. pip's default build isolation hides the
installed torch from the build, and installing one into the isolated environment would build
against a torch other than the user's (and download gigabytes first). Asking for the wheel's
build requirements is the first step of every wheel build, before pip resolves the runtime
dependencies, so the check here fails within seconds. Making an sdist needs no torch.
"""

from setuptools import build_meta
from setuptools.build_meta import *  # noqa: F401,F403  (every other hook unchanged)

TORCH_MISSING = """\
deformconv: torch is not importable in this build environment.
deformconv is compiled against the torch it will run with, so install torch first and build
without pip's build isolation, which would hide it:
    pip install torch ninja "setuptools>=77" wheel
    pip install --no-build-isolation .
(If torch is installed already, only the second command is needed.)"""


def _require_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        raise SystemExit(TORCH_MISSING) from None


def get_requires_for_build_wheel(config_settings=None):
    _require_torch()
    return build_meta.get_requires_for_build_wheel(config_settings)


def get_requires_for_build_editable(config_settings=None):
    _require_torch()
    return build_meta.get_requires_for_build_editable(config_settings)
