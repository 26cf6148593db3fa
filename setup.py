"""Build of the deformconv extension against the torch installed where it is built.

The CPU kernels are always built. The CUDA kernels are built as torchvision and mmcv build
theirs: when torch is a CUDA build, a CUDA toolkit of the same major version is found, and either
a GPU is visible or the build is asked for them:
    FORCE_CUDA=1 or DEFORMCONV_WITH_CUDA=1   require the CUDA kernels (stop at once if they
                                             cannot be built), GPU or not
    DEFORMCONV_WITH_CUDA=0                   CPU kernels only
    (neither)                                CUDA kernels when a GPU is visible and they can be
                                             built, else the CPU kernels, saying why
The toolkit is CUDA_HOME (or CUDA_PATH) if it holds include/cuda_runtime.h, else the one that the
nvcc on PATH belongs to, else /usr/local/cuda. The GPU architectures are TORCH_CUDA_ARCH_LIST if
set, taken as given; else those of the visible GPUs, else (a build machine without a GPU) those
that torch itself was built for; of the last two, the newest is also embedded as PTX, which the
driver compiles for GPUs newer than any listed. MAX_JOBS bounds the parallel compile jobs.
DEFORMCONV_SANITIZE=1 compiles the C++ with AddressSanitizer and UndefinedBehaviorSanitizer
(tools/run_sanitized_tests.sh uses it).
With GCC on x86-64 the CPU kernels carry AVX-512, AVX2 and default copies, one chosen at run
time (DEFORMCONV_CPU_CAPABILITY overrides the choice; csrc/cpu/cpu_copies.h).

Making an sdist or reading the metadata needs no torch; compiling does, any torch from
MINIMUM_TORCH on: every source is compiled against that release's part of PyTorch's stable ABI,
so the extension runs under every torch from it on, whichever it was built against. pip's build
isolation installs one into the build environment (pyproject.toml); --no-build-isolation builds
against the one installed.
"""

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent
# setuptools commands that compile the extension; the others (sdist, egg_info, dist_info) only
# write metadata or copy files.
COMPILING_COMMANDS = {"build", "build_ext", "bdist_wheel", "editable_wheel", "develop", "install",
                      "bdist_egg"}


