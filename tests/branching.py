"""Helpers of the tests that force the paths of the drivers and launchers: the branch trace
(Note [Branch trace] in csrc/infrastructure/branch_trace.h), thread counts, the oneDNN switch,
and the tolerances of a dtype against float64."""

import itertools
from contextlib import contextmanager

import torch


@contextmanager
def branch_trace(ops=None):
    """Yields a set that holds, on exit, the names of the branches that ran inside."""
    ops = torch.ops.deformconv if ops is None else ops
    taken = set()
    ops._start_branch_trace()
    try:
        yield taken
    finally:
        taken.update(ops._take_branch_trace())


@contextmanager
def threads(count):
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def vector_bytes():
    """The width of the vectors of the CPU kernels' clone that runs here, as traced."""
    with branch_trace() as taken:
        torch.ops.deformconv.dcnv3(torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 2),
                                   torch.ones(1, 1, 1, 1), 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1.0, 0,
                                   False)
    widths = [name for name in taken if name.startswith("cpu.vectors.")]
    assert len(widths) == 1, taken
    return int(widths[0].removeprefix("cpu.vectors.").removesuffix("bytes"))


def opmath_bytes(dtype):
    return 8 if dtype == torch.float64 else 4


# The CUDA launchers that share a sample's channels among a warp's lanes (DCN v2's im2col,
# dcnv3_cuda.cu, ms_deform_attn_cuda.cu): launch.cuh's warp and block, and the shared memory of
# their staged samples (kStagedBytesPerBlock of channel_vectors.cuh).
CUDA_WARP = 32
CUDA_THREADS_PER_BLOCK = 256
CUDA_STAGED_BYTES = 8 * 1024


def cuda_lane_paths(channels, dtype, aligned, backward, staged_sample_bytes, samples):
    """The paths those launchers take, from their tiling: whether the channels go in vectors
    (16 bytes of the dtype forward, of the float32 or float64 sums backward, where the channels
    and the alignment allow) rather than one at a time; whether a warp's lanes take them in
    several passes (more than 32 vectors); whether an item's `samples` samples are staged in
    several rounds (more than shared memory holds for a block's items)."""
    wide = 16 // (opmath_bytes(dtype) if backward else dtype.itemsize)
    width = wide if aligned and channels % wide == 0 else 1
    vectors = channels // width
    lanes = 1
    while lanes < vectors and lanes < CUDA_WARP:
        lanes *= 2
    staged = max(CUDA_STAGED_BYTES // staged_sample_bytes, CUDA_THREADS_PER_BLOCK)
    return (width > 1, -(-vectors // lanes) > 1,
            staged // (CUDA_THREADS_PER_BLOCK // lanes) < samples)


def shared_sample_bytes(dtype):
    """sizeof(SharedSample<opmath_t>), which the DCN v2 and DCNv3 kernels stage: an int64, an
    int and 7 values, 8-byte aligned."""
    return 40 if opmath_bytes(dtype) == 4 else 72


def misaligned(tensor):
    """The same values, contiguous, one element past a 16-byte boundary."""
    storage = torch.empty(tensor.numel() + 1, dtype=tensor.dtype)
    shifted = storage[1:].view(tensor.shape)
    shifted.copy_(tensor)
    return shifted


def channel_loops(stage, count, widths):
    """The names record_channel_loops gives the loops that run over `count` channels taken
    `widths` at a time, widest first, then one by one."""
    names, left = set(), count
    for width in widths:
        if left >= width:
            names.add(f"{stage}.{width}x")
            left %= width
    if left:
        names.add(f"{stage}.1x")
    return names


def requested_subsets(count):
    """Every non-empty combination of `count` flags, as tuples of bools."""
    return [flags for flags in itertools.product((False, True), repeat=count) if any(flags)]


# A dtype's error against float64 on the same (rounded) operands, relative to the largest
# value of the expected tensor: what the arithmetic at that precision allows.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 2e-2,
             torch.bfloat16: 1e-1}


def assert_close_at(actual, expected, dtype, what):
    scale = max(expected.abs().max().item(), 1.0)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tolerance,
                               atol=tolerance * scale, msg=lambda m: f"{what}: {m}")
