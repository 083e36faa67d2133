"""MovieLens-100k for bench/quality.py: 943 users, 1,682 movies, 100,000 ratings (1997-09-20 to
1998-04-22), read from the `recbole==1.2.1` wheel, which ships it as an example dataset.

The wheel is downloaded once (`pip download --no-deps`) into ~/.cache/habitus (or
$XDG_CACHE_HOME/habitus) and read in place; the data never enters the repository. Its three files
are tab-separated with `name:type` headers:

    ml-100k.inter  user_id  item_id  rating  timestamp (seconds)
    ml-100k.item   item_id  movie_title  release_year  class (genres, space-separated)
    ml-100k.user   user_id  age  gender  occupation  zip_code

Written as the three sources habitus reads (events, entity attributes, item attributes): a rating
is an event of its user, each movie's first genre is its `genre` (the propensity labels), zip codes
are left out (795 values for 943 users: an id, not an attribute).
"""

import calendar
import datetime as dt
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from habitus.models.cache import CacheSpec, TableInput

WHEEL = "recbole==1.2.1"
MEMBER = "recbole/dataset_example/ml-100k/ml-100k.{}"
TEST_CUTOFF = dt.date(1998, 4, 1)
WINDOW_DAYS = 14
LABELS = 10  # propensity over the 10 most frequent first genres


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "habitus"


def wheel_path(folder: Path | None = None) -> Path:
    """The recbole wheel in the cache folder, downloaded there first if missing."""
    folder = folder or cache_dir()
    found = sorted(folder.glob("recbole-1.2.1-*.whl"))
    if not found:
        folder.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL, "-d", str(folder)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(folder.glob("recbole-1.2.1-*.whl"))
        if done.returncode or not found:
            sys.exit(f"could not download {WHEEL} into {folder} ({' '.join(cmd)}): {done.stderr.strip()[-500:]}")
    return found[-1]


def read_table(wheel: Path, ext: str) -> dict[str, list[str]]:
    """One of the wheel's ml-100k files as columns of text, named without their `:type` suffix."""
    with zipfile.ZipFile(wheel) as z:
        lines = z.read(MEMBER.format(ext)).decode("utf-8", errors="replace").splitlines()
    names = [h.split(":")[0] for h in lines[0].split("\t")]
    columns: dict[str, list[str]] = {n: [] for n in names}
    for line in lines[1:]:
        if not line:
            continue
        values = line.split("\t")
        for n, v in zip(names, values + [""] * (len(names) - len(values))):
            columns[n].append(v)
    return columns


def write_sources(wheel: Path, folder: Path) -> dict[str, Path]:
    """events / users / movies as Parquet files in `folder`."""
    inter, items, users = (read_table(wheel, e) for e in ("inter", "item", "user"))
    events = pa.table({
        "user_id": pa.array(inter["user_id"]),
        "ts": pa.array([int(float(t)) for t in inter["timestamp"]], pa.int64()).cast(pa.timestamp("s")),
        "item_id": pa.array(inter["item_id"]),
        "rating": pa.array([float(r) for r in inter["rating"]], pa.float64()),
    })
    movies = pa.table({
        "item_id": pa.array(items["item_id"]),
        "genre": pa.array([c.split(" ")[0] if c.strip() else None for c in items["class"]]),
        "release_year": pa.array([y or None for y in items["release_year"]]),
    })
    people = pa.table({
        "user_id": pa.array(users["user_id"]),
        "age": pa.array([float(a) for a in users["age"]], pa.float64()),
        "gender": pa.array(users["gender"]),
        "occupation": pa.array(users["occupation"]),
    })
    paths = {}
    for name, table in (("ratings", events), ("users", people), ("movies", movies)):
        paths[name] = folder / f"{name}.parquet"
        pq.write_table(table, paths[name])
    return paths


def movielens_spec(folder: Path) -> tuple[CacheSpec, int, dict]:
    """The sources, the test cut-off (1998-04-01) and the protocol's parameters, as bench/quality.py
    builds them for every dataset. Next items (the movies rated in the 14 days after a cut-off) fits
    this data; spend does not (there is no money, and a sum of ratings is not one)."""
    paths = write_sources(wheel_path(), folder)
    spec = CacheSpec(
        "user_id",
        [TableInput("ratings", [str(paths["ratings"])], {"item_id": "categorical", "rating": "numeric"},
                    timestamp="ts")],
        [TableInput("users", [str(paths["users"])], {"age": "numeric", "gender": "categorical",
                                                     "occupation": "categorical"})],
        [TableInput("movies", [str(paths["movies"])], {"genre": "categorical", "release_year": "categorical"},
                    key="item_id")])
    test_cutoff = calendar.timegm(TEST_CUTOFF.timetuple())
    return spec, test_cutoff, {"window": WINDOW_DAYS, "label_column": "genre", "labels": LABELS, "items": "item_id",
                               "spend": None}
