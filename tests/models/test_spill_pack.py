"""models/train/spill.py stores feature matrices packed (a bit mask of the non-zero entries and their bits):
what lets 100M events' fine-tuning features fit the spill budget."""

import os

import numpy as np

from habitus.models.train import spill


def test_a_feature_matrix_comes_back_bit_for_bit_and_smaller(tmp_path):
    rng = np.random.default_rng(0)
    x = np.where(rng.random((300, 97)) < 0.1, rng.normal(size=(300, 97)), 0).astype(np.float32)
    x[0, :4] = [-0.0, np.nan, np.inf, 1e-45]  # signed zero, NaN, infinity and a denormal keep their bits
    other = np.arange(7, dtype=np.float64)
    path = str(tmp_path / "a.npz")
    spill.save_arrays(path, (x, None, other, x[:0]))
    back, none, other2, empty = spill.load_arrays(path)
    assert back.dtype == np.float32 and back.shape == x.shape and np.array_equal(back.view(np.uint32), x.view(np.uint32))
    assert none is None and np.array_equal(other2, other) and empty.shape == (0, 97)
    nonzero = np.count_nonzero(x.view(np.uint32))
    assert spill.stored_bytes((x,)) == (x.size + 7) // 8 + 4 * nonzero < x.nbytes / 4
    assert os.path.getsize(path) < x.nbytes / 3


def test_the_disk_budget_counts_the_packed_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(spill, "SPILL_RESERVE_BYTES", 0)
    monkeypatch.setattr(spill, "SPILL_RESERVE_SHARE", 0.0)
    sparse = np.zeros((100, 100), np.float32)
    sparse[:, 0] = 1.0  # 40,000 bytes dense, 1,250 + 400 packed
    made = []

    def make(i):
        made.append(i)
        return (sparse + i,) if i == 9 else (sparse,)

    kept = spill.Kept(make, memory_bytes=0, disk_bytes=10_000, folder=str(tmp_path))
    for i in range(6):
        kept.get((i,))
    assert len(kept.files) == 6 and kept.on_disk == 6 * 1_650  # dense, not one would have fitted
    assert kept.get((9,))[0][0, 1] == 9 and (9,) not in kept.files  # dense once 9 is added everywhere: too big
    assert all((kept.get((i,))[0] == sparse).all() for i in range(6)) and made == [0, 1, 2, 3, 4, 5, 9]
    kept.close()
