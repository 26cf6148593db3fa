"""The copies of the CPU kernels (Note [CPU copies], csrc/cpu/cpu_copies.h) that should run on
this CPU, worked out from the CPU's flags as Linux reports them, not from the library's own
check (runs_here in csrc/cpu/cpu_capability.cpp): the copies are compiled for the x86-64 levels
of the psABI, v4 (avx512) and v3 (avx2), and a CPU with a level's flags runs its copy. So a slip
in the library's check that hides a copy the CPU runs fails the tests instead of quietly
leaving that copy untested. Where /proc/cpuinfo is not there, torch's own reading of the CPU
stands in for it."""

import platform

import torch

# The flags of each level as /proc/cpuinfo names them (x86-64-v2's with v3's: "pni" is SSE3,
# "abm" LZCNT).
X86_64_V3 = {"cx16", "lahf_lm", "popcnt", "pni", "ssse3", "sse4_1", "sse4_2", "avx", "avx2",
             "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
X86_64_V4 = X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}

# torch's CPU capability (ATen's own dispatch, read from CPUID) for the same levels.
TORCH_CAPABILITIES = {"AVX512": ("avx512", "avx2"), "AVX2": ("avx2",)}


def cpu_flags():
    """The flags of /proc/cpuinfo's first processor, None where there is no such file."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return set()


def copies_the_cpu_allows():
    """The copies whose instruction sets this CPU has, best first; "default" always."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return ["default"]
    flags = cpu_flags()
    if flags is None:
        allowed = TORCH_CAPABILITIES.get(torch.backends.cpu.get_cpu_capability(), ())
    else:
        allowed = [name for name, level in (("avx512", X86_64_V4), ("avx2", X86_64_V3))
                   if level <= flags]
    return [*allowed, "default"]


def copy_is_held(name):
    """Whether this build compiled the copy: GCC 11 and later on x86-64 compile all three,
    other compilers the default one alone (csrc/cpu/cpu_copy_list.h). Asked of the library,
    which tells a copy it lacks from one the CPU cannot run."""
    try:
        previous = torch.ops.deformconv._select_cpu_capability(name)
    except ValueError as error:
        if "this build holds no" in str(error):
            return False
        return True  # held, but refused for this CPU: the tests that use the copy then fail
    torch.ops.deformconv._select_cpu_capability(previous)
    return True


def expected_cpu_copies():
    """The copies that this build holds and this CPU runs, best first: what the library must
    list (_cpu_capabilities) and what the cpu_copy fixture runs."""
    import deformconv  # noqa: F401  (registers the ops)

    return [name for name in copies_the_cpu_allows() if copy_is_held(name)]
