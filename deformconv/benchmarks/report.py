"""The report of a run: printed per shape, and the chart of the ratios."""

import sys
from typing import List, Optional

import torch

from .originals import PEERS


def print_result(result: dict, out=None) -> None:
    # sys.stdout as it is when called, not as it was when this module was imported.
    out = sys.stdout if out is None else out
    medians = result["median_seconds"]
    print(f"\n{result['shape']['name']}: {result['describe']}", file=out)
    for name, seconds in medians.items():
        print(f"  {name:40s} {seconds * 1e3:9.2f} ms", file=out)
    for name, ratio in result["ratios"].items():
        print(f"  {name:58s} {ratio:6.2f}x", file=out)
    for phase, rate in result.get("gemm_gflops_per_second", {}).items():
        print(f"  GEMM GFLOP/s, deformconv {phase:18s} {rate:7.1f}", file=out)
    for name, size in result["peak_forward_bytes"].items():
        print(f"  peak forward memory, {name:24s} {size / 2**20:8.1f} MiB", file=out)
    for name, size in result.get("peak_forward_backward_bytes", {}).items():
        print(f"  peak forward+backward memory, {name:15s} {size / 2**20:8.1f} MiB", file=out)
    for name, fraction in result.get("roofline", {}).get("fraction", {}).items():
        print(f"  memory roofline reached, {name:30s} {fraction:6.1%}", file=out)
    for name, value in result.get("agreement", {}).items():
        print(f"  {name:40s} {value:.2e}", file=out)


# Dashed lines of the chart: the targets of deformconv's performance issues. On the CPU, against
# dense convolution on the single-image shapes: forward at most 1.3x, forward+backward at most
# 1.5x. On a GPU: forward at most 1.5x dense, torchvision at least 3x slower, the grid_sample
# formulation of DCNv3 at least 20x slower.
TARGET_LINES = {"cpu": [(1 / 1.3, "tab:green"), (1 / 1.5, "tab:red")],
                "cuda": [(1 / 1.5, "tab:red"), (3.0, "tab:green"), (20.0, "tab:blue")]}


def plot(results: List[dict], path: str, setup: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["shape"]["name"] for r in results]
    series = sorted({key for r in results for key in r["ratios"]})
    figure, axis = plt.subplots(figsize=(max(6, 1.6 * len(names)), 4.5))
    width = 0.8 / max(1, len(series))
    for i, key in enumerate(series):
        values = [r["ratios"].get(key, float("nan")) for r in results]
        # Bars from parity (1) to the ratio, up where deformconv is faster, down where slower.
        axis.bar([x + i * width for x in range(len(names))], [v - 1 for v in values], width,
                 bottom=1.0, label=key)
    # Logarithmic: ratios span 0.2x to 40x, and 1/2 is as far below 1 as 2 is above.
    axis.set_yscale("log")
    known = [v for r in results for v in r["ratios"].values()]
    axis.set_ylim(min(known + [1.0]) / 1.5, max(known + [1.0]) * 4)
    axis.axhline(1.0, color="black", linewidth=0.8)
    for target, colour in TARGET_LINES[setup["device"]]:
        axis.axhline(target, color=colour, linewidth=0.8, linestyle="--")
    axis.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(names))])
    axis.set_xticklabels(names)
    axis.set_ylabel("time of other / time of deformconv (higher: deformconv faster)")
    where = (setup["gpu"] if setup["device"] == "cuda"
             else f"{setup['vector_isa']} CPU"
             + (f" running {setup['kernels_isa']} kernels"
                if setup["kernels_isa"] != setup["vector_isa"] else "")
             + f", {setup['threads']} threads"
             + (", one core busy" if setup["busy_core"] else ""))
    axis.set_title(f"deformconv on {where}, torch {torch.__version__}")
    axis.legend(fontsize=7, ncol=3, loc="upper left")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


# The tables of docs/performance.md, generated from the JSON files of the runs they report.
# A table sits between "<!-- table: FILE -->" and "<!-- end table -->", FILE being the JSON
# file beside the document; update_tables rewrites every such table from its file. A run of
# several kinds of shape (the GPU's) gives a table of each: "<!-- table: FILE deform_conv2d -->",
# "<!-- table: FILE dcnv3 -->" and "<!-- table: FILE msda -->" pick one.

