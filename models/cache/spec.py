"""What a cache is built from: the sources (TableInput), the encoding settings (CacheSpec) and their
fingerprints, and the column types inferred from a source's schema."""

from dataclasses import asdict, dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq

from habitus.models.storage.files import combine, file_fingerprint

CACHE_FORMAT = 3  # 3: zstd-compressed IPC buffers, narrow ids, times as offsets
ENTITY, TS = "entity", "ts"


class CacheError(ValueError):
    pass


@dataclass(frozen=True)
class TableInput:
    """One extracted source: its Parquet files and the columns to use with their types."""

    name: str
    files: list[str]
    columns: dict[str, str]  # column -> "categorical" | "numeric" | "timestamp"
    timestamp: str | None = None  # events only
    key: str | None = None  # attribute tables only: the event column they join on


@dataclass(frozen=True)
class CacheSpec:
    entity: str
    events: list[TableInput]
    entity_attributes: list[TableInput] = field(default_factory=list)
    attributes: list[TableInput] = field(default_factory=list)
    shard_events: int = 4_000_000

    def fingerprint(self) -> str:
        settings = asdict(self)
        for group in ("events", "entity_attributes", "attributes"):
            for t in settings[group]:
                t["files"] = [file_fingerprint(f) for f in sorted(t["files"])]
        return combine(CACHE_FORMAT, settings)

    def settings_fingerprint(self) -> str:
        """The encoding settings without the data: versions with equal settings can share ids."""
        settings = asdict(self)
        for group in ("events", "entity_attributes", "attributes"):
            for t in settings[group]:
                del t["files"]
        settings.pop("shard_events")
        return combine(CACHE_FORMAT, settings)

    def file_prints(self) -> dict[str, dict[str, str]]:
        """source -> {file: content fingerprint}: what a later build compares to find new files.
        Files without rows are left out: a partition extracted before its data landed (a day in the
        future) becomes a new file, not a changed one, when it gets rows."""
        return {t.name: {f: file_fingerprint(f) for f in sorted(t.files) if pq.read_metadata(f).num_rows}
                for t in self.events + self.entity_attributes + self.attributes}


def infer_column_type(arrow_type: pa.DataType, name: str) -> str:
    """Strings, booleans and integer ids are categories; other numbers are numeric; times are timestamps."""
    if pa.types.is_timestamp(arrow_type) or pa.types.is_date(arrow_type):
        return "timestamp"
    if pa.types.is_floating(arrow_type) or pa.types.is_decimal(arrow_type):
        return "numeric"
    if pa.types.is_integer(arrow_type):
        lowered = name.lower()
        return "categorical" if lowered.endswith(("id", "_key", "code")) else "numeric"
    return "categorical"