def read_version():
    text = (ROOT / "deformconv" / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', text, re.MULTILINE).group(1)


def say(message: str) -> None:
    print(f"deformconv build: {message}", file=sys.stderr, flush=True)


def cuda_switch() -> str:
    """"1" (CUDA kernels required), "0" (CPU kernels only) or "auto", from DEFORMCONV_WITH_CUDA
    and, as torchvision and mmcv read it, FORCE_CUDA."""
    values = {}
    for variable in ("DEFORMCONV_WITH_CUDA", "FORCE_CUDA"):
        value = os.environ.get(variable, "auto").strip().lower()
        for meaning, spellings in (("1", ("1", "true", "on", "yes")),
                                   ("0", ("0", "false", "off", "no")), ("auto", ("auto", ""))):
            if value in spellings:
                values[variable] = meaning
                break
        else:
            sys.exit(f"deformconv build: {variable} must be 0, 1 or auto, got {value!r}")
    # FORCE_CUDA=0 means "not forced" to torchvision and mmcv, never "CPU only".
    if values["DEFORMCONV_WITH_CUDA"] == "auto" and values["FORCE_CUDA"] == "1":
        return "1"
    return values["DEFORMCONV_WITH_CUDA"]


def has_cuda_headers(path) -> bool:
    return path is not None and (Path(path) / "include" / "cuda_runtime.h").is_file()


def toolkit_of_nvcc():
    """The toolkit that the nvcc on PATH belongs to. PATH may hold a symlink or a wrapper script
    outside the toolkit (then its parent has no headers), so follow the link and, failing that,
    ask nvcc where it runs from (its dry run prints _HERE_, the toolkit's bin directory)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    linked = Path(nvcc).resolve().parent.parent
    if has_cuda_headers(linked):
        return linked
    try:
        dry_run = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                                 capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    here = re.search(r"^#\$ _HERE_=(.+)$", dry_run.stdout + dry_run.stderr, re.MULTILINE)
    return Path(here.group(1).strip()).resolve().parent if here else None


def find_cuda_home(notes):
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(variable)
        if value:
            if has_cuda_headers(value):
                return Path(value)
            notes.append(f"{variable}={value} ignored: it has no include/cuda_runtime.h")
    for candidate in (toolkit_of_nvcc(), Path("/usr/local/cuda")):
        if has_cuda_headers(candidate):
            return candidate
    return None


def nvcc_release(cuda_home: Path):
    """(major, minor) of the toolkit's nvcc, or None if it does not run."""
    try:
        out = subprocess.run([str(cuda_home / "bin" / "nvcc"), "--version"], capture_output=True,
                             text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"release (\d+)\.(\d+)", out)
    return (int(found.group(1)), int(found.group(2))) if found else None


def supported_gpu_codes(cuda_home: Path):
    listing = subprocess.run([str(cuda_home / "bin" / "nvcc"), "--list-gpu-code"],
                             capture_output=True, text=True, timeout=60)
    if listing.returncode != 0:
        raise RuntimeError(f"nvcc --list-gpu-code failed: {listing.stderr.strip()}")
    return set(listing.stdout.split())


def architectures_of_torch(torch, cuda_home: Path, notes):
    """torch's own list ("sm_90", "compute_90" for PTX) as TORCH_CUDA_ARCH_LIST entries
    ("9.0", "9.0+PTX"), keeping those this nvcc can compile."""
    supported = supported_gpu_codes(cuda_home)
    real = [a for a in torch.cuda.get_arch_list() if a.startswith("sm_")]
    ptx = {a.replace("compute_", "sm_") for a in torch.cuda.get_arch_list()
           if a.startswith("compute_")}
    archs = []
    for code in real + sorted(ptx - set(real)):
        if code not in supported:
            notes.append(f"{code} left out: this nvcc cannot compile it")
            continue
        digits = code[len("sm_"):]
        entry = f"{digits[:-1]}.{digits[-1]}"
        archs.append(entry + "+PTX" if code in ptx else entry)
    return archs


def newest_as_ptx(archs) -> str:
    """TORCH_CUDA_ARCH_LIST entries joined, the newest architecture also as PTX: a GPU newer
    than every listed one then runs the kernels, compiled by its driver, instead of failing
    with "no kernel image is available"."""
    def as_number(entry):
        return tuple(int(part) for part in entry.split("+")[0].split("."))

    if not archs:
        return ""
    newest = max(archs, key=as_number)
    return ";".join(entry + "+PTX" if entry == newest and not entry.endswith("+PTX") else entry
                    for entry in sorted(archs, key=as_number))


def plan_cuda(torch):
    """(CUDA kernels built?, the arch list or the reason they are not) per the switch."""
    switch = cuda_switch()
    if switch == "0":
        return False, "DEFORMCONV_WITH_CUDA=0"
    notes = []
    problem = None
    cuda_home = find_cuda_home(notes)
    if torch.version.cuda is None:
        problem = (f"torch {torch.__version__} is a CPU-only build; install a CUDA build of torch "
                   "for the CUDA kernels")
    elif cuda_home is None:
        problem = ("no CUDA toolkit found (no CUDA_HOME or CUDA_PATH with "
                   "include/cuda_runtime.h, no nvcc on PATH, nothing in /usr/local/cuda); "
                   "install the CUDA toolkit or set CUDA_HOME to its directory")
    else:
        release = nvcc_release(cuda_home)
        torch_major = int(torch.version.cuda.split(".")[0])
        if release is None:
            problem = f"{cuda_home / 'bin' / 'nvcc'} does not run"
        elif release[0] != torch_major:
            problem = (f"the toolkit in {cuda_home} is CUDA {release[0]}.{release[1]}, but torch "
                       f"was built with CUDA {torch.version.cuda}; install a CUDA {torch_major}.x "
                       "toolkit and set CUDA_HOME to it, or a torch built for "
                       f"CUDA {release[0]}")
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    gpu_visible = torch.version.cuda is not None and torch.cuda.is_available()
    if problem is None and switch == "auto" and not gpu_visible:
        problem = "no GPU visible (FORCE_CUDA=1 builds the CUDA kernels without one)"
    if problem is None and not archs:
        if gpu_visible:
            archs = newest_as_ptx(sorted({"{}.{}".format(*torch.cuda.get_device_capability(i))
                                          for i in range(torch.cuda.device_count())}))
            notes.append(f"architectures of the visible GPUs: {archs}")
        else:
            try:
                archs = newest_as_ptx(architectures_of_torch(torch, cuda_home, notes))
            except RuntimeError as error:
                problem = str(error)
            else:
                notes.append(f"no GPU visible: the architectures torch {torch.__version__} was "
                             f"built for: {archs or 'none that this nvcc compiles'}")
                if not archs:
                    problem = "this nvcc compiles none of the architectures torch was built for"
    for note in notes:
        say(note)
    if problem is not None:
        if switch == "1":
            sys.exit("deformconv build: the CUDA kernels were asked for (FORCE_CUDA=1 or "
                     f"DEFORMCONV_WITH_CUDA=1), but they cannot be built: {problem}.")
        return False, problem
    # torch's build helper reads both when it is imported and when it compiles.
    os.environ["CUDA_HOME"] = str(cuda_home)
    os.environ["TORCH_CUDA_ARCH_LIST"] = archs
    say(f"CUDA kernels for {archs}, toolkit {cuda_home}")
    return True, archs


def listed_sources(*builds):
    """csrc/sources.txt's sources of any of these builds (library, python, libtorch, cuda, emulation),
    which CMakeLists.txt and the emulated build of the tests read too."""
    chosen = []
    for line in (ROOT / "csrc" / "sources.txt").read_text().splitlines():
        fields = line.split()
        if fields and not fields[0].startswith("#") and set(builds) & set(fields[1:]):
            chosen.append(fields[0])
    return chosen


def compile_flags():
    """csrc/compile_flags.txt's flags (it says why), which CMakeLists.txt reads too."""
    return [line.strip() for line in (ROOT / "csrc" / "compile_flags.txt").read_text().splitlines()
            if line.startswith("-")]


# The oldest torch that the library runs under, through PyTorch's stable ABI: every source is
# compiled with TORCH_TARGET_VERSION set to it, so that the stable headers leave out what later
# releases added and libtorch's own headers stop with an #error. The torch it is built against
# may be any release from this one on.
MINIMUM_TORCH = (2, 12)


def torch_target_version() -> str:
    """MINIMUM_TORCH as TORCH_TARGET_VERSION spells a release: major and minor in the top two
    bytes."""
    major, minor = MINIMUM_TORCH
    return f"0x{major:02x}{minor:02x}000000000000"


# The Python module uses CPython's limited API only (csrc/python/module.cpp creates an empty
# module; the ops reach Python through the dispatcher): one build serves every Python from
# PYTHON_ABI on, its wheel tagged abi3, and it does not link libtorch_python.
PYTHON_ABI = "cp310"


def extension(cpp_extension, with_cuda: bool):
    # No OpenMP flags: the kernels run in parallel regions that ATen compiled (Note [Parallel
    # regions through ATen], csrc/infrastructure/parallel_region.h), on every compiler and platform.
    # -g0: Python's own flags ask for debug information, which makes the build about a
    # third longer (CPU kernels on 2 cores: 219 s with it, 156 s without).
    target = f"-DTORCH_TARGET_VERSION={torch_target_version()}"
    cxx_flags = ["-O3", "-g0", target] + compile_flags()
    link_flags = []
    if os.environ.get("DEFORMCONV_SANITIZE", "0") == "1":
        sanitize = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
                    "-fno-omit-frame-pointer", "-g"]
        cxx_flags = ["-O1", target] + compile_flags() + sanitize
        link_flags += sanitize
    if with_cuda:
        # USE_CUDA, as in PyTorch's own build: the C shim declares its CUDA functions (the
        # current stream, csrc/cuda/launch.cuh) only where it is defined.
        return cpp_extension.CUDAExtension(
            "deformconv._C", listed_sources("library", "python", "cuda"),
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", target, "-DUSE_CUDA"]},
            extra_link_args=link_flags, py_limited_api=True,
        )
    return cpp_extension.CppExtension(
        "deformconv._C", listed_sources("library", "python"),
        extra_compile_args={"cxx": cxx_flags}, extra_link_args=link_flags, py_limited_api=True,
    )


