"""tools/ncu_summary.py, which turns Nsight Compute's CSV report into the JSON of
docs/performance.md's kernel table, on a report written here in ncu's format."""

import csv
import importlib.util
import io
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.workflows

TOOL = Path(__file__).resolve().parent.parent / "tools" / "ncu_summary.py"
spec = importlib.util.spec_from_file_location("ncu_summary", TOOL)
ncu_summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ncu_summary)

HEADER = ["ID", "Process ID", "Process Name", "Host Name",
          "thread Domain:Push/Pop_Range:PL_Type:PL_Value:CLR_Type:Color:Msg_Type:Msg",
          "Id:Domain:Start/Stop_Range:PL_Type:PL_Value:CLR_Type:Color:Msg_Type:Msg",
          "Kernel Name", "Context", "Stream", "Block Size", "Grid Size", "Device", "CC",
          "Section Name", "Metric Name", "Metric Unit", "Metric Value"]
SOL = "GPU Speed Of Light Throughput"


def launch(launch_id, call, kernel, duration_ns, dram, sm, instructions=1000, issue=50.0):
    nvtx = f"<default domain>:{call}:none:none:none:none:none:none" if call else ""
    common = [str(launch_id), "1", "python3", "host", nvtx, "", kernel, "1", "7",
              "(256, 1, 1)", "(100, 1, 1)", "0", "9.0"]
    return [common + [SOL, "Duration", "ns", f"{duration_ns:,}"],
            common + [SOL, "DRAM Throughput", "%", str(dram)],
            common + [SOL, "Compute (SM) Throughput", "%", str(sm)],
            common + ["Launch Statistics", "Registers Per Thread", "register/thread", "62"],
            common + ["Launch Statistics", "Shared Memory Configuration Size", "byte",
                      "65,536"],
            common + ["Occupancy", "Achieved Occupancy", "%", "n/a"],
            common + ["Instruction Statistics", "Executed Instructions", "inst",
                      f"{instructions:,}"],
            common + ["Instruction Statistics", "Issue Slots Busy", "%", str(issue)]]


def write_report(path, launches):
    text = io.StringIO()
    text.write("==PROF== Connected to process 1\nprofiled forward\n")
    writer = csv.writer(text, quoting=csv.QUOTE_ALL, lineterminator="\n")
    writer.writerow(HEADER)
    for rows in launches:
        writer.writerows(rows)
    path.write_text(text.getvalue())


def test_sums_launches_per_kernel_and_call_with_duration_weighted_throughputs(tmp_path):
    forward = "void (anonymous namespace)::im2col_kernel<float, 4>(Geometry, const T1 *)"
    report = tmp_path / "ncu.csv"
    write_report(report, [
        launch(0, "deform_conv2d forward", forward, 1000, 10.0, 60.0, 1_500_000, 40.0),
        launch(1, "deform_conv2d forward", forward, 3000, 30.0, 80.0, 2_500_000, 80.0),
        launch(2, "deform_conv2d backward", forward, 2000, 50.0, 40.0),
        launch(3, "", forward, 5000, 90.0, 90.0),  # outside every range: not a profiled call
    ])
    output = tmp_path / "ncu.json"
    assert ncu_summary.main([str(report), str(output), "--gpu", "Test GPU"]) == 0
    summary = json.loads(output.read_text())
    assert summary["setup"]["gpu"] == "Test GPU"
    first, second = summary["kernels"]
    assert (first["call"], first["kernel"]) == ("deform_conv2d forward", "im2col_kernel<float, 4>")
    assert first["launches"] == 2
    assert first["duration_seconds"] == pytest.approx(4e-6)
    assert first["dram_throughput_percent"] == pytest.approx((10 * 1 + 30 * 3) / 4)
    assert first["sm_throughput_percent"] == pytest.approx((60 * 1 + 80 * 3) / 4)
    assert first["registers_per_thread"] == 62
    assert first["shared_memory_configuration_bytes"] == 65536
    assert first["executed_instructions"] == 4_000_000  # summed, not averaged
    assert first["issue_slots_busy_percent"] == pytest.approx((40 * 1 + 80 * 3) / 4)
    assert "warp_cycles_per_issued_instruction" not in first  # not in this report
    assert "achieved_occupancy_percent" not in first  # 'n/a' is no figure
    assert (second["call"], second["launches"]) == ("deform_conv2d backward", 1)
    assert second["dram_throughput_percent"] == pytest.approx(50.0)


def test_a_report_without_csv_rows_fails(tmp_path):
    report = tmp_path / "ncu.csv"
    report.write_text("==ERROR== Failed to initialize the profiler\n")
    assert ncu_summary.main([str(report), str(tmp_path / "ncu.json"), "--gpu", "x"]) == 1
