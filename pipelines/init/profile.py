"""`habitus init`, what it reads: each table's profile from a bounded sample of rows (type, nulls,
distinct values, examples, columns one-to-one with another) and the events' volume and rhythm (rows
per month pushed down to the warehouse; entities and their typical gap from a bounded scan). Both go
through the connection's own resource, so they work on every connector."""

import re
from dataclasses import dataclass, field
from datetime import date, datetime

import pyarrow as pa
import pyarrow.compute as pc


# an ISO date or date-time written as text, with or without a zone
TEXT_TIME = re.compile(r"^\d{4}-\d{2}-\d{2}([ T]\d{2}:\d{2}(:\d{2}(\.\d+)?)?)?\s*(Z|UTC|[+-]\d{2}:?\d{2})?$")


@dataclass
class ColumnProfile:
    name: str
    type: pa.DataType
    rows: int
    nulls: int
    distinct: int
    examples: list = field(default_factory=list)

    @property
    def kind(self) -> str:
        t = self.type
        if pa.types.is_timestamp(t) or pa.types.is_date(t):
            return "time"
        if pa.types.is_boolean(t):
            return "bool"
        if pa.types.is_integer(t):
            return "int"
        if pa.types.is_floating(t) or pa.types.is_decimal(t):
            return "float"
        if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_dictionary(t):
            return "string"
        return "other"

    @property
    def text_time(self) -> bool:
        """Text whose values read as dates or times ('2026-03-01 09:12:00'): a time stored as a string."""
        return self.kind == "string" and bool(self.examples) and all(
            isinstance(v, str) and TEXT_TIME.match(v.strip()) for v in self.examples)

    @property
    def non_null(self) -> int:
        return self.rows - self.nulls

    @property
    def unique(self) -> bool:
        return self.non_null > 1 and self.distinct == self.non_null

    @property
    def id_like(self) -> bool:
        n = self.name.lower()
        return bool(re.search(r"(^|_)(id|key|code|uuid|sku|number|no)$", n)) or n.endswith("id")


@dataclass
class TableProfile:
    table: str
    rows: int  # rows sampled
    capped: bool  # the sample stopped at --sample rows
    columns: dict[str, ColumnProfile]
    time_range: dict[str, tuple] = field(default_factory=dict)
    one_to_one: list[tuple[str, str]] = field(default_factory=list)

    def times(self) -> list[ColumnProfile]:
        return [c for c in self.columns.values() if c.kind == "time" and c.non_null]


# the columns of habitus's own outputs (predictions written back to the warehouse, embeddings)
OUTPUT_COLUMNS = {"model_fingerprint", "as_of"}


def _scalar(t: pa.DataType) -> bool:
    return not (pa.types.is_nested(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t)
                or pa.types.is_fixed_size_binary(t) or pa.types.is_null(t))


def habitus_output(warehouse, table: str) -> bool:
    """A table habitus wrote itself (predictions.sink): its scores are outputs, never inputs."""
    return OUTPUT_COLUMNS <= set(warehouse.schema(table).names)


def read_sample(warehouse, table: str, limit: int) -> tuple[pa.Table, bool]:
    batches, n = [], 0
    reader = warehouse.read(table, batch_rows=min(limit, 65_536))
    try:
        for b in reader:
            batches.append(b)
            n += len(b)
            if n >= limit:
                return pa.Table.from_batches(batches).slice(0, limit), True
    finally:
        if hasattr(reader, "close"):
            reader.close()
    return (pa.Table.from_batches(batches) if batches else warehouse.schema(table).empty_table()), False


def profile_table(warehouse, table: str, sample_rows: int = 100_000) -> TableProfile:
    data, capped = read_sample(warehouse, table, sample_rows)
    cols = {}
    for name in data.column_names:
        col = data.column(name)
        if pa.types.is_dictionary(col.type):
            col = col.cast(col.type.value_type)
        if _scalar(col.type):
            distinct = pc.count_distinct(col, mode="only_valid").as_py() if len(col) else 0
            examples = pc.unique(col.drop_null().slice(0, 1000)).to_pylist()[:3] if len(col) else []
        else:  # lists, structs, maps: no distinct count (Arrow has no kernel); the model does not use them
            distinct, examples = -1, col.drop_null().slice(0, 3).to_pylist()
        cols[name] = ColumnProfile(name, data.schema.field(name).type, len(col), col.null_count, distinct, examples)
    prof = TableProfile(table, data.num_rows, capped, cols)
    for c in prof.times():
        try:
            prof.time_range[c.name] = warehouse.time_range(table, c.name)
        except Exception:  # a sample's min/max is the fallback
            prof.time_range[c.name] = (pc.min(data.column(c.name)).as_py(), pc.max(data.column(c.name)).as_py())
    # columns that carry the same information: equal distinct counts and as many distinct pairs
    candidates = [c for c in cols.values() if c.kind in ("string", "int") and 1 < c.distinct < c.non_null]
    for i, a in enumerate(candidates):
        for b in candidates[i + 1:]:
            if a.distinct == b.distinct:
                pairs = data.select([a.name, b.name]).drop_null().group_by([a.name, b.name]).aggregate([]).num_rows
                if pairs == a.distinct:
                    prof.one_to_one.append((a.name, b.name))
    return prof


