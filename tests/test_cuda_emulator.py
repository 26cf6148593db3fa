"""The CUDA emulator itself (tests/cuda_emulation): it refuses the launches the CUDA runtime
refuses, runs every thread of a valid one, exchanges values between lanes at warp shuffles,
orders shared memory at block and warp barriers, and refuses what a GPU could not complete (a
shuffle or a barrier that waits for a thread that has left)."""

import pytest

from emulation import FORWARD, REVERSE, SHUFFLED, set_emulator

pytestmark = pytest.mark.usefixtures("emulator_settings")


@pytest.mark.parametrize("blocks,threads", [(0, 256), (1, 0), (1, 1025), (2 ** 31, 1)])
def test_emulator_refuses_what_the_runtime_refuses(emulated, blocks, threads):
    with pytest.raises(RuntimeError, match="invalid configuration argument"):
        emulated.probe_launch(blocks, threads)
    launches, checks, _, _, invalid, _ = emulated.take_bookkeeping()
    assert (launches, checks, invalid) == (1, 1, 1)


def test_emulator_runs_every_thread_of_a_valid_launch(emulated):
    assert emulated.probe_launch(3, 5) == 15
    assert emulated.probe_launch(1, 1024) == 1024
    # A grid cap runs fewer blocks than launched: only kernels with grid-stride loops, as all
    # of the project's are, give the same results under it.
    set_emulator(emulated, grid_cap=2)
    assert emulated.probe_launch(3, 5) == 10


def test_emulator_exchanges_shuffled_values_between_lanes(emulated):
    full = 0xFFFFFFFF
    # Every lane of two warps swaps with its neighbour.
    assert emulated.probe_shuffle_xor(64, full, 1, 32, -1) == [t ^ 1 for t in range(64)]
    # Groups of 8 lanes may read earlier groups; a source in a later group gives the lane its
    # own value.
    assert emulated.probe_shuffle_xor(32, full, 8, 8, -1) == [
        t ^ 8 if t & 8 else t for t in range(32)]
    assert emulated.probe_shuffle_xor(32, full, 4, 8, -1) == [t ^ 4 for t in range(32)]
    # Only the lanes of the mask take part; the others exit at once.
    received = emulated.probe_shuffle_xor(32, 0x0000FF00, 2, 32, -1)
    assert received == [t ^ 2 if 8 <= t < 16 else -1 for t in range(32)]
    assert emulated.take_bookkeeping()[4] == 0  # no invalid launch


@pytest.mark.parametrize("member_mask,lane_mask,exiting_thread,message", [
    (0xFFFFFFFF, 1, 5, "waits for lane 5, which has exited"),  # would hang on a GPU
    (0x0000FFFF, 16, -1, "reads lane 16, outside the mask"),
])
def test_emulator_refuses_shuffles_that_a_gpu_cannot_complete(
        emulated, member_mask, lane_mask, exiting_thread, message):
    with pytest.raises(RuntimeError, match=message):
        emulated.probe_shuffle_xor(32, member_mask, lane_mask, 32, exiting_thread)
    assert emulated.take_bookkeeping()[4] == 1


@pytest.mark.parametrize("thread_order", [FORWARD, REVERSE, SHUFFLED])
def test_emulator_barrier_orders_shared_memory_across_warps(emulated, thread_order):
    # Each thread reads what its right neighbour wrote before the barrier; in forward order
    # thread 0 reaches its read before thread 1 has written, unless the barrier holds it.
    set_emulator(emulated, thread_order=thread_order, seed=3)
    assert emulated.probe_barrier(96, -1) == [10 * ((t + 1) % 96) for t in range(96)]
    assert emulated.take_bookkeeping()[4] == 0


def test_emulator_refuses_a_barrier_that_a_thread_has_left(emulated):
    with pytest.raises(RuntimeError, match="thread 40 has exited while others wait"):
        emulated.probe_barrier(64, 40)
    assert emulated.take_bookkeeping()[4] == 1


@pytest.mark.parametrize("thread_order", [FORWARD, REVERSE, SHUFFLED])
def test_emulator_warp_barrier_orders_shared_memory_within_a_warp(emulated, thread_order):
    # Each lane reads what the next lane of its warp wrote before the __syncwarp.
    set_emulator(emulated, thread_order=thread_order, seed=5)
    assert emulated.probe_warp_barrier(64, -1, -1) == [
        10 * (t // 32 * 32 + (t + 1) % 32) for t in range(64)]
    assert emulated.take_bookkeeping()[4] == 0


def test_emulator_refuses_a_warp_barrier_that_a_lane_has_left(emulated):
    with pytest.raises(RuntimeError, match="waits for lane 7, which has exited"):
        emulated.probe_warp_barrier(64, 39, -1)
    assert emulated.take_bookkeeping()[4] == 1


def test_emulator_refuses_a_shuffle_met_at_a_warp_barrier(emulated):
    # Lane 0 of the first warp shuffles while its other lanes wait at a __syncwarp.
    with pytest.raises(RuntimeError, match="waits at another shuffle or barrier"):
        emulated.probe_warp_barrier(32, -1, 0)
    assert emulated.take_bookkeeping()[4] == 1
