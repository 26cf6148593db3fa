"""One list of sources (csrc/sources.txt) and one of C++ flags (csrc/compile_flags.txt): every
source under csrc/ is listed, and setup.py, CMakeLists.txt (cmake/sources.cmake) and the
emulated CUDA build of the tests each compile what the list gives them, with the same flags."""

import re
import shutil
import subprocess

import pytest

import emulated_cuda
import setup_py

if not setup_py.PATH.is_file():
    pytest.skip("no setup.py beside the tests", allow_module_level=True)

pytestmark = pytest.mark.workflows

ROOT = setup_py.PATH.parent
BUILDS = {"library", "python", "libtorch", "cuda", "emulation"}
# csrc/compile_flags.txt's flags, which every build must pass.
FLAGS = ["-fno-trapping-math", "-Wno-psabi", "-falign-functions=64"]


def listing():
    """{path: set of builds}, read here independently of the build files."""
    rows = {}
    for line in (ROOT / "csrc" / "sources.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            path, *builds = line.split()
            assert path not in rows, f"{path} is listed twice"
            rows[path] = set(builds)
    return rows


def of(*builds):
    return sorted(path for path, tags in listing().items() if tags & set(builds))


def test_cpu_copy_bodies_include_only_their_stage_declarations():
    # Note [CPU copies] (csrc/cpu/cpu_copies.h): a header first included inside a copy's body
    # would have its inline functions compiled for that copy's instruction set, and the
    # linker could hand them to every copy.
    kernel_files = [path for path in sorted((ROOT / "csrc" / "cpu").glob("*.cpp"))
                    if '#include "cpu_copies.h"' in path.read_text()]
    assert len(kernel_files) >= 9
    stage_headers = set()
    for path in kernel_files:
        head, separator, body = path.read_text().partition("#else  // the body, once per copy")
        assert separator, f"{path.name}: no body"
        assert f'#define DEFORMCONV_CPU_COPY_BODY "{path.name}"' in head, path.name
        included = re.findall(r'^#include "([^"]+)"', body, re.MULTILINE)
        assert all(name.endswith("_stages.h") for name in included), (path.name, included)
        stage_headers.update(included)
        assert "namespace deformconv {" not in body, path.name
    assert stage_headers == {"deform_conv2d_stages.h", "dcnv3_stages.h"}
    for name in stage_headers:
        text = (ROOT / "csrc" / "cpu" / name).read_text()
        assert "#include" not in text and "#pragma once" not in text, name


def test_every_source_under_csrc_is_listed_once_with_known_builds():
    on_disk = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "csrc").rglob("*")
                     if path.suffix in (".cpp", ".cu"))
    rows = listing()
    assert sorted(rows) == on_disk
    for path, builds in rows.items():
        assert builds and builds <= BUILDS, f"{path}: {builds}"


@pytest.mark.parametrize("with_cuda", [False, True], ids=["cpu", "cuda"])
def test_setup_py_compiles_the_listed_sources_with_the_listed_flags(with_cuda, monkeypatch):
    from torch.utils import cpp_extension

    module = setup_py.load_setup_py()
    monkeypatch.delenv("DEFORMCONV_SANITIZE", raising=False)
    # CUDAExtension only names the toolkit's folders; nothing is compiled here.
    monkeypatch.setattr(cpp_extension, "CUDAExtension", cpp_extension.CppExtension)
    extension = module.extension(cpp_extension, with_cuda)
    builds = ("library", "python", "cuda") if with_cuda else ("library", "python")
    assert sorted(extension.sources) == of(*builds)
    # Every source against the stable surface of the oldest torch the library targets.
    target = "-DTORCH_TARGET_VERSION=0x020c000000000000"
    assert extension.extra_compile_args["cxx"] == ["-O3", "-g0", target, *FLAGS]
    if with_cuda:
        assert extension.extra_compile_args["nvcc"] == ["-O3", target, "-DUSE_CUDA"]
    assert module.compile_flags() == FLAGS


def test_the_emulated_build_compiles_the_listed_sources(monkeypatch):
    calls = []
    monkeypatch.setattr(emulated_cuda.cpp_extension, "load",
                        lambda **arguments: calls.append(arguments))
    emulated_cuda.load()
    (arguments,) = calls
    emulator = str(ROOT / "tests" / "cuda_emulation" / "emulated_ops.cpp")
    assert arguments["sources"][0] == emulator
    assert sorted(arguments["sources"][1:]) == [str(ROOT / path) for path in of("emulation")]


@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")
def test_cmake_compiles_the_listed_sources_with_the_listed_flags(tmp_path):
    script = tmp_path / "print_sources.cmake"
    # The policies of CMakeLists.txt's minimum version: a script has none of its own, and
    # sources.cmake's `if(... IN_LIST ...)` needs CMP0057 (CMake 3.25 in -P mode leaves it OLD).
    script.write_text("cmake_minimum_required(VERSION 3.18)\n"
                      f'include("{ROOT}/cmake/sources.cmake")\n'
                      "deformconv_sources(cpu library libtorch)\n"
                      "deformconv_sources(cuda library libtorch cuda)\n"
                      'message("cpu=${cpu}")\nmessage("cuda=${cuda}")\n'
                      'message("flags=${DEFORMCONV_COMPILE_FLAGS}")\n')
    result = subprocess.run(["cmake", "-P", str(script)], capture_output=True, text=True,
                            check=True)
    printed = dict(line.split("=", 1) for line in result.stderr.splitlines() if "=" in line)
    assert sorted(printed["cpu"].split(";")) == of("library", "libtorch")
    assert sorted(printed["cuda"].split(";")) == of("library", "libtorch", "cuda")
    assert printed["flags"].split(";") == FLAGS


# ATen's templates whose bodies are OpenMP regions only where the caller is compiled with
# OpenMP's flags, which this library is not (Note [Parallel regions through ATen] in
# csrc/infrastructure/parallel_region.h): called from here, they run serially, silently.
OPENMP_DEPENDENT = re.compile(
    r"\b(?:at::)?(?:parallel_for|parallel_reduce|internal::invoke_parallel)\s*\(|"
    r"#\s*pragma\s+omp\b")
PARALLEL_REGION_HELPERS = {"csrc/infrastructure/parallel_region.h",
                           "csrc/infrastructure/parallel_region.cpp"}


def without_comments(code):
    """C++ code with its // and /* */ comments blanked out (string literals are left alone;
    none in csrc/ holds a comment marker before one of the calls above)."""
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", code, flags=re.DOTALL)


def openmp_dependent_calls(code):
    return [match.group(0) for match in OPENMP_DEPENDENT.finditer(without_comments(code))]


def test_parallel_regions_only_through_the_helpers():
    sources = [path for path in sorted((ROOT / "csrc").rglob("*"))
               if path.suffix in (".h", ".cpp", ".cu", ".cuh")]
    assert len(sources) > 50
    found = {}
    for path in sources:
        relative = str(path.relative_to(ROOT))
        calls = openmp_dependent_calls(path.read_text())
        if calls and relative not in PARALLEL_REGION_HELPERS:
            found[relative] = calls
    assert not found, f"serial outside ATen's own regions (use parallel_region.h): {found}"


def test_the_parallel_region_guard_finds_calls_not_comments():
    assert openmp_dependent_calls("at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {});")
    assert openmp_dependent_calls("at::parallel_reduce (0, n, 1, 0.0, f, g);")
    assert openmp_dependent_calls("  #pragma omp parallel for\n")
    assert not openmp_dependent_calls("// at::parallel_for runs serially here\n"
                                      "/* at::parallel_for(0, n) */ parallel_tasks(n, run);")
