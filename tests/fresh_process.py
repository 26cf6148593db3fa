"""A Python script run in a fresh process that imports the deformconv this one runs (an
installed wheel, an editable install, the sanitized build in place): its folder goes first on
the path, and the process runs from a given directory, where no source folder can shadow it."""

import os
import subprocess
import sys
from pathlib import Path

import deformconv


def run_script(script, directory, **environment):
    """The finished process (stdout and stderr as text) of `python -c script`, run from
    directory with these variables added to the environment."""
    package_parent = str(Path(deformconv.__file__).resolve().parent.parent)
    path = os.pathsep.join(filter(None, [package_parent, os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, **environment, "PYTHONPATH": path},
                          cwd=directory, timeout=300)
