"""Fine-tuning's features, computed once and read at every epoch: kept in memory within a budget,
then spilled to files within another, then computed again at each use."""

import contextlib
import os
import shutil
import tempfile
import weakref

import numpy as np

from habitus.models.data.items import SparseRows

# what feature files leave free of the spill folder's disk: the larger of the two (the checkpoint
# written after training, and whatever else shares the volume, need it more than the spill does)
SPILL_RESERVE_BYTES = 1 << 30
SPILL_RESERVE_SHARE = 0.05


class Kept:
    """Arrays computed once by `make(*key)` and read many times (fine-tuning's features at every
    epoch): the first `memory_bytes` of them stay in memory; the next `disk_bytes` are written to
    files in a temporary folder (under `folder`) and read back at each use, so the process holds one
    such chunk at a time and the page cache the rest; any beyond are computed again at each use."""

    def __init__(self, make, memory_bytes: int, disk_bytes: int, folder: str | None = None):
        self.make, self.memory_bytes, self.disk_bytes, self.folder = make, memory_bytes, disk_bytes, folder
        self.memory: dict = {}
        self.files: dict = {}
        self.in_memory = self.on_disk = 0
        self._dir: str | None = None

    def get(self, key: tuple):
        if key in self.memory:
            return self.memory[key]
        if key in self.files:
            return load_arrays(self.files[key])
        arrays = self.make(*key)
        size = sum(a.nbytes for a in arrays if a is not None)
        if self.in_memory + size <= self.memory_bytes:
            self.memory[key] = arrays
            self.in_memory += size
        elif self.on_disk < self.disk_bytes and self.on_disk + (stored := stored_bytes(arrays)) <= self.disk_bytes:
            if self._room_for(stored) and self._spill(key, arrays):
                self.on_disk += stored
            else:  # a disk near its reserve, or full: spilling stops, the rest is computed again at each use
                self.disk_bytes = self.on_disk
        return arrays

    def _room_for(self, size: int) -> bool:
        """Whether writing `size` more bytes leaves the reserve free."""
        usage = shutil.disk_usage(self._dir or self.folder or tempfile.gettempdir())
        return usage.free - size >= max(SPILL_RESERVE_BYTES, SPILL_RESERVE_SHARE * usage.total)

    def _spill(self, key: tuple, arrays: tuple) -> bool:
        """Write `arrays` to a file of their own; False (the half-written file removed) on a full disk."""
        if self._dir is None:
            # in a given folder, named as habitus.models.storage.files names a writer's temporary copy: the next
            # run of the stage removes what a killed one left (storage.recover_tree)
            self._dir = (tempfile.mkdtemp(prefix="habitus-features-") if self.folder is None else
                         tempfile.mkdtemp(prefix=".features-", suffix=f".tmp-{os.getpid()}", dir=self.folder))
            weakref.finalize(self, shutil.rmtree, self._dir, True)
        path = os.path.join(self._dir, f"{len(self.files)}.npz")
        try:
            save_arrays(path, arrays)
        except OSError:
            with contextlib.suppress(OSError):
                os.remove(path)
            return False
        self.files[key] = path
        return True

    def close(self) -> None:
        """Forget the arrays and remove the files."""
        self.memory, self.files = {}, {}
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def _packs(a) -> bool:
    """Whether `a` is stored as a bit mask of its non-zero entries and their values: the feature
    matrices (float32 [rows, width], ~12% non-zero on the demo: 6.4 KB a row dense, 0.9 KB packed,
    so 1.75M entities' five cut-offs, ~55 GB dense, fit the 16 GB spill budget as ~8 GB)."""
    return isinstance(a, np.ndarray) and a.ndim == 2 and a.dtype == np.float32


def stored_bytes(arrays: tuple) -> int:
    """What save_arrays writes of `arrays` (their data, not the file's few headers)."""
    total = 0
    for a in arrays:
        if _packs(a):
            total += (a.size + 7) // 8 + 4 * np.count_nonzero(a.view(np.uint32))
        elif isinstance(a, SparseRows):
            total += a.indptr.nbytes + a.cols.nbytes + a.values.nbytes
        elif a is not None:
            total += a.nbytes
    return total


def save_arrays(path: str, arrays: tuple) -> None:
    """A tuple of arrays, SparseRows and Nones as one uncompressed .npz (no pickle). Float32 matrices
    are packed (_packs): their bits exactly, -0.0 and NaN included (a value is 'zero' only if all its
    bits are)."""
    out = {}
    for i, a in enumerate(arrays):
        if isinstance(a, SparseRows):
            out.update({f"{i}.indptr": a.indptr, f"{i}.cols": a.cols, f"{i}.values": a.values,
                        f"{i}.n_cols": np.asarray(a.n_cols)})
        elif _packs(a):
            bits = a.view(np.uint32)
            mask = bits != 0
            out.update({f"{i}.mask": np.packbits(mask, axis=None), f"{i}.bits": bits[mask],
                        f"{i}.shape": np.asarray(a.shape)})
        elif a is not None:
            out[f"{i}"] = a
    np.savez(path, n=np.asarray(len(arrays)), **out)


def _unpack(z, i: int) -> np.ndarray:
    shape = tuple(int(v) for v in z[f"{i}.shape"])
    mask = np.unpackbits(z[f"{i}.mask"], count=shape[0] * shape[1]).astype(bool).reshape(shape)
    bits = np.zeros(shape, np.uint32)
    bits[mask] = z[f"{i}.bits"]
    return bits.view(np.float32)


def load_arrays(path: str) -> tuple:
    with np.load(path, allow_pickle=False) as z:
        return tuple(SparseRows(z[f"{i}.indptr"], z[f"{i}.cols"], z[f"{i}.values"], int(z[f"{i}.n_cols"]))
                     if f"{i}.indptr" in z else _unpack(z, i) if f"{i}.mask" in z else z[f"{i}"] if f"{i}" in z
                     else None for i in range(int(z["n"])))


class Recomputed:
    """An iterable that computes its items again at every pass (for data too large to keep)."""

    def __init__(self, make):
        self.make = make

    def __iter__(self):
        return iter(self.make())