def _mib(size: int, digits: int) -> str:
    return f"{size / 2**20:.{digits}f}"


def deform_conv2d_table(report: dict) -> List[str]:
    """DCN v1/v2 against torchvision, dense convolution, the GEMMs alone and ONNX Runtime."""
    rows = ["| shape | N | C_in→C_out | H×W | stride | groups | offset groups | ours fwd (ms) | "
            "ours fwd+bwd (ms) | torchvision / ours, fwd | torchvision / ours, fwd+bwd | "
            "ours / dense, fwd | ours / dense, fwd+bwd | GEMMs alone / dense, fwd / fwd+bwd | "
            "ONNX Runtime / ours, fwd | peak fwd MiB (ours / tv / dense) |",
            "|---" * 16 + "|"]
    for result in report["results"]:
        shape, medians, ratios = result["shape"], result["median_seconds"], result["ratios"]
        if "in_channels" not in shape:
            continue

        def ratio(key):
            return f"{ratios[key]:.2f}×" if key in ratios else "–"

        def over_dense(name, phase):
            return medians[f"{name} {phase}"] / medians[f"dense {phase}"]

        peaks = result["peak_forward_bytes"]
        rows.append(
            f"| {shape['name']} | {shape['batch']} | {shape['in_channels']}→"
            f"{shape['out_channels']} | {shape['height']}×{shape['width']} | {shape['stride']} | "
            f"{shape['groups']} | {shape['offset_groups']} | "
            f"{medians['deformconv forward'] * 1e3:.1f} | "
            f"{medians['deformconv forward+backward'] * 1e3:.1f} | "
            f"{ratio('torchvision/deformconv forward')} | "
            f"{ratio('torchvision/deformconv forward+backward')} | "
            f"{over_dense('deformconv', 'forward'):.2f}× | "
            f"{over_dense('deformconv', 'forward+backward'):.2f}× | "
            f"{over_dense('GEMMs alone', 'forward'):.2f}× / "
            f"{over_dense('GEMMs alone', 'forward+backward'):.2f}× | "
            f"{ratio('onnxruntime/deformconv forward')} | "
            f"{_mib(peaks['deformconv'], 0)} / "
            f"{_mib(peaks['torchvision'], 0) if 'torchvision' in peaks else '–'} / "
            f"{_mib(peaks['dense'], 0)} |")
    return rows


def dcnv3_table(report: dict) -> List[str]:
    """DCNv3 and DCNv4 against the grid_sample formulation; on a GPU, also the share of the
    memory roofline each reaches."""
    results = [result for result in report["results"] if "group" in result["shape"]]
    with_roofline = any("roofline" in result for result in results)
    header = ("| shape | H×W×C | group | dcnv3 fwd / fwd+bwd (ms) | grid_sample fwd / fwd+bwd "
              "(ms) | grid_sample / dcnv3, fwd | grid_sample / dcnv3, fwd+bwd | grid_sample / "
              "dcnv4, fwd | grid_sample / dcnv4, fwd+bwd | peak fwd MiB (dcnv3 / dcnv4 / "
              "grid_sample) |")
    columns = 10
    if with_roofline:
        header += " DRAM roofline reached, dcnv3 fwd / fwd+bwd | dcnv4 fwd / fwd+bwd |"
        columns += 2
    rows = [header, "|---" * columns + "|"]
    for result in results:
        shape, medians, ratios = result["shape"], result["median_seconds"], result["ratios"]
        peaks = result["peak_forward_bytes"]
        formulation = "grid_sample formulation"
        row = (
            f"| {shape['name']} | {shape['size']}×{shape['size']}×{shape['channels']} | "
            f"{shape['group']} | {medians['dcnv3 forward'] * 1e3:.2f} / "
            f"{medians['dcnv3 forward+backward'] * 1e3:.2f} | "
            f"{medians[f'{formulation} forward'] * 1e3:.2f} / "
            f"{medians[f'{formulation} forward+backward'] * 1e3:.2f} | "
            + " | ".join(f"{ratios[f'{formulation}/{op} {phase}']:.1f}×"
                         for op in ("dcnv3", "dcnv4") for phase in ("forward",
                                                                    "forward+backward"))
            + f" | {_mib(peaks['dcnv3'], 1)} / {_mib(peaks['dcnv4'], 1)} / "
            f"{_mib(peaks[formulation], 1)} |")
        if with_roofline:
            fraction = result["roofline"]["fraction"]
            row += "".join(f" {fraction[f'{op} forward']:.1%} / "
                           f"{fraction[f'{op} forward+backward']:.1%} |"
                           for op in ("dcnv3", "dcnv4"))
        rows.append(row)
    return rows


