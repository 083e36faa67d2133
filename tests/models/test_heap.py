"""models/storage/heap.py: with glibc's mmap threshold fixed, chunk-sized arrays freed between small live ones
go back to the system; with the dynamic threshold they stay in a fragmented heap."""

import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys
import numpy as np
sys.path.insert(0, {root!r})
from habitus.models.storage.heap import bound_heap
if sys.argv[1] == "bound":
    assert bound_heap()
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
big = np.ones(2 << 20)  # a 16 MB block, freed: glibc's dynamic threshold (at most 32 MB) rises above the chunks below
del big
before = rss()
chunks, small = [], []
for _ in range(20):
    chunks.append(np.ones(1 << 20))  # 8 MB, every page touched
    small.append(np.ones(2000))  # a small array that outlives the chunks, between them on the heap
del chunks
print(rss() - before)
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_freed_chunks_leave_the_process_only_with_the_bound():
    def held(mode):
        out = subprocess.run([sys.executable, "-c", SCRIPT.format(root=str(ROOT)), mode], capture_output=True,
                             text=True, check=True)
        return int(out.stdout.strip())

    assert held("dynamic") > 100 << 20  # the 160 MB of chunks stay resident
    assert held("bound") < 20 << 20


KEEP = """
import sys
import numpy as np
sys.path.insert(0, {root!r})
from habitus.models.storage import heap
assert heap.bound_heap() and heap._fixed == 4 << 20
if sys.argv[1] == "keep":
    assert heap.keep_on_heap(16 << 20) and heap._fixed == 17 << 20
    heap.bound_heap.cache_clear()
    assert heap.bound_heap() and heap._fixed == 17 << 20  # never lowered
block = np.ones(2 << 20)  # a training step's gradient of a [16,000, 256] weight (16 MB)
at = block.ctypes.data
lo, hi = next([int(a, 16) for a in line.split()[0].split("-")] for line in open("/proc/self/maps")
              if line.rstrip().endswith("[heap]"))
print(int(lo <= at < hi))
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_a_step_sized_block_comes_from_the_heap_once_kept():
    """Bound at 4 MB, a 16 MB block is a mapping of its own (faulted in again at every step of a wide
    head); kept, it comes from the heap and its pages are reused."""
    def on_heap(mode):
        out = subprocess.run([sys.executable, "-c", KEEP.format(root=str(ROOT)), mode], capture_output=True,
                             text=True, check=True)
        return out.stdout.strip() == "1"

    assert not on_heap("bound")
    assert on_heap("keep")


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_the_threshold_asked_for_is_clamped_to_glibcs_largest():
    out = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
                          "from habitus.models.storage import heap\nheap.keep_on_heap(1 << 30); print(heap._fixed)"],
                         capture_output=True, text=True, check=True)
    assert int(out.stdout) == 32 << 20


REUSE = """
import resource
import sys
import numpy as np
sys.path.insert(0, {root!r})
from habitus.models.storage.heap import bound_heap
assert bound_heap()
keep = np.ones(1000)  # (something live below, as in any process)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(100):
    block = np.ones(1 << 18)  # 2 MB, under the mmap threshold: from the top of the heap, freed at once
    del block
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_a_block_freed_at_the_top_of_the_heap_is_reused_not_faulted_in_again():
    """Fixing the mmap threshold fixes the trim threshold too, at 128 KB unless raised with it: then
    every 2 MB block freed at the top of the heap went back to the system and its 512 pages were
    faulted in again by the next one (100 blocks: ~51,000 faults; reused: ~512)."""
    out = subprocess.run([sys.executable, "-c", REUSE.format(root=str(ROOT))], capture_output=True, text=True,
                         check=True)
    assert int(out.stdout) < 5_000
