"""What the fsync before and after each commit (models/storage/files.py) costs, against the same commits
without it, in one run, alternating the two.

    .venv/bin/python bench/durability.py [--repeats 7] [--folder /path/on/the/workspace/disk]

Rows: a manifest (write_json), a 64 MB checkpoint file, and a cache-like folder of 40 files of 1 MB.
Run it on the disk the workspace lives on: the cost is the disk's, not Python's.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import habitus.models.storage.files as storage  # noqa: E402


def _manifest(folder: Path) -> None:
    storage.write_json(folder / "manifest.json", {"shards": [{"rows": i, "files": [f"shard-{i:05d}.arrow"]}
                                                             for i in range(200)]})


def _checkpoint(folder: Path, blob=os.urandom(64 << 20)) -> None:
    with storage.atomic_path(folder / "model.safetensors") as tmp:
        tmp.write_bytes(blob)


def _cache_folder(folder: Path, blob=os.urandom(1 << 20)) -> None:
    with storage.atomic_path(folder / "cache-version") as tmp:
        tmp.mkdir()
        for i in range(40):
            (tmp / f"shard-{i:05d}.arrow").write_bytes(blob)


def _timed(fn, folder: Path, durable: bool) -> float:
    real = storage.fsync
    if not durable:
        storage.fsync = lambda path: None
    try:
        started = time.perf_counter()
        fn(folder)
        return time.perf_counter() - started
    finally:
        storage.fsync = real


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--folder", help="where to write (default: a temporary folder)")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.folder) as tmp:
        folder = Path(tmp)
        for name, fn in (("manifest (write_json)", _manifest), ("checkpoint file, 64 MB", _checkpoint),
                         ("cache folder, 40 x 1 MB", _cache_folder)):
            with_sync, without = [], []
            for _ in range(args.repeats):
                without.append(_timed(fn, folder, durable=False))
                with_sync.append(_timed(fn, folder, durable=True))
            rows.append((name, statistics.median(without), statistics.median(with_sync)))
    print(f"\n{'commit':<26} {'no fsync ms':>12} {'fsync ms':>10} {'ratio':>7}   (medians of {args.repeats})")
    for name, a, b in rows:
        print(f"{name:<26} {a * 1e3:>12.2f} {b * 1e3:>10.2f} {b / a:>7.2f}")


if __name__ == "__main__":
    main()
