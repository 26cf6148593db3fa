"""Nsight Compute's CSV report of tools/gpu_profile_once.py (sections SpeedOfLight,
MemoryWorkloadAnalysis, Occupancy, LaunchStats, InstructionStats, SchedulerStats,
WarpStateStats; --print-units base) as JSON that `python -m deformconv benchmark --report`
turns into docs/performance.md's kernel table.

Each row is one kernel of one profiled call (the NVTX range the kernel ran in): its launches,
their total duration and executed (warp) instructions, and the duration-weighted means of the
throughputs, as percentages of the GPU's peaks, and of the issue figures: how busy the issue
slots were, how many warps were eligible to issue, how many cycles a warp took per instruction
issued. Whether a kernel waits on memory or on issuing instructions is read from these.

    python tools/ncu_summary.py NCU_CSV OUTPUT_JSON [--gpu NAME]
"""

import argparse
import csv
import json
import re
import sys

# (section, metric) of ncu's report -> the JSON's key: means weighted by the launches' durations.
WEIGHTED_MEANS = {
    ("GPU Speed Of Light Throughput", "DRAM Throughput"): "dram_throughput_percent",
    ("GPU Speed Of Light Throughput", "Compute (SM) Throughput"): "sm_throughput_percent",
    ("GPU Speed Of Light Throughput", "L2 Cache Throughput"): "l2_throughput_percent",
    ("GPU Speed Of Light Throughput", "L1/TEX Cache Throughput"): "l1_throughput_percent",
    ("Memory Workload Analysis", "L1/TEX Hit Rate"): "l1_hit_rate_percent",
    ("Memory Workload Analysis", "L2 Hit Rate"): "l2_hit_rate_percent",
    ("Occupancy", "Achieved Occupancy"): "achieved_occupancy_percent",
    ("Instruction Statistics", "Issue Slots Busy"): "issue_slots_busy_percent",
    ("Scheduler Statistics", "Eligible Warps Per Scheduler"): "eligible_warps_per_scheduler",
    ("Warp State Statistics", "Warp Cycles Per Issued Instruction"):
        "warp_cycles_per_issued_instruction",
}
# ... and sums over the launches.
SUMS = {
    ("Instruction Statistics", "Executed Instructions"): "executed_instructions",
}
DURATION = ("GPU Speed Of Light Throughput", "Duration")
REGISTERS = ("Launch Statistics", "Registers Per Thread")
# The shared memory the driver configured an SM with for the kernel (the rest of the SM's
# storage is its L1 cache), in bytes with --print-units base.
SHARED_MEMORY = ("Launch Statistics", "Shared Memory Configuration Size")


def kernel_name(signature: str) -> str:
    """'void (anonymous namespace)::im2col_kernel<float, 4>(Geometry, ...)' ->
    'im2col_kernel<float, 4>': the namespaces and the parameter list dropped."""
    name = re.sub(r"^(void )?(\(anonymous namespace\)::|<?unnamed>::|\w+::)*", "", signature)
    return name.split("(", 1)[0]


def call_name(nvtx: str) -> str:
    """ncu's NVTX column, '<default domain>:NAME:none:...', -> NAME ('' outside a range)."""
    fields = nvtx.strip().strip('"').split(":")
    return fields[1] if len(fields) > 1 else ""


def summarise(rows):
    header = rows[0]
    column = {name: header.index(name) for name in
              ("ID", "Kernel Name", "Section Name", "Metric Name", "Metric Value")}
    nvtx_column = next(i for i, name in enumerate(header) if "Push/Pop_Range" in name)
    launches = {}  # ID -> (call, kernel, {(section, metric): value})
    for row in rows[1:]:
        call = call_name(row[nvtx_column])
        if not call:
            continue
        _, _, metrics = launches.setdefault(
            row[column["ID"]], (call, kernel_name(row[column["Kernel Name"]]), {}))
        value = row[column["Metric Value"]].replace(",", "")
        try:
            metrics[(row[column["Section Name"]], row[column["Metric Name"]])] = float(value)
        except ValueError:
            pass
    summary = {}
    for call, kernel, metrics in launches.values():
        entry = summary.setdefault((call, kernel), {"call": call, "kernel": kernel,
                                                    "launches": 0, "duration_seconds": 0.0,
                                                    "registers_per_thread": 0, "weighted": {}})
        duration = metrics[DURATION] * 1e-9
        entry["launches"] += 1
        entry["duration_seconds"] += duration
        entry["registers_per_thread"] = int(metrics.get(REGISTERS, 0))
        if SHARED_MEMORY in metrics:
            entry["shared_memory_configuration_bytes"] = int(metrics[SHARED_MEMORY])
        for key, name in WEIGHTED_MEANS.items():
            if key in metrics:
                entry["weighted"][name] = entry["weighted"].get(name, 0.0) + metrics[key] * duration
        for key, name in SUMS.items():
            if key in metrics:
                entry[name] = entry.get(name, 0) + int(metrics[key])
    kernels = []
    for entry in summary.values():
        weighted = entry.pop("weighted")
        for name, total in weighted.items():
            entry[name] = total / entry["duration_seconds"]
        kernels.append(entry)
    return kernels


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", help="ncu's CSV output (other lines are skipped)")
    parser.add_argument("output")
    parser.add_argument("--gpu", help="the GPU's name (default: torch's name of GPU 0)")
    args = parser.parse_args(argv)
    with open(args.report) as f:
        rows = list(csv.reader(line for line in f if line.startswith('"')))
    if not rows:
        print(f"ncu_summary: no CSV rows in {args.report}", file=sys.stderr)
        return 1
    gpu = args.gpu
    if gpu is None:
        import torch
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    kernels = summarise(rows)
    with open(args.output, "w") as f:
        json.dump({"setup": {"gpu": gpu, "tool": "Nsight Compute, clocks as found"},
                   "kernels": kernels}, f, indent=1)
    for k in kernels:
        issue = k.get("issue_slots_busy_percent")
        print(f"{k['call']:32s} {k['kernel'][:40]:40s} x{k['launches']:<3d} "
              f"{k['duration_seconds'] * 1e6:8.1f} us  DRAM {k['dram_throughput_percent']:5.1f}%"
              f"  SM {k['sm_throughput_percent']:5.1f}%"
              + (f"  issue {issue:5.1f}%" if issue is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
