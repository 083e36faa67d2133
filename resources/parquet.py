"""Parquet files as a warehouse: `<path>/<table>.parquet` or a folder `<path>/<table>/` (hive-style
partitions allowed). Projection and time filter are pushed into the dataset scan."""

import os
from datetime import datetime
from pathlib import Path
from typing import Iterable, Iterator

import dagster as dg
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from resources.duckdb import WarehouseError


class ParquetWarehouse(dg.ConfigurableResource):
    path: str

    def _dataset(self, table: str) -> ds.Dataset:
        base = Path(self.path)
        for candidate in (base / f"{table}.parquet", base / table):
            if candidate.exists():
                return ds.dataset(str(candidate), format="parquet", partitioning="hive")
        raise WarehouseError(f"table {table!r} not found: neither {base / (table + '.parquet')} nor the folder "
                             f"{base / table} exists")

    def schema(self, table: str) -> pa.Schema:
        return self._dataset(table).schema

    def time_range(self, table: str, time_column: str):
        col = self._dataset(table).to_table(columns=[time_column]).column(0)
        import pyarrow.compute as pc

        mm = pc.min_max(col)
        return mm["min"].as_py(), mm["max"].as_py()

    def read(self, table: str, columns: list[str] | None = None, time_column: str | None = None,
             start: datetime | None = None, end: datetime | None = None,
             batch_rows: int = 1 << 17) -> Iterator[pa.RecordBatch]:
        data = self._dataset(table)
        flt = None
        if time_column is not None:
            field = ds.field(time_column)
            typ = data.schema.field(time_column).type
            if start is not None:
                flt = field >= pa.scalar(start, pa.timestamp("us")).cast(typ)
            if end is not None:
                cond = field < pa.scalar(end, pa.timestamp("us")).cast(typ)
                flt = cond if flt is None else flt & cond
        yield from data.to_batches(columns=columns, filter=flt, batch_size=batch_rows)

    def write(self, table: str, batches: Iterable[pa.RecordBatch], schema: pa.Schema,
              replace: tuple[str, object] | None = None) -> int:
        """One file per replaced value: `<path>/<table>/<column>=<value>.parquet`, written whole."""
        folder = Path(self.path) / table
        folder.mkdir(parents=True, exist_ok=True)
        name = f"{replace[0]}={_safe(replace[1])}.parquet" if replace else "part.parquet"
        tmp = folder / f".{name}.tmp-{os.getpid()}"
        rows = 0
        with pq.ParquetWriter(tmp, schema) as w:
            for b in batches:
                w.write_batch(b)
                rows += len(b)
        os.replace(tmp, folder / name)
        return rows


def _safe(value) -> str:
    text = value.strftime("%Y-%m-%dT%H%M%S") if isinstance(value, datetime) else str(value)
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text)
