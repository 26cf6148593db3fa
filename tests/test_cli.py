"""python -m deformconv {info, benchmark, demo} and --help."""

import importlib.metadata
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from deformconv.__main__ import main
from deformconv.benchmarks.timing import (MOST_STEPS_PER_BLOCK, busy_core, seconds_of,
                                           steps_per_sample)
from deformconv.benchmarks.transformers_models import MsdaClock

pytestmark = pytest.mark.workflows


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert all(command in out for command in ("info", "benchmark", "demo"))


def test_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "deformconv 0.1.0" in out and "CUDA kernels compiled:" in out
    assert "cpu float32 float64 float16 bfloat16" in out


def test_benchmark_writes_json_and_chart(tmp_path):
    pytest.importorskip("matplotlib")
    output, chart = tmp_path / "bench.json", tmp_path / "bench.png"
    assert main(["benchmark", "--shapes", "c5", "--repeats", "1", "--warmup", "0",
                 "--output", str(output), "--plot", str(chart)]) == 0
    report = json.loads(output.read_text())
    assert report["setup"]["vector_isa"] in ("AVX-512", "AVX2", "NEON", "unknown")
    assert report["setup"]["deformconv_cpu_capability"] == torch.ops.deformconv._cpu_capability()
    assert report["setup"]["deformconv_cpu_capabilities"][-1] == "default"
    assert report["setup"]["busy_core"] is False
    result = report["results"][0]
    assert result["shape"]["name"] == "c5"
    assert result["ratios"]["dense/deformconv forward"] > 0
    assert result["peak_forward_bytes"]["deformconv"] > 0
    # Forward and backward keep the output, its gradient and every gradient live at once.
    assert (result["peak_forward_backward_bytes"]["deformconv"]
            > result["peak_forward_bytes"]["deformconv"])
    if "torchvision" in result["peak_forward_bytes"]:
        assert result["ratios"]["torchvision/deformconv peak forward+backward memory"] > 0
    assert chart.stat().st_size > 0
    assert_runtimes_ran(tmp_path, output, result, "deformconv", deform_conv_node=True)


def test_benchmark_of_dcn_v1_in_the_runtimes(tmp_path):
    # No mask: the exported module passes None in its place, the DeformConv node has no mask.
    output = tmp_path / "bench.json"
    assert main(["benchmark", "--shapes", "c5", "--v1", "--repeats", "1", "--warmup", "0",
                 "--no-torchvision", "--output", str(output), "--plot", ""]) == 0
    report = json.loads(output.read_text())
    assert report["setup"]["modulated"] is False
    assert_runtimes_ran(tmp_path, output, report["results"][0], "deformconv",
                        deform_conv_node=True)


def assert_runtimes_ran(folder, output, result, eager, deform_conv_node=False):
    """Where ONNX Runtime is installed, the op's forward ran in it in both sampling forms (and
    as ONNX's DeformConv node for DCN v1/v2), and in OpenVINO where that is: each beside eager
    deformconv on the same tensors, with the same output, and in the runtimes table."""
    if not all(importlib.util.find_spec(name) for name in ("onnx", "onnxruntime",
                                                           "onnxscript")):
        return
    runtimes = [f"{runtime} {form} form" for form in ("grid_sample", "gather")
                for runtime in ("onnxruntime", "openvino")
                if runtime == "onnxruntime" or importlib.util.find_spec("openvino")]
    if deform_conv_node:
        runtimes.append("onnxruntime")
    setup = json.loads(output.read_text())["setup"]
    assert setup["runtimes"]["onnxruntime"] == importlib.metadata.version("onnxruntime")
    for runtime in runtimes:
        assert result["ratios"][f"{runtime}/{eager} forward"] > 0
        assert result["agreement"][f"{runtime} max abs difference"] < 1e-4
    document = folder / "deployment.md"
    document.write_text(f"<!-- table: {output.name} runtimes -->\n<!-- end table -->\n")
    assert main(["benchmark", "--report", str(document)]) == 0
    row = next(line for line in document.read_text().split("\n")
               if line.startswith(f"| {result['shape']['name']} |"))
    ratio = result["ratios"][f"onnxruntime gather form/{eager} forward"]
    assert f"({ratio:.2f}×)" in row and row.count("×)") == len(runtimes)


