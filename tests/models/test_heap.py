"""models/heap.py: with glibc's mmap threshold fixed, chunk-sized arrays freed between small live ones
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
from models.heap import bound_heap
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