def msda_table(report: dict) -> List[str]:
    """Multi-scale deformable attention against the grid_sample formulation and, where it ran,
    transformers' multi_scale_deformable_attention_v2; on a GPU, also the share of the memory
    roofline it reaches."""
    results = [result for result in report["results"] if "levels" in result["shape"]]
    with_roofline = any("roofline" in result for result in results)
    with_transformers = any("transformers forward" in result["median_seconds"]
                            for result in results)
    separate = "ms_deform_attn + softmax"
    with_softmax = any(f"{separate} forward" in result["median_seconds"] for result in results)
    header = ("| shape | N | levels | Lq | M × D | P | ours fwd / fwd+bwd (ms) | grid_sample fwd "
              "/ fwd+bwd (ms) | grid_sample / ours, fwd | grid_sample / ours, fwd+bwd | peak "
              "fwd MiB (ours / grid_sample) |")
    columns = 11
    if with_transformers:
        header += " transformers / ours, fwd / fwd+bwd |"
        columns += 1
    if with_softmax:
        header += " op + separate softmax / softmax in the op, fwd / fwd+bwd / peak fwd |"
        columns += 1
    if with_roofline:
        header += " DRAM roofline reached, fwd / fwd+bwd |"
        columns += 1
    rows = [header, "|---" * columns + "|"]
    formulation, ours = "grid_sample formulation", "ms_deform_attn"
    for result in results:
        shape, medians, ratios = result["shape"], result["median_seconds"], result["ratios"]
        peaks = result["peak_forward_bytes"]
        levels = " ".join(f"{height}²" if height == width else f"{height}×{width}"
                          for height, width in shape["levels"])
        queries = "S" if shape["queries"] is None else shape["queries"]
        points = shape.get("points_per_level") or shape["points"]
        points = points if isinstance(points, int) else "[" + ", ".join(map(str, points)) + "]"
        row = (f"| {shape['name']} | {shape['batch']} | {levels} | {queries} | "
               f"{shape['heads']} × {shape['channels']} | {points} | "
               f"{medians[f'{ours} forward'] * 1e3:.2f} / "
               f"{medians[f'{ours} forward+backward'] * 1e3:.2f} | "
               f"{medians[f'{formulation} forward'] * 1e3:.2f} / "
               f"{medians[f'{formulation} forward+backward'] * 1e3:.2f} | "
               f"{ratios[f'{formulation}/{ours} forward']:.1f}× | "
               f"{ratios[f'{formulation}/{ours} forward+backward']:.1f}× | "
               f"{_mib(peaks[ours], 1)} / {_mib(peaks[formulation], 1)} |")
        if with_transformers:
            row += (f" {ratios[f'transformers/{ours} forward']:.1f}× / "
                    f"{ratios[f'transformers/{ours} forward+backward']:.1f}× |"
                    if f"transformers/{ours} forward" in ratios else " – |")
        if with_softmax:
            row += (f" {ratios[f'{separate}/{ours} forward']:.2f}× / "
                    f"{ratios[f'{separate}/{ours} forward+backward']:.2f}× / "
                    f"{peaks[separate] / peaks[ours]:.2f}× |"
                    if f"{separate}/{ours} forward" in ratios else " – |")
        if with_roofline:
            fraction = result["roofline"]["fraction"]
            row += (f" {fraction[f'{ours} forward']:.1%} / "
                    f"{fraction[f'{ours} forward+backward']:.1%} |")
        rows.append(row)
    return rows


def originals_table(report: dict) -> List[str]:
    """The originals' CUDA ops (--originals) against deformconv's, each shape where one ran:
    their time over ours (above 1: ours is faster) and their largest difference from ours."""
    rows = ["| shape | original | ours | original / ours, fwd | original / ours, fwd+bwd | "
            "max abs difference |", "|---" * 6 + "|"]
    for result in report["results"]:
        ratios, agreement = result["ratios"], result.get("agreement", {})
        for name, ours in PEERS.items():
            if f"{name}/{ours} forward" not in ratios:
                continue
            rows.append(f"| {result['shape']['name']} | {name} | {ours} | "
                        f"{ratios[f'{name}/{ours} forward']:.2f}× | "
                        f"{ratios[f'{name}/{ours} forward+backward']:.2f}× | "
                        f"{agreement[f'{name} max abs difference']:.1e} |")
    return rows


