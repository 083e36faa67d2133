"""The process's heap, bounded: glibc's malloc raises its mmap threshold each time a large block is
freed (up to 32 MB), so the chunks that training and scoring allocate and free over and over (features
of 4,096 entities, ~26 MB; a shard's columns) come from the heap, which fragments and is not given
back. The threshold is fixed at 4 MB: chunk-sized blocks get their own mapping and go back when freed,
while batch-sized ones (a 512-row batch of features is 3.2 MB) keep reusing the heap. A 128 KB
threshold bounded memory more but made every batch's tensors fresh mappings, page-faulted in again at
each step. Measured on bench/speed.py's 1m dataset, quiet machine, 16k fine-tuning, 2 epochs: dynamic
42.9 s / 1.97 GB, 128 KB 78.5 s / 1.28 GB, 4 MB 57.9 s / 1.70 GB; foundation 15.5 s (dynamic), 25.6 s
(128 KB); the same metrics to every digit (docs/journal/speed.md)."""

import ctypes
import ctypes.util
import functools

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MMAP_THRESHOLD_BYTES = 4 << 20  # a block at least this large gets its own mapping (glibc starts at 128 KB)
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's largest on 64-bit systems


_fixed = 0  # the threshold this process fixed (0: glibc's dynamic one)


@functools.cache
def bound_heap() -> bool:
    """Fix glibc's mmap threshold at 4 MB for this process (a fixed value turns the dynamic one
    off), so large blocks go back to the system when freed. Once per process; False where the C
    library is not glibc (musl, macOS), which have no such threshold to fix."""
    return _threshold(MMAP_THRESHOLD_BYTES)


def keep_on_heap(nbytes: int) -> bool:
    """Raise the threshold (at most to glibc's 32 MB) so that blocks of `nbytes` come from the heap: a
    training step's gradient of its largest weight (a 16,000-label head's [16,000, 256], 16 MB) was
    otherwise a fresh mapping at every step, its zero pages faulted in each time. The 16k fine-tuning
    at 1M events: 42.9 s -> 34.9 s (system CPU 22 s -> 8 s), peak 1.53 -> 1.62 GB, the same model to
    every digit (docs/journal/speed.md). Chunk-sized blocks above the new threshold still go back when freed."""
    return _threshold(min(max(int(nbytes) + (1 << 20), MMAP_THRESHOLD_BYTES), MMAP_THRESHOLD_MAX))


def _threshold(nbytes: int) -> bool:
    """Fix the threshold at `nbytes` unless this process fixed a higher one (never lowered), and the
    trim threshold at twice that, as glibc's dynamic rule keeps it. Fixing one fixes both, and the
    trim threshold stayed at its 128 KB start: every block over 128 KB freed at the top of the heap
    (a batch's activations, a block of item scores) went back to the system and was page-faulted in
    again by the next allocation. 1M-item scoring, [1,024 x 512] blocks: 583 -> 2,638 rows/s."""
    global _fixed
    if nbytes <= _fixed:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        ok = bool(libc.mallopt(M_MMAP_THRESHOLD, nbytes)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2 * nbytes))
    except (OSError, AttributeError, TypeError):
        return False
    if ok:
        _fixed = nbytes
    return ok