def test_benchmark_without_matplotlib_skips_the_chart_naming_the_extra(tmp_path, monkeypatch,
                                                                        capsys):
    # As in a venv of the required dependencies only: the JSON is written, the chart skipped.
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name == "matplotlib"
                        else real_find_spec(name, *rest))
    output, chart = tmp_path / "bench.json", tmp_path / "bench.png"
    assert main(["benchmark", "--shapes", "c5", "--repeats", "1", "--warmup", "0",
                 "--no-torchvision", "--output", str(output), "--plot", str(chart)]) == 0
    assert json.loads(output.read_text())["results"][0]["shape"]["name"] == "c5"
    assert not chart.exists()
    assert ("no chart: it needs matplotlib, of the benchmark extra (pip install matplotlib"
            in capsys.readouterr().out)


def test_benchmark_of_dcnv3_and_dcnv4(tmp_path):
    output = tmp_path / "bench.json"
    assert main(["benchmark", "--shapes", "fit-stage4", "--repeats", "1", "--warmup", "0",
                 "--output", str(output), "--plot", ""]) == 0
    report = json.loads(output.read_text())
    result = report["results"][0]
    assert result["shape"]["name"] == "fit-stage4"
    # The roofline: the copy bandwidth of this run, and the compulsory bytes of each op, each
    # tensor once. fit-stage4: 4 x 7 x 7 pixels, 512 channels in 32 groups of 9 points, float32.
    assert report["setup"]["copy_bandwidth"]["bytes_per_second"] > 0
    pixels, points, groups, channels = 4 * 7 * 7, 9, 32, 512
    dcnv3_forward = 4 * pixels * (channels + 2 * groups * points + groups * points + channels)
    packed = -(-groups * 3 * points // 8) * 8  # DCNv4's offset_mask, padded to a multiple of 8
    dcnv4_forward = 4 * pixels * (channels + packed + channels)
    compulsory = result["roofline"]["compulsory_bytes"]
    assert compulsory["dcnv3 forward"] == dcnv3_forward
    assert compulsory["dcnv3 forward+backward"] == 2 * dcnv3_forward
    assert compulsory["dcnv4 forward"] == dcnv4_forward
    assert compulsory["dcnv4 forward+backward"] == 2 * dcnv4_forward
    for op in ("dcnv3", "dcnv4"):
        for phase in ("forward", "forward+backward"):
            seconds = result["median_seconds"][f"{op} {phase}"]
            expected = (compulsory[f"{op} {phase}"]
                        / report["setup"]["copy_bandwidth"]["bytes_per_second"] / seconds)
            assert result["roofline"]["fraction"][f"{op} {phase}"] == pytest.approx(expected)
    for op in ("dcnv3", "dcnv4"):
        for measure in ("forward", "forward+backward", "peak forward memory"):
            assert result["ratios"][f"grid_sample formulation/{op} {measure}"] > 0
    # The peer computes the same op: float32 agreement, and DCNv4 is DCNv3 exactly.
    assert result["agreement"]["grid_sample formulation max abs difference"] < 1e-4
    assert result["agreement"]["dcnv4 max abs difference"] == 0
    assert_runtimes_ran(tmp_path, output, result, "dcnv3")


def test_benchmark_of_ms_deform_attn(tmp_path):
    output = tmp_path / "bench.json"
    assert main(["benchmark", "--shapes", "detr-decoder", "--repeats", "1", "--warmup", "0",
                 "--output", str(output), "--plot", ""]) == 0
    report = json.loads(output.read_text())
    result = report["results"][0]
    assert result["shape"]["name"] == "detr-decoder"
    # Compulsory bytes, each tensor once: value (N, S, M, D), locations and weights
    # (N, Lq, M, L, P, 2 and 1), the output (N, Lq, M D) in float32, and the two int64 index
    # tensors (L, 2) and (L,).
    N, S, Lq, M, D, L, P = 2, 64 * 64 + 32 * 32 + 16 * 16 + 8 * 8, 300, 8, 32, 4, 4
    forward = 4 * (N * S * M * D + N * Lq * M * L * P * 3 + N * Lq * M * D) + 8 * 3 * L
    compulsory = result["roofline"]["compulsory_bytes"]
    assert compulsory["ms_deform_attn forward"] == forward
    assert compulsory["ms_deform_attn forward+backward"] == 2 * forward
    for measure in ("forward", "forward+backward"):
        assert result["ratios"][f"grid_sample formulation/ms_deform_attn {measure}"] > 0
    # Ours allocates its output alone; the formulation a copy of every level per head and every
    # sample's channels: the bound of a quarter, deterministic (allocations, not time).
    assert result["ratios"]["grid_sample formulation/ms_deform_attn peak forward memory"] >= 4
    assert result["agreement"]["grid_sample formulation max abs difference"] < 1e-4
    document = tmp_path / "performance.md"
    document.write_text("<!-- table: bench.json msda -->\n<!-- end table -->\n")
    assert main(["benchmark", "--report", str(document)]) == 0
    row = next(line for line in document.read_text().split("\n")
               if line.startswith("| detr-decoder |"))
    ratio = result["ratios"]["grid_sample formulation/ms_deform_attn forward+backward"]
    assert "| 64² 32² 16² 8² | 300 | 8 × 32 | 4 |" in row and f"| {ratio:.1f}× |" in row
    assert_runtimes_ran(tmp_path, output, result, "ms_deform_attn")


def test_benchmark_of_points_per_level_against_transformers(tmp_path):
    """D-FINE's decoder shape, [3, 6, 3] points in the op's flat layout, beside the
    formulation and transformers' multi_scale_deformable_attention_v2."""
    pytest.importorskip("transformers")
    output = tmp_path / "bench.json"
    assert main(["benchmark", "--shapes", "dfine-decoder", "--repeats", "1", "--warmup", "0",
                 "--output", str(output), "--plot", ""]) == 0
    result = json.loads(output.read_text())["results"][0]
    assert result["shape"]["points_per_level"] == [3, 6, 3]
    # Compulsory bytes: the locations and weights of 12 samples a (query, head).
    N, S, Lq, M, D, L = 2, 80 * 80 + 40 * 40 + 20 * 20, 300, 8, 32, 3
    forward = 4 * (N * S * M * D + N * Lq * M * 12 * 3 + N * Lq * M * D) + 8 * 3 * L
    assert result["roofline"]["compulsory_bytes"]["ms_deform_attn forward"] == forward
    for peer in ("grid_sample formulation", "transformers"):
        assert result["agreement"][f"{peer} max abs difference"] < 1e-4
        for measure in ("forward", "forward+backward"):
            assert result["ratios"][f"{peer}/ms_deform_attn {measure}"] > 0
    document = tmp_path / "performance.md"
    document.write_text("<!-- table: bench.json msda -->\n<!-- end table -->\n")
    assert main(["benchmark", "--report", str(document)]) == 0
    row = next(line for line in document.read_text().split("\n")
               if line.startswith("| dfine-decoder |"))
    ratios = [result["ratios"][f"transformers/ms_deform_attn {measure}"]
              for measure in ("forward", "forward+backward")]
    fraction = result["roofline"]["fraction"]
    assert "| 80² 40² 20² | 300 | 8 × 32 | [3, 6, 3] |" in row
    assert row.endswith(f"| {ratios[0]:.1f}× / {ratios[1]:.1f}× | "
                        f"{fraction['ms_deform_attn forward']:.1%} / "
                        f"{fraction['ms_deform_attn forward+backward']:.1%} |")


def test_benchmark_of_a_training_step(tmp_path):
    pytest.importorskip("torchvision")
    output = tmp_path / "training.json"
    assert main(["benchmark-training", "--device", "cpu", "--batch", "2", "--size", "32",
                 "--autocast", "none", "--repeats", "1", "--warmup", "0",
                 "--output", str(output)]) == 0
    report = json.loads(output.read_text())
    # conv2 of layer3's 6 blocks and layer4's 3.
    assert report["setup"]["dcn_layers"] == 9
    assert set(report["median_seconds"]) == {"deformconv", "torchvision", "plain"}
    assert report["ratios"]["torchvision/deformconv step"] > 0
    assert report["ratios"]["deformconv/plain step"] > 0
    # The same weights through both ops: the same logits, to float32's rounding.
    assert report["agreement"]["torchvision max abs logit difference"] < 1e-3


def test_benchmark_of_transformers_models(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("scipy")
    output = tmp_path / "transformers.json"
    assert main(["benchmark-transformers", "--image", "64", "64", "--repeats", "1",
                 "--warmup", "0", "--output", str(output)]) == 0
    report = json.loads(output.read_text())
    steps = [f"{route} {step}" for route in ("transformers", "deformconv")
             for step in ("inference", "training step")]
    # Deformable DETR: 6 encoder and 6 decoder layers; Mask2Former's pixel decoder: 6.
    for result, calls in zip(report["models"], (12, 6)):
        assert result["msda_calls"] == {step: calls for step in steps}
        for step in steps:
            # The time inside MSDA is a part of the step's, and not nothing.
            assert 0 < result["msda_median_seconds"][step] < result["median_seconds"][step]
            assert result["peak_bytes"][step] > 0
        # The same weights on both paths: the same outputs, to float32's rounding.
        assert all(value < 1e-3 for value in result["agreement"].values()), result["agreement"]
    document = tmp_path / "ms_deform_attn.md"
    document.write_text("<!-- table: transformers.json -->\n<!-- end table -->\n")
    assert main(["benchmark", "--report", str(document)]) == 0
    rows = [line for line in document.read_text().split("\n") if line.startswith("| mask")]
    assert [row.split(" | ")[1] for row in rows] == ["inference", "training step"]
    result = report["models"][1]
    assert rows[1].startswith(f"| mask2former (64 × 64) | training step | "
                              f"{result['median_seconds']['transformers training step'] * 1e3:.0f}"
                              f" ms | ")


def test_msda_clock_times_a_call_and_its_backward():
    # A function whose forward and backward each sleep: the clock sees both, and nothing of
    # the work outside the call.
    class Slow(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            time.sleep(0.05)
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            time.sleep(0.1)
            return grad * 2

    clock = MsdaClock()
    timed = clock.timed(Slow.apply)
    x = torch.ones(3, requires_grad=True)
    y = torch.exp(timed(x))
    time.sleep(0.2)
    y.sum().backward()
    assert clock.calls == 1
    assert 0.15 <= clock.seconds < 0.3
    torch.testing.assert_close(x.grad, 2 * torch.exp(2 * torch.ones(3)))


def test_busy_core_spins_a_process_for_the_run_only():
    with busy_core(True) as spinner:
        assert spinner.poll() is None  # running
        if os.path.exists(f"/proc/{spinner.pid}/stat"):
            # utime, in clock ticks: the spinner has been computing, not sleeping.
            assert int(open(f"/proc/{spinner.pid}/stat").read().split()[13]) > 0
    assert spinner.poll() is not None  # ended with the run
    with busy_core(False) as spinner:
        assert spinner is None


def test_demo_trains_and_writes_pngs(tmp_path, capsys):
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    assert main(["demo", "--epochs", "1", "--output", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "deformable test accuracy" in out and "plain      test accuracy" in out
    for name in ("training_curves.png", "sampling_locations.png"):
        assert (tmp_path / name).stat().st_size > 0


@pytest.mark.parametrize("missing", ["sklearn.datasets", "matplotlib"])
def test_demo_without_its_extra_names_the_packages(tmp_path, monkeypatch, missing):
    # None in sys.modules makes an import of that module fail, as in a venv without the extra.
    monkeypatch.setitem(sys.modules, missing, None)
    with pytest.raises(SystemExit, match=rf"needs the demo extra's packages.*\({missing} is "
                                         r"missing\): pip install scikit-learn matplotlib"):
        main(["demo", "--epochs", "1", "--output", str(tmp_path)])
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU is visible")
def test_benchmark_on_cuda_without_a_gpu_says_so(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["benchmark", "--device", "cuda"])
    assert exit_info.value.code == 2
    assert "--device cuda: no CUDA device is visible" in capsys.readouterr().err


def test_cpu_samples_time_one_step_each():
    runs = []
    assert steps_per_sample(lambda: runs.append(1), "cpu") == 1
    assert runs == []  # nothing run to decide it
    assert seconds_of(lambda: runs.append(1), "cpu", steps=3) >= 0 and len(runs) == 3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_samples_time_blocks_of_steps():
    """A step far shorter than CUDA_BLOCK_SECONDS (one launch of a one-element kernel, which
    timed alone measures the host's launch latency, tens of µs) is timed in a block of many;
    one longer (4 passes over 4 GiB: about 8 ms at 4 TB/s) is timed alone."""
    tiny = torch.zeros(1, device="cuda")
    assert 8 <= steps_per_sample(lambda: tiny.add_(1), "cuda") <= MOST_STEPS_PER_BLOCK
    slow = torch.zeros(1 << 30, device="cuda")
    assert steps_per_sample(lambda: [slow.mul_(1.0) for _ in range(4)], "cuda") == 1


def test_cpu_description_records_isa_caps(monkeypatch):
    """The benchmark's setup says which ISA caps the environment sets, and calls the kernels
    AVX2 on an AVX-512 CPU only when every contender's are capped at AVX2."""
    from deformconv.benchmarks.environment import cpu_description

    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        monkeypatch.delenv(name, raising=False)
    uncapped = cpu_description()
    assert uncapped["kernels_isa"] == uncapped["vector_isa"]
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    capped = cpu_description()
    assert capped["isa_caps"]["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert capped["isa_caps"]["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"
    # ATen's capability is fixed when torch starts, deformconv's copy when it first runs.
    everything_capped = (capped["aten_cpu_capability"] == "AVX2"
                         and capped["deformconv_cpu_capability"] == "avx2")
    expected = "AVX2" if everything_capped and capped["vector_isa"] == "AVX-512" \
        else capped["vector_isa"]
    assert capped["kernels_isa"] == expected


def test_report_rewrites_the_marked_tables_from_their_json(tmp_path):
    # The committed runs of docs/ through the generator: the tables of every document in docs/
    # are what it writes, so a document holding them unchanged comes back unchanged.
    docs = Path(__file__).resolve().parent.parent / "docs"
    for source in docs.glob("*.json"):
        (tmp_path / source.name).write_text(source.read_text())
    with_tables = [page for page in sorted(docs.glob("*.md")) if "<!-- table:" in page.read_text()]
    assert {"performance.md", "ms_deform_attn.md"} <= {page.name for page in with_tables}
    for page in with_tables:
        document = tmp_path / page.name
        committed = page.read_text()
        document.write_text(committed)
        assert main(["benchmark", "--report", str(document)]) == 0
        assert document.read_text() == committed, page.name
    document = tmp_path / "performance.md"
    # A stale table is rewritten from its file, and the text around it is left alone.
    report = json.loads((docs / "benchmark.json").read_text())
    document.write_text("before\n<!-- table: benchmark.json -->\n| stale |\n"
                        "<!-- end table -->\nafter\n")
    assert main(["benchmark", "--report", str(document)]) == 0
    lines = document.read_text().split("\n")
    assert lines[0] == "before" and lines[-2] == "after"
    rows = lines[2:lines.index("<!-- end table -->")]
    assert len(rows) == 2 + len(report["results"])
    c3 = next(row for row in rows if row.startswith("| c3 |"))
    medians = report["results"][0]["median_seconds"]
    assert f"| {medians['deformconv forward'] * 1e3:.1f} |" in c3
    ours_over_dense = medians["deformconv forward"] / medians["dense forward"]
    assert f"| {ours_over_dense:.2f}× |" in c3


def test_report_picks_the_table_a_marker_names(tmp_path):
    # A GPU run holds DCN v2 and DCNv3 shapes (here the two committed H200 runs' results in one
    # file): the marker's kind picks each one's table, and DCNv3's has the memory-roofline
    # columns of a run that measured the copy bandwidth.
    docs = Path(__file__).resolve().parent.parent / "docs"
    dcn_v2_run = json.loads((docs / "benchmark_h200_float32.json").read_text())
    report = json.loads((docs / "benchmark_h200_dcnv3_float32.json").read_text())
    report["results"] = dcn_v2_run["results"] + report["results"]
    source = tmp_path / "gpu_run.json"
    source.write_text(json.dumps(report))
    document = tmp_path / "performance.md"
    document.write_text(f"<!-- table: {source.name} deform_conv2d -->\n<!-- end table -->\n"
                        f"<!-- table: {source.name} dcnv3 -->\n<!-- end table -->\n")
    assert main(["benchmark", "--report", str(document)]) == 0
    text = document.read_text()
    dcn_v2, dcnv3 = text.split(f"<!-- table: {source.name} dcnv3 -->")
    shapes = [result["shape"] for result in report["results"]]
    assert dcn_v2.count("\n| ") - 1 == sum("in_channels" in shape for shape in shapes)
    assert dcnv3.count("\n| ") - 1 == sum("group" in shape for shape in shapes)
    assert "DRAM roofline reached" in dcnv3
    stage2 = next(r for r in report["results"] if r["shape"]["name"] == "fit-stage2-batch64")
    fraction = stage2["roofline"]["fraction"]["dcnv3 forward"]
    assert f"| {fraction:.1%} / " in dcnv3
    document.write_text(f"<!-- table: {source.name} nonsense -->\n<!-- end table -->\n")
    with pytest.raises(ValueError, match="table kind 'nonsense'"):
        main(["benchmark", "--report", str(document)])
