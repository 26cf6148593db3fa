"""The copies of the CPU kernels (Note [CPU copies], csrc/cpu/cpu_copies.h): each copy that
this CPU runs runs every op, as the branch trace shows, with the vectors of its instruction set
and the results of the others; DEFORMCONV_CPU_CAPABILITY chooses the copy at load time and
falls back, warning, from one that cannot run. The paths of each op under each copy are the
branch tests' (their cpu_copy fixture)."""

import platform
import re
import shutil
import subprocess

import pytest
import torch

import deformconv
from branching import branch_trace
from cpu_levels import cpu_flags, expected_cpu_copies
from deform_conv2d_cases import GEOMETRIES, make_operands
from dcnv3_reference import pack_offset_mask, random_operands
from fresh_process import run_script
from ms_deform_attn_reference import make_operands as attention_operands

COPIES = list(torch.ops.deformconv._cpu_capabilities())
EXPECTED = expected_cpu_copies()


def every_op(dtype):
    """Each op's forward and every gradient, on small operands off integer coordinates."""
    geometry = GEOMETRIES[4]
    input, offset, weight, bias, mask = [
        t.requires_grad_() for t in make_operands(geometry, dtype=dtype)]
    results = {"deform_conv2d": (deformconv.deform_conv2d(
        input, offset, weight, bias, geometry.stride, geometry.padding, geometry.dilation,
        mask),
        (input, offset, weight, bias, mask))}
    dcnv3_geometry = ((3, 3), (1, 1), (1, 1), (1, 1), 2, 16)
    x, o, m = [t.requires_grad_() for t in random_operands(2, 5, 6, dcnv3_geometry, dtype=dtype)]
    flat = (3, 3, 1, 1, 1, 1, 1, 1, 2, 16, 0.5, 0, False)
    results["dcnv3"] = (deformconv.dcnv3(x, o, m, *flat), (x, o, m))
    offset_mask = pack_offset_mask(o.detach(), m.detach(), 2, padding_value=0.0)
    x4 = x.detach().clone().requires_grad_()
    offset_mask.requires_grad_()
    results["dcnv4"] = (deformconv.dcnv4(x4, offset_mask, *flat), (x4, offset_mask))
    value, shapes, starts, locations, weights = attention_operands(
        [(4, 6), (2, 3)], channels=16, dtype=dtype)
    floating = [t.requires_grad_() for t in (value, locations, weights)]
    results["ms_deform_attn"] = (deformconv.ms_deform_attn(
        floating[0], shapes, starts, floating[1], floating[2]), floating)
    gradients = {}
    for op, (output, operands) in results.items():
        grad_output = torch.ones_like(output) / 7
        gradients[op] = [output.detach(), *torch.autograd.grad(output, operands, grad_output)]
    return gradients


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_each_copy_runs_every_op_with_its_vectors(cpu_copy, dtype):
    with branch_trace() as taken:
        results = every_op(dtype)
    copies_run = {name for name in taken if name.startswith("cpu.capability.")}
    assert copies_run == {f"cpu.capability.{cpu_copy}"}
    widths = {name for name in taken if name.startswith("cpu.vectors.")}
    assert widths == {"cpu.vectors.64bytes" if cpu_copy == "avx512" else "cpu.vectors.32bytes"}
    # Against the best copy's results: the copies differ in rounding only (fused multiply-adds,
    # the order of vector sums).
    previous = torch.ops.deformconv._select_cpu_capability(COPIES[0])
    try:
        expected = every_op(dtype)
    finally:
        torch.ops.deformconv._select_cpu_capability(previous)
    tolerance = 1e-4 if dtype == torch.float32 else 1e-10
    for op in results:
        for got, want in zip(results[op], expected[op]):
            torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance, msg=op)