def training_table(report: dict) -> List[str]:
    """benchmark-training's report: one training step of ResNet-50 with DCN v2 layers, on
    deformconv's op and torchvision's, and of the plain ResNet-50."""
    setup, medians, ratios = report["setup"], report["median_seconds"], report["ratios"]
    rows = ["| batch × image | autocast | deformconv step (ms) | torchvision step (ms) | plain "
            "ResNet-50 step (ms) | torchvision / deformconv | deformconv / plain |",
            "|---" * 7 + "|"]
    rows.append(f"| {setup['batch']} × {setup['size']}² | {setup['autocast']} | "
                f"{medians['deformconv'] * 1e3:.1f} | {medians['torchvision'] * 1e3:.1f} | "
                f"{medians['plain'] * 1e3:.1f} | "
                f"{ratios['torchvision/deformconv step']:.2f}× | "
                f"{ratios['deformconv/plain step']:.2f}× |")
    return rows


def internimage_table(report: dict) -> List[str]:
    """tools/benchmark_internimage.py's report: the whole model on both DCNv3 cores."""
    medians, speedups = report["median_seconds"], report["speedups"]
    core, share = report["core_seconds_in_forward"], report["core_share_of_forward"]
    rows = ["| | original pure-PyTorch DCNv3 | deformconv | original / deformconv |",
            "|---|---|---|---|"]
    for step in ("forward", "training step"):
        rows.append(f"| {step} | {medians[f'original {step}'] * 1e3:.0f} ms | "
                    f"{medians[f'deformconv {step}'] * 1e3:.0f} ms | {speedups[step]:.2f}× |")
    rows.append(f"| DCNv3 core, within the forward | {core['original'] * 1e3:.1f} ms "
                f"({share['original']:.0%} of it) | {core['deformconv'] * 1e3:.1f} ms "
                f"({share['deformconv']:.0%} of it) | "
                f"{speedups['DCNv3 core in the forward']:.1f}× |")
    return rows


def kernels_table(report: dict) -> List[str]:
    """tools/ncu_summary.py's JSON: Nsight Compute's figures for each kernel, per launch; the
    call column only where the report tells calls apart."""
    kernels = report["kernels"]
    with_calls = len({kernel["call"] for kernel in kernels}) > 1
    figures = [("DRAM throughput", "dram_throughput_percent"),
               ("SM throughput", "sm_throughput_percent"),
               ("L2 throughput", "l2_throughput_percent"),
               ("L2 hit rate", "l2_hit_rate_percent"),
               ("achieved occupancy", "achieved_occupancy_percent")]
    header = "| kernel |" + (" call |" if with_calls else "") + " launches | µs per launch |"
    header += "".join(f" {title} |" for title, _ in figures) + " registers per thread |"
    rows = [header, "|---" * (4 + len(figures) + with_calls) + "|"]
    for kernel in kernels:
        row = f"| `{kernel['kernel']}` |" + (f" {kernel['call']} |" if with_calls else "")
        row += (f" {kernel['launches']} | "
                f"{kernel['duration_seconds'] / kernel['launches'] * 1e6:.0f} |")
        row += "".join(f" {kernel[key]:.0f}% |" if key in kernel else " – |"
                       for _, key in figures)
        rows.append(row + f" {kernel['registers_per_thread']} |")
    return rows


