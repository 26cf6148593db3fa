"""The emulator's settings (tests/cuda_emulation): the order in which it runs blocks and threads,
its grid cap, the current stream the tests set, the window budget and the index width it lets
the launchers take."""

FORWARD, REVERSE, SHUFFLED = 0, 1, 2
STREAM = 7  # the current stream the tests set; every launch must be on it


def set_emulator(emulated, *, block_order=FORWARD, thread_order=FORWARD, grid_cap=0, seed=0,
                 columns_tile_bytes=0, wide_indices=False):
    emulated.configure(block_order, thread_order, grid_cap, seed, STREAM, columns_tile_bytes,
                       wide_indices)
