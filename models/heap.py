"""The process's heap, bounded: glibc's malloc raises its mmap threshold each time a large block is
freed (up to 32 MB), so the chunks that training and scoring allocate and free over and over (features
of 4,096 entities, ~26 MB; a shard's columns) come from the heap, which fragments and is not given
back. The threshold is fixed at 4 MB: chunk-sized blocks get their own mapping and go back when freed,
while batch-sized ones (a 512-row batch of features is 3.2 MB) keep reusing the heap. A 128 KB
threshold bounded memory more but made every batch's tensors fresh mappings, page-faulted in again at
each step. Measured on bench/speed.py's 1m dataset, quiet machine, 16k fine-tuning, 2 epochs: dynamic
42.9 s / 1.97 GB, 128 KB 78.5 s / 1.28 GB, 4 MB 57.9 s / 1.70 GB; foundation 15.5 s (dynamic), 25.6 s
(128 KB); the same metrics to every digit (docs/speed.md)."""

import ctypes
import ctypes.util
import functools

M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)
MMAP_THRESHOLD_BYTES = 4 << 20  # a block at least this large gets its own mapping (glibc starts at 128 KB)


@functools.cache
def bound_heap() -> bool:
    """Fix glibc's mmap threshold at 4 MB for this process (a fixed value turns the dynamic one
    off), so large blocks go back to the system when freed. Once per process; False where the C
    library is not glibc (musl, macOS), which have no such threshold to fix."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError, TypeError):
        return False