# The oldest compilers that CI builds deformconv with (README, Compatibility).
MINIMUM_COMPILERS = {"GCC": 11, "clang": 14, "Apple clang": 14}


def check_compiler():
    """Stops with a clear message where the C++ compiler that torch's build helper will call
    (CXX, else c++) is older than MINIMUM_COMPILERS, rather than with an error deep in a header.
    A compiler that cannot be asked, or is none of these, is left to try."""
    compiler = shlex.split(os.environ.get("CXX", "c++"))
    try:
        macros = subprocess.run(compiler + ["-dM", "-E", "-x", "c++", os.devnull],
                                capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return
    defined = dict(re.findall(r"^#define (\w+) (.*)$", macros, re.MULTILINE))
    if "__clang_major__" in defined:
        name = "Apple clang" if "__apple_build_version__" in defined else "clang"
        major = int(defined["__clang_major__"])
    elif "__GNUC__" in defined:
        name, major = "GCC", int(defined["__GNUC__"])
    else:
        return
    if major < MINIMUM_COMPILERS[name]:
        sys.exit(f"deformconv build: {' '.join(compiler)} is {name} {major}; deformconv needs "
                 f"{name} {MINIMUM_COMPILERS[name]} or newer (GCC 11, clang 14). Set CXX to a "
                 "newer compiler, for example CXX=g++-12.")


def keep_headers_copy(source: Path, copy: Path) -> None:
    """Makes `copy` a copy of the header folder `source` unless it is one already.

    The extension compiles against this copy of torch's headers, kept beside its objects, rather
    than against torch's own folder, so that a second build against the same torch release from
    another place (pip's isolated build environment, then the venv's torch) gives ninja the same
    commands and the same header files, and ninja recompiles nothing. The copy is replaced, with
    new timestamps, when the headers' contents differ."""
    digest = hashlib.sha256()
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(source)).encode() + b"\0" + path.read_bytes())
    stamp = copy.with_name(copy.name + ".sha256")
    if copy.is_dir() and stamp.is_file() and stamp.read_text() == digest.hexdigest():
        return
    shutil.rmtree(copy, ignore_errors=True)
    # copyfile, not copy2: a replaced header must look newer than the objects compiled from
    # the old one.
    shutil.copytree(source, copy, copy_function=shutil.copyfile)
    stamp.write_text(digest.hexdigest())


