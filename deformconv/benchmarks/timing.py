"""Timing and memory: steps of a forward or a forward and backward, their medians over
interleaved repeats (wall clock on the CPU, CUDA events on a GPU), their peak allocations, the
copy bandwidth of the memory roofline, and a busy core."""

import contextlib
import math
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List

import torch

def forward_step(run: Callable, tensors) -> Callable[[], None]:
    def step():
        with torch.no_grad():
            run(*tensors)

    return step


def forward_backward_step(run: Callable, tensors) -> Callable[[], None]:
    # Integer operands (multi-scale deformable attention's levels) take no gradient.
    leaves = [None if t is None else t.detach().clone().requires_grad_(t.is_floating_point())
              for t in tensors]
    grad = None

    def step():
        nonlocal grad
        for t in leaves:
            if t is not None:
                t.grad = None
        out = run(*leaves)
        if grad is None:
            grad = torch.ones_like(out)
        out.backward(grad)

    return step


# On CUDA a sample times a block of steps issued back to back, at least this long in all: the
# host then queues each step while the GPU runs the one before, as in a training loop, and a
# sample measures the GPU's time per step rather than the host's latency in launching one (a
# step that the host cannot feed as fast still measures the host).
CUDA_BLOCK_SECONDS = 2e-3
MOST_STEPS_PER_BLOCK = 64


def seconds_of(step: Callable[[], None], device: str, steps: int = 1) -> float:
    """Seconds per run of step, over `steps` runs in a row: by the wall clock on the CPU; on
    CUDA, whose kernels run asynchronously, between two events recorded on the current stream
    around them."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / steps
    start_time = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start_time) / steps


def steps_per_sample(step: Callable[[], None], device: str) -> int:
    """1 on the CPU, whose steps take far longer than timing them; on CUDA, enough steps for
    CUDA_BLOCK_SECONDS, judged by the fastest of three timed runs (the first run of a step can
    include one-time work, such as CUDA loading a kernel's module lazily)."""
    if device != "cuda":
        return 1
    once = min(seconds_of(step, device) for _ in range(3))
    return max(1, min(MOST_STEPS_PER_BLOCK, math.ceil(CUDA_BLOCK_SECONDS / max(once, 1e-9))))


def time_interleaved(steps: Dict[str, Callable[[], None]], repeats: int,
                     warmup: int, device: str = "cpu") -> Dict[str, float]:
    for _ in range(warmup):
        for step in steps.values():
            step()
    block = {name: steps_per_sample(step, device) for name, step in steps.items()}
    samples: Dict[str, List[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            samples[name].append(seconds_of(step, device, block[name]))
    return {name: statistics.median(values) for name, values in samples.items()}


def peak_bytes(step: Callable[[], None], device: str = "cpu") -> int:
    """Peak of live allocations during one run of step, over what was live before it (what the
    step allocates and returns included). On CUDA, from the caching allocator's statistics. On
    the CPU, from the profiler's record of every allocation and free on the calling thread, in
    the order they happened (not those on the worker threads of a parallel region, which do
    not carry the caller's profiler: in deformconv's forward, oneDNN's product for a window)."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    # The blocks that deformconv's CPU scratch pool keeps from earlier calls, let go, so that
    # the step's scratch counts as allocated by the step.
    torch.ops.deformconv._release_scratch()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as profiler:
        step()
    records = sorted((event for event in profiler.profiler.kineto_results.events()
                      if event.name() == "[memory]"), key=lambda event: event.start_ns())
    live = peak = 0
    for record in records:
        live += record.nbytes()
        peak = max(peak, live)
    return peak


def peak_forward_bytes(run: Callable, tensors, device: str = "cpu") -> int:
    """Peak of live allocations during one forward, the output included."""
    return peak_bytes(forward_step(run, tensors), device)


def peak_forward_backward_bytes(run: Callable, tensors, device: str = "cpu") -> int:
    """Peak of live allocations during one forward and backward from fresh leaves (their
    copies not counted): the output, its gradient, what autograd keeps and every gradient."""
    return peak_bytes(forward_backward_step(run, tensors), device)


def copy_bandwidth(device: str, repeats: int, warmup: int) -> dict:
    """The memory roofline's bandwidth, measured in the run: a device-to-device copy of a
    buffer far larger than any cache (1 GiB on a GPU, 256 MiB on the CPU), which reads and
    writes its size once each, so bytes per second = 2 x size / median time."""
    size = (1 << 30) if device == "cuda" else (256 << 20)
    source = torch.ones(size, dtype=torch.uint8, device=device)
    # Written once before the timing, so that no page is first touched inside it.
    target = torch.zeros_like(source)
    seconds = time_interleaved({"copy": lambda: target.copy_(source)}, repeats, warmup,
                               device)["copy"]
    return {"buffer_bytes": size, "median_seconds": seconds,
            "bytes_per_second": 2 * size / seconds}


@contextlib.contextmanager
def busy_core(enabled: bool):
    """With enabled, a separate Python process spinning for the duration (yielded; None
    otherwise): one core taken from the benchmark, as a data-loader worker or a second job
    takes it."""
    if not enabled:
        yield None
        return
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # let it be scheduled before the first timing
        yield spinner
    finally:
        spinner.kill()
        spinner.wait()
