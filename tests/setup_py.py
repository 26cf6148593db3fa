"""The repository's setup.py loaded as a module (its setup() call runs only as __main__), for
the tests and the emulated build that call its functions."""

import importlib.util
from pathlib import Path

PATH = Path(__file__).resolve().parent.parent / "setup.py"


def load_setup_py():
    spec = importlib.util.spec_from_file_location("deformconv_setup", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