def build_options():
    """setup() arguments for compiling the extension against the torch installed here."""
    import torch

    check_compiler()

    with_cuda, archs_or_reason = plan_cuda(torch)
    if not with_cuda:
        say(f"CPU kernels only: {archs_or_reason}")
    from torch.utils import cpp_extension

    class BuildExtension(cpp_extension.BuildExtension):
        """Falls back to the CPU kernels if the CUDA ones fail to compile in auto mode (a host
        compiler that this nvcc refuses, say), and writes deformconv/_build_info.py beside the
        compiled _C: what `python -m deformconv info` reports, and the torch version that the
        import checks against."""

        cpu_only_reason = None if with_cuda else archs_or_reason

        def finalize_options(self):
            super().finalize_options()
            # pip's editable installs compile in a new temporary folder each time, so a second
            # `pip install -e .` would compile everything again. A folder of the source tree,
            # one per Python and torch release, lets ninja recompile only what changed (it also
            # reruns any command whose flags changed), with torch's headers copied there
            # (keep_headers_copy).
            torch_tag = "".join(c if c.isalnum() else "_" for c in torch.__version__)
            self.build_temp = str(ROOT / "build" /
                                  f"objects-{sys.implementation.cache_tag}-torch{torch_tag}")

        def against_headers_copy(self):
            """The extension's include folders under torch's headers, moved to their copy
            (keep_headers_copy)."""
            headers = Path(cpp_extension.include_paths()[0])
            copy = Path(self.build_temp) / "torch-include"
            keep_headers_copy(headers, copy)
            for compiled in self.extensions:
                compiled.include_dirs = [
                    str(copy / Path(folder).relative_to(headers))
                    if Path(folder).is_relative_to(headers) else folder
                    for folder in compiled.include_dirs]

        def build_extensions(self):
            self.against_headers_copy()
            try:
                super().build_extensions()
            except Exception as error:
                if self.cpu_only_reason is not None or cuda_switch() == "1":
                    raise
                first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
                self.cpu_only_reason = f"the CUDA kernels failed to compile: {first_line}"
                say(f"CPU kernels only: {self.cpu_only_reason}")
                # In place: setuptools has annotated the Extension object already.
                (compiled,) = self.extensions
                vars(compiled).update(vars(extension(cpp_extension, with_cuda=False)))
                self.against_headers_copy()
                super().build_extensions()

        def run(self):
            super().run()
            built = Path(self.get_ext_fullpath("deformconv._C"))
            # A module left by an earlier build under another suffix (_C.cpython-311-...so
            # before the builds were abi3) would be imported in preference to this one.
            for stale in built.parent.glob("_C.*.so"):
                if stale != built:
                    stale.unlink()
            target = built.parent / "_build_info.py"
            archs = archs_or_reason if self.cpu_only_reason is None else ""
            target.write_text(
                "# Written by setup.py when _C was compiled.\n"
                f"TORCH_VERSION = {torch.__version__!r}\n"
                f"MINIMUM_TORCH = {MINIMUM_TORCH!r}\n"
                f"CUDA_ARCH_LIST = {archs!r}\n"
                f"CPU_ONLY_REASON = {self.cpu_only_reason!r}\n"
            )

    return {
        "ext_modules": [extension(cpp_extension, with_cuda)],
        "cmdclass": {"build_ext": BuildExtension.with_options(use_ninja=True)},
    }


def torch_requirement() -> str:
    """Every torch from MINIMUM_TORCH on: the library uses PyTorch's stable ABI alone."""
    major, minor = MINIMUM_TORCH
    return f"torch>={major}.{minor}"


# Run by pip's build backend and by `python setup.py` alike as __main__; imported by the tests,
# which call the functions above.
if __name__ == "__main__":
    commands = sys.argv[1:]
    setup(
        version=read_version(),
        options={"bdist_wheel": {"py_limited_api": PYTHON_ABI}},
        install_requires=[torch_requirement()],
        **(build_options() if COMPILING_COMMANDS.intersection(commands) else {}),
    )
