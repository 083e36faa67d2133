"""The process's heap, bounded: glibc's malloc raises its mmap threshold each time a large block is
freed (up to 32 MB), so the chunks that training and scoring allocate and free over and over (features
of 4,096 entities, ~26 MB; a shard's columns) come from the heap, which fragments and is not given
back. The 16k fine-tuning at 1M events, 2 epochs: peak 1.84 -> 1.21 GB with a fixed 128 KB threshold,
the same metric to every digit, no slower (docs/speed.md)."""

import ctypes
import ctypes.util
import functools

M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)
MMAP_THRESHOLD_BYTES = 128 << 10  # glibc's initial value, kept: a block at least this large gets its own mapping


@functools.cache
def bound_heap() -> bool:
    """Fix glibc's mmap threshold at 128 KB for this process (a fixed value turns the dynamic one
    off), so large blocks go back to the system when freed. Once per process; False where the C
    library is not glibc (musl, macOS), which have no such threshold to fix."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError, TypeError):
        return False
