"""What a figure was measured on: the CPU's model and vector ISA and the kernels every
contender runs there, the GPU, and the versions."""

import contextlib
import os
import platform

import torch

# Environment variables that cap the vector ISA of the libraries' CPU kernels below what the
# CPU has: oneDNN's (dense convolution, and deformconv's GEMMs), MKL's, ATen's own.
ISA_CAP_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
                     "ATEN_CPU_CAPABILITY")


def cpu_description() -> dict:
    """The CPU's model name and vector ISA (from /proc/cpuinfo where there is one), the
    kernels ATen dispatches to on it (torch.backends.cpu.get_cpu_capability), the copy of
    deformconv's CPU kernels in use (torch.ops.deformconv._cpu_capability, which
    DEFORMCONV_CPU_CAPABILITY chooses) and those this CPU runs, and the ISA caps set in the
    environment. An AVX-512 machine runs every contender's AVX2 kernels when deformconv's copy
    in use is "avx2" and the caps say AVX2: then "kernels_isa" is AVX2."""
    model, flags = platform.processor() or platform.machine(), set()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                if model and flags:
                    break
    isa = next((name for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"),
                                        ("asimd", "NEON")) if flag in flags), "unknown")
    if isa == "unknown" and platform.machine() in ("arm64", "aarch64"):
        isa = "NEON"
    copy = torch.ops.deformconv._cpu_capability()
    caps = {name: os.environ[name] for name in ISA_CAP_VARIABLES if os.environ.get(name)}
    aten = torch.backends.cpu.get_cpu_capability()
    onednn_cap = caps.get("ONEDNN_MAX_CPU_ISA", caps.get("DNNL_MAX_CPU_ISA", "")).upper()
    capped = (isa == "AVX-512" and copy == "avx2" and aten == "AVX2"
              and onednn_cap == "AVX2" and caps.get("MKL_ENABLE_INSTRUCTIONS") == "AVX2")
    return {"cpu": model, "vector_isa": isa, "kernels_isa": "AVX2" if capped else isa,
            "aten_cpu_capability": aten, "deformconv_cpu_capability": copy,
            "deformconv_cpu_capabilities": torch.ops.deformconv._cpu_capabilities(),
            "isa_caps": caps}