def test_the_copies_this_cpu_runs():
    assert COPIES[-1] == "default"
    assert COPIES == [name for name in ("avx512", "avx2", "default") if name in COPIES]
    flags = cpu_flags() or set()
    if "avx512" in COPIES:
        assert {"avx512f", "avx512bw", "avx512vl"} <= flags
    if "avx2" in COPIES:
        assert {"avx2", "fma"} <= flags
    assert torch.ops.deformconv._cpu_capability() in COPIES


def test_every_copy_the_cpu_flags_allow_is_listed_and_best_is_chosen(tmp_path):
    # The reverse of the test above: a copy that the build holds and whose x86-64 level the
    # CPU's flags show is listed, and the best is the one in use, so that the cpu_copy
    # fixture's tests (run on EXPECTED) and the library's list agree in number.
    assert COPIES == EXPECTED
    chosen, stderr = capability_chosen_by("", tmp_path)
    assert chosen == EXPECTED[0]
    assert "DEFORMCONV_CPU_CAPABILITY" not in stderr


def test_select_refuses_a_copy_it_cannot_run():
    with pytest.raises(ValueError, match="expected avx512, avx2 or default, but got 'avx3'"):
        torch.ops.deformconv._select_cpu_capability("avx3")
    for name in {"avx512", "avx2"} - set(COPIES):
        with pytest.raises(ValueError, match=f"(holds no|cannot run the) {name} copy"):
            torch.ops.deformconv._select_cpu_capability(name)


def capability_chosen_by(value, directory):
    """The copy in use, and what was printed to stderr, in a fresh process whose
    DEFORMCONV_CPU_CAPABILITY is value, run from directory (fresh_process.run_script)."""
    script = ("import torch, deformconv; "
              "print(torch.ops.deformconv._cpu_capability())")
    run = run_script(script, directory, DEFORMCONV_CPU_CAPABILITY=value)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip(), run.stderr


@pytest.mark.parametrize("copy", EXPECTED)
def test_the_variable_chooses_a_copy_at_load_time(copy, tmp_path):
    chosen, stderr = capability_chosen_by(copy, tmp_path)
    assert chosen == copy
    assert "DEFORMCONV_CPU_CAPABILITY" not in stderr


def test_the_variable_falls_back_with_a_warning(tmp_path):
    chosen, stderr = capability_chosen_by("avx3", tmp_path)
    assert chosen == EXPECTED[0]
    assert ("DEFORMCONV_CPU_CAPABILITY: expected avx512, avx2 or default, but got 'avx3'; "
            f"running the {EXPECTED[0]} copy") in stderr


def functions_using(pattern, disassembly):
    """The names of the functions of an objdump listing with an instruction that matches."""
    found, current = set(), None
    for line in disassembly.splitlines():
        label = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if label:
            current = label.group(1)
        elif current and re.search(pattern, line):
            found.add(current)
    return found


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("objdump") is None,
                    reason="x86-64 machine code, read with binutils' objdump")
def test_wide_vectors_only_inside_their_copies():
    # The one-definition rule at work (Note [CPU copies]): code outside the AVX-512 and AVX2
    # copies' namespaces is compiled for the default target, so that the linker, which keeps
    # one of several definitions of an inline function, never hands a CPU without AVX2 an
    # instruction of another copy; and the AVX2 copy holds no AVX-512 instruction.
    library = deformconv._C.__file__
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", library],
                             capture_output=True, text=True, check=True).stdout
    if "deformconv::cpu_avx2::" not in listing:
        pytest.skip("a build with the default copy alone (not GCC on x86-64)")
    copies = ("deformconv::cpu_avx512::", "deformconv::cpu_avx2::")
    wide = functions_using(r"%[yz]mm|%k[1-7]\b", listing)
    assert any("deformconv::cpu_avx512::" in name for name in wide)
    assert not {name for name in wide if not any(copy in name for copy in copies)}
    avx512 = functions_using(r"%zmm|%k[1-7]\b", listing)
    assert not {name for name in avx512 if "deformconv::cpu_avx2::" in name}