def transformers_table(report: dict) -> List[str]:
    """benchmark-transformers' report: whole models on transformers' own MSDA and routed to
    deformconv, each step's time, the MSDA inside it and its peak memory."""
    rows = ["| model (image) | step | transformers' own | routed to deformconv | own / routed | "
            "MSDA inside: own, routed | MSDA own / routed | peak memory: own, routed |",
            "|---" * 8 + "|"]
    for result in report["models"]:
        medians, msda, peaks = (result["median_seconds"], result["msda_median_seconds"],
                                result["peak_bytes"])
        height, width = result["image"]
        for step in ("inference", "training step"):
            own, routed = f"transformers {step}", f"deformconv {step}"
            rows.append(
                f"| {result['model']} ({height} × {width}) | {step} | "
                f"{medians[own] * 1e3:.0f} ms | {medians[routed] * 1e3:.0f} ms | "
                f"{result['speedups'][step]:.2f}× | "
                f"{msda[own] * 1e3:.1f} ms ({msda[own] / medians[own]:.0%}), "
                f"{msda[routed] * 1e3:.1f} ms ({msda[routed] / medians[routed]:.0%}) | "
                f"{result['speedups'][f'MSDA in {step}']:.1f}× | "
                f"{_mib(peaks[own], 0)}, {_mib(peaks[routed], 0)} MiB |")
    return rows


RUNTIME_LABELS = {"onnxruntime": "ONNX Runtime, DeformConv",
                  "onnxruntime grid_sample form": "ONNX Runtime, GridSample form",
                  "onnxruntime gather form": "ONNX Runtime, gather form",
                  "openvino grid_sample form": "OpenVINO, GridSample form",
                  "openvino gather form": "OpenVINO, gather form"}
# The eager op each kind of shape times the runtimes against, by its name in the medians.
EAGER_OPS = {"deformconv": "deform_conv2d", "dcnv3": "dcnv3", "ms_deform_attn": "ms_deform_attn"}


def runtimes_table(report: dict) -> List[str]:
    """Each op's forward in the inference runtimes, in each form (docs/deployment.md): its time,
    its ratio to eager deformconv's and its largest difference from it, for the shapes that ran
    them."""
    rows = ["| shape | op | eager deformconv fwd (ms) | "
            + " | ".join(f"{label}: ms (÷ eager), max abs difference"
                         for label in RUNTIME_LABELS.values()) + " |",
            "|---" * (3 + len(RUNTIME_LABELS)) + "|"]
    for result in report["results"]:
        medians = result["median_seconds"]
        if not any(f"{runtime} forward" in medians for runtime in RUNTIME_LABELS):
            continue
        eager = next(name for name in EAGER_OPS if f"{name} forward" in medians)
        cells = []
        for runtime in RUNTIME_LABELS:
            if f"{runtime} forward" not in medians:
                cells.append("–")
                continue
            cells.append(f"{medians[f'{runtime} forward'] * 1e3:.1f} "
                         f"({result['ratios'][f'{runtime}/{eager} forward']:.2f}×), "
                         f"{result['agreement'][f'{runtime} max abs difference']:.1e}")
        rows.append(f"| {result['shape']['name']} | {EAGER_OPS[eager]} | "
                    f"{medians[f'{eager} forward'] * 1e3:.1f} | " + " | ".join(cells) + " |")
    return rows


TABLES = {"deform_conv2d": deform_conv2d_table, "runtimes": runtimes_table, "dcnv3": dcnv3_table,
          "msda": msda_table, "originals": originals_table, "training": training_table,
          "internimage": internimage_table, "kernels": kernels_table,
          "transformers": transformers_table}


def table_of(report: dict, kind: Optional[str] = None) -> List[str]:
    if kind is not None:
        if kind not in TABLES:
            raise ValueError(f"table kind {kind!r}: expected one of {sorted(TABLES)}")
        return TABLES[kind](report)
    if "speedups" in report:
        return internimage_table(report)
    if "kernels" in report:
        return kernels_table(report)
    if "models" in report:
        return transformers_table(report)
    if "results" not in report:
        return training_table(report)
    if any("group" in result["shape"] for result in report["results"]):
        return dcnv3_table(report)
    if any("levels" in result["shape"] for result in report["results"]):
        return msda_table(report)
    return deform_conv2d_table(report)


def update_tables(document: str) -> int:
    """Rewrites every marked table of the markdown file `document` from its JSON file; returns
    how many it rewrote."""
    import json
    import re
    from pathlib import Path

    path = Path(document)
    text = path.read_text()
    marked = re.compile(r"(<!-- table: (\S+)(?: (\S+))? -->\n)(.*?)(<!-- end table -->)", re.S)

    def rewrite(match):
        report = json.loads((path.parent / match.group(2)).read_text())
        return match.group(1) + "\n".join(table_of(report, match.group(3))) + "\n" + match.group(5)

    updated, count = marked.subn(rewrite, text)
    path.write_text(updated)
    return count
