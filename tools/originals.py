"""The originals' own CUDA ops, built as benchmark contenders: DCNv4's `DCNv4` (OpenGVLab/DCNv4),
InternImage's `DCNv3` (OpenGVLab/InternImage) and Deformable DETR's
`MultiScaleDeformableAttention` (fundamentalvision/Deformable-DETR). Their code is not part of
deformconv and never enters its repository: `copy` takes their sources from clones of those
repositories into originals/ (ignored by git), `build` compiles them there with torch's
extension builder for the visible GPU's architecture, one process each, side by side, and
writes originals/build/status.json, which says of each whether it built and, if not, why.
`python -m deformconv benchmark --originals originals/build` then times them beside
deformconv (deformconv/benchmarks/originals.py).

    python tools/originals.py copy --dcnv4 CLONE --internimage CLONE --deformable-detr CLONE
    python tools/originals.py build [--arch 9.0]
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "originals"

# Per original: the folder of its sources in its repository, the files compiled (as its
# setup.py globs them), the extension's module name, the nvcc flags of its setup.py, and the
# folder of its Python package that the benchmark imports, if it uses one.
ORIGINALS = {
    "dcnv4": {
        "repository": "OpenGVLab/DCNv4",
        "folder": "DCNv4_op",
        "sources": ["src/vision.cpp", "src/cuda/dcnv4_cuda.cu",
                    "src/cuda/flash_deform_attn_cuda.cu"],
        "include": "src",
        "module": "ext",
        "nvcc": ["-DCUDA_HAS_FP16=1", "-D__CUDA_NO_HALF_OPERATORS__",
                 "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__", "-O3"],
    },
    "internimage_dcnv3": {
        "repository": "OpenGVLab/InternImage",
        "folder": "classification/ops_dcnv3",
        "sources": ["src/vision.cpp", "src/cpu/dcnv3_cpu.cpp", "src/cuda/dcnv3_cuda.cu"],
        "include": "src",
        "module": "DCNv3",
        "nvcc": [],
    },
    "deformable_detr": {
        "repository": "fundamentalvision/Deformable-DETR",
        "folder": "models/ops",
        "sources": ["src/vision.cpp", "src/cpu/ms_deform_attn_cpu.cpp",
                    "src/cuda/ms_deform_attn_cuda.cu"],
        "include": "src",
        "module": "MultiScaleDeformableAttention",
        "nvcc": ["-DCUDA_HAS_FP16=1", "-D__CUDA_NO_HALF_OPERATORS__",
                 "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__"],
    },
}


# The one edit the originals need to compile against torch 2: their dispatch macros take
# `tensor.type()`, a DeprecatedTypeProperties that no longer converts to a ScalarType, where
# torch's own code passes `tensor.scalar_type()`. The kernels are not touched.
DISPATCH_ON_TYPE = re.compile(r"(\w+)\.type\(\)(,\s*\")")


def dispatch_on_scalar_type(folder: Path) -> int:
    """Rewrites `x.type(), "name"` as `x.scalar_type(), "name"` in the CUDA sources under folder;
    returns the number of places."""
    places = 0
    for path in sorted(folder.rglob("*.cu")):
        text, count = DISPATCH_ON_TYPE.subn(r"\1.scalar_type()\2", path.read_text())
        if count:
            path.write_text(text)
            places += count
    return places


def copy(args) -> None:
    """Each original's folder, as committed at the clone's HEAD, into originals/src/NAME, with
    its licence and a note (COMMIT) of the commit it came from and the places edited."""
    clones = {"dcnv4": args.dcnv4, "internimage_dcnv3": args.internimage,
              "deformable_detr": args.deformable_detr}
    for name, clone in clones.items():
        original = ORIGINALS[name]
        target = ROOT / "src" / name
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        depth = len(original["folder"].split("/"))
        archive = subprocess.run(["git", "-C", clone, "archive", "HEAD", original["folder"]],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(target), f"--strip-components={depth}"],
                       input=archive, check=True)
        licence = subprocess.run(["git", "-C", clone, "show", "HEAD:LICENSE"],
                                 capture_output=True).stdout
        (target / "LICENSE").write_bytes(licence)
        commit = subprocess.run(["git", "-C", clone, "rev-parse", "HEAD"], check=True,
                                capture_output=True, text=True).stdout.strip()
        places = dispatch_on_scalar_type(target)
        (target / "COMMIT").write_text(
            f"{original['repository']} {commit}, dispatching on scalar_type() in {places} "
            "places\n")
        print(f"{name}: {original['repository']} at {commit[:12]} into {target}, "
              f"{places} dispatches on scalar_type()")


def build_one(name: str) -> dict:
    """Compiles one original into originals/build/NAME; returns its status."""
    from torch.utils.cpp_extension import load

    original = ORIGINALS[name]
    source = ROOT / "src" / name
    build = ROOT / "build" / name
    build.mkdir(parents=True, exist_ok=True)
    start = time.time()
    try:
        load(name=original["module"], sources=[str(source / s) for s in original["sources"]],
             extra_include_paths=[str(source / original["include"])],
             extra_cflags=["-O3", "-DWITH_CUDA"],
             extra_cuda_cflags=["-DWITH_CUDA"] + original["nvcc"],
             build_directory=str(build), with_cuda=True, verbose=False)
    except Exception as error:  # the compiler's or the loader's message says why
        message = str(error).strip().splitlines()
        return {"built": False, "seconds": round(time.time() - start),
                "why": "\n".join(message[-20:])}
    return {"built": True, "seconds": round(time.time() - start),
            "library": str(build / (original["module"] + ".so")), "source": str(source),
            "commit": (source / "COMMIT").read_text().strip()}


def build(args) -> int:
    if args.arch:
        os.environ["TORCH_CUDA_ARCH_LIST"] = args.arch
    names = [name for name in ORIGINALS if (ROOT / "src" / name).is_dir()]
    missing = {name: {"built": False, "why": "not copied into originals/src"}
               for name in ORIGINALS if name not in names}
    with ProcessPoolExecutor(max_workers=max(1, len(names))) as pool:
        statuses = dict(zip(names, pool.map(build_one, names)))
    statuses.update(missing)
    (ROOT / "build").mkdir(parents=True, exist_ok=True)
    (ROOT / "build" / "status.json").write_text(json.dumps(statuses, indent=1) + "\n")
    for name, status in statuses.items():
        state = "built" if status["built"] else "not built: " + status["why"].splitlines()[-1]
        print(f"{name}: {state}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    copy_parser = commands.add_parser("copy", help="sources from clones into originals/src")
    copy_parser.add_argument("--dcnv4", required=True, help="a clone of OpenGVLab/DCNv4")
    copy_parser.add_argument("--internimage", required=True,
                             help="a clone of OpenGVLab/InternImage")
    copy_parser.add_argument("--deformable-detr", required=True,
                             help="a clone of fundamentalvision/Deformable-DETR")
    build_parser = commands.add_parser("build", help="compile originals/src into originals/build")
    build_parser.add_argument("--arch", default=None,
                              help="TORCH_CUDA_ARCH_LIST (default: the visible GPUs')")
    args = parser.parse_args(argv)
    if args.command == "copy":
        copy(args)
        return 0
    return build(args)


if __name__ == "__main__":
    sys.exit(main())