@dataclass
class EventsVolume:
    """The events table's size and rhythm: counts pushed down to the warehouse (rows per month, time
    range) and, from the entity and time columns of up to `scan` rows, the entities and their gaps."""
    rows: int
    first: datetime | None
    last: datetime | None
    per_month: dict  # first day of each month -> rows
    entities: int
    scanned: int
    capped: bool  # the entity scan stopped at its limit: `entities` is a lower bound
    entity_ids: set = field(default_factory=set, repr=False)
    typical_gap_days: float | None = None  # median over repeat entities of their mean gap between active days
    repeat_entities: int = 0  # entities active on two days or more

    @property
    def days(self) -> float:
        if self.first is None or self.last is None:
            return 0.0
        return (self.last - self.first).total_seconds() / 86_400

    @property
    def per_month_mean(self) -> float:
        return self.rows / max(self.days / 30.44, 1e-9) if self.days else float(self.rows)


def scan_events(warehouse, table: str, entity: str, ts: str, scan_rows: int = 5_000_000) -> EventsVolume:
    """Counts per month and the time range from the warehouse; entities and their typical gap from a
    stream of the two columns (at most `scan_rows` rows: memory stays bounded)."""
    import numpy as np

    from habitus.resources.warehouses.sql import utc_naive

    counts = warehouse.partition_counts(table, ts, "month")
    per_month = {utc_naive(m).date() if isinstance(m, datetime) else m: n for m, (n, _) in sorted(counts.items())}
    first, last = (utc_naive(t) if isinstance(t, datetime) else
                   datetime(t.year, t.month, t.day) if isinstance(t, date) else t
                   for t in warehouse.time_range(table, ts))
    ents, times, n, capped = [], [], 0, False
    reader = warehouse.read(table, [entity, ts], batch_rows=65_536)
    try:
        for b in reader:
            b = b.slice(0, scan_rows - n)
            ents.append(pc.cast(b.column(0), pa.string()))
            t = b.column(1)
            unit = pa.timestamp("s", tz=getattr(t.type, "tz", None))  # a zone-aware time keeps its UTC instant
            times.append(pc.cast(pc.cast(t, unit, safe=False), pa.int64()))
            n += len(b)
            if n >= scan_rows:
                capped = True
                break
    finally:
        if hasattr(reader, "close"):
            reader.close()
    if not n:
        return EventsVolume(sum(per_month.values()), first, last, per_month, 0, 0, False)
    t = pa.table({"e": pa.chunked_array(ents), "t": pa.chunked_array(times)}).drop_null()
    ent = t.column("e").combine_chunks().dictionary_encode()
    codes = ent.indices.to_numpy().astype(np.int64)
    day = t.column("t").to_numpy() // 86_400
    day = day - day.min() if len(day) else day
    k = len(ent.dictionary)
    pairs = np.unique(codes * (1 << 24) + day)  # (entity, active day)
    pc_code, pc_day = pairs >> 24, pairs & ((1 << 24) - 1)
    active = np.bincount(pc_code, minlength=k)
    lo = np.full(k, np.iinfo(np.int64).max)
    hi = np.full(k, np.iinfo(np.int64).min)
    np.minimum.at(lo, pc_code, pc_day)
    np.maximum.at(hi, pc_code, pc_day)
    repeat = active >= 2
    gap = float(np.median((hi[repeat] - lo[repeat]) / (active[repeat] - 1))) if repeat.any() else None
    ids = set(ent.dictionary.to_pylist()) if k <= 5_000_000 else set()
    return EventsVolume(sum(per_month.values()), first, last, per_month, k, n, capped, ids, gap, int(repeat.sum()))
