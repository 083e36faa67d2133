"""Parquet files as a warehouse: `<path>/<table>.parquet` or a folder `<path>/<table>/` (hive-style
partitions allowed). Projection and time filter are pushed into the dataset scan."""

import contextlib
import os
import re
import uuid
from datetime import datetime
from pathlib import Path
from typing import Iterable, Iterator

import dagster as dg
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from habitus.models.storage.files import durable_replace
from habitus.resources.warehouses.errors import AUTH, WarehouseError, network_error, tables_there
from habitus.resources.warehouses.sql import utc_naive

# pyarrow's S3 errors carry the AWS SDK's error name; these may pass when retried (the transport or a
# busy or restarting service), the others (access denied, a bad key or signature, no such bucket) do not.
S3_TRANSIENT = re.compile(r"NETWORK_CONNECTION|SERVICE_UNAVAILABLE|SLOW_DOWN|THROTTLING|INTERNAL_FAILURE|"
                          r"REQUEST_TIMEOUT|REQUEST_TIME_TOO_SKEWED|curlCode: (?:7|18|28|52|55|56)\b|"
                          r"Couldn't connect|Connection (?:refused|reset)|Broken pipe|timed out|Unexpected end of stream|"
                          r"Transferred a partial file|Empty reply", re.IGNORECASE)
S3_PERMANENT = re.compile(r"ACCESS_DENIED|INVALID_ACCESS_KEY_ID|SIGNATURE_DOES_NOT_MATCH|NO_SUCH_BUCKET|"
                          r"NO_SUCH_KEY|RESOURCE_NOT_FOUND|INVALID_PARAMETER|HTTP response code: 40[0-9]")


def transient(exc: BaseException) -> bool:
    """Whether an error of pyarrow's S3 client (an OSError carrying the AWS SDK's error) may pass when
    retried: a network failure (curl could not connect, the connection reset or the body cut short) or a
    5xx / throttling answer. Permanent: access denied, a bad key or signature, a missing bucket or key,
    any other 4xx; and Parquet that does not parse (ArrowInvalid) is the file's own problem."""
    text = str(exc)
    if S3_PERMANENT.search(text) or AUTH.search(text):
        return False
    return bool(S3_TRANSIENT.search(text)) or network_error(exc)


class ParquetWarehouse(dg.ConfigurableResource):
    path: str
    # `path: s3://bucket/prefix` reads object storage in streaming mode through pyarrow's S3 client
    # (credentials from the usual AWS variables or instance profile); `endpoint` for S3-compatible
    # stores (MinIO, Ceph, a local moto server): 'http://host:port' or 'host:port' (https).
    endpoint: str | None = None
    region: str | None = None
    connect_timeout: float = 10  # seconds; an endpoint that does not answer fails fast
    request_timeout: float = 60

    def _s3(self):
        """(S3FileSystem, 'bucket/prefix', endpoint) for an s3:// path, else None."""
        if not self.path.startswith("s3://"):
            return None
        from pyarrow.fs import S3FileSystem

        from pyarrow.fs import AwsStandardS3RetryStrategy

        kw = {"region": self.region} if self.region else {}
        kw.update(connect_timeout=self.connect_timeout, request_timeout=self.request_timeout,
                  retry_strategy=AwsStandardS3RetryStrategy(max_attempts=2))
        endpoint = self.endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            scheme, _, host = endpoint.rpartition("://")
            kw.update(endpoint_override=host.rstrip("/"), scheme=scheme or "https")
        return S3FileSystem(**kw), self.path[len("s3://"):].rstrip("/"), endpoint or "AWS"

    def _s3_error(self, table: str, exc: BaseException, doing: str = "") -> WarehouseError:
        """An S3 failure on `table`, naming the bucket, the endpoint and whether it is transient."""
        _, base, where = self._s3()
        what = "the connection failed (transient): " if transient(exc) else ""
        return WarehouseError(f"table {table!r} at s3://{base} (parquet connection, endpoint {where}){doing}: {what}"
                              f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
                              transient=transient(exc))

    def _dataset(self, table: str) -> ds.Dataset:
        table = confined(table, self.path)
        s3 = self._s3()
        if s3 is not None:
            from pyarrow.fs import FileType

            fs, base, where = s3
            try:
                for candidate, kind in ((f"{base}/{table}.parquet", FileType.File), (f"{base}/{table}", FileType.Directory)):
                    if fs.get_file_info(candidate).type == kind:
                        return ds.dataset(candidate, filesystem=fs, format="parquet", partitioning="hive")
            except OSError as e:
                raise self._s3_error(table, e) from None
            raise WarehouseError(f"table {table!r} not found: neither s3://{base}/{table}.parquet nor the prefix "
                                 f"s3://{base}/{table}/ exists (endpoint {where}){tables_there(self.tables)}")
        base = Path(self.path)
        for candidate in (base / f"{table}.parquet", base / table):
            if candidate.exists():
                return ds.dataset(str(candidate), format="parquet", partitioning="hive")
        raise WarehouseError(f"table {table!r} not found: neither {base / (table + '.parquet')} nor the folder "
                             f"{base / table} exists{tables_there(self.tables)}")

    def tables(self) -> list[str]:
        """The tables the connection reads: `<name>.parquet` files and `<name>/` folders directly under its
        folder or s3:// prefix."""
        s3 = self._s3()
        if s3 is None:
            base = Path(self.path)
            if not base.is_dir():
                raise WarehouseError(f"{base}: no such folder")
            return sorted(p.stem if p.suffix == ".parquet" else p.name for p in base.iterdir()
                          if p.suffix == ".parquet" or p.is_dir())
        from pyarrow.fs import FileSelector, FileType

        fs, base, where = s3
        try:
            infos = fs.get_file_info(FileSelector(base, recursive=False))
        except OSError as e:
            raise WarehouseError(f"s3://{base}: cannot list the prefix (endpoint {where}): {str(e).splitlines()[0]}",
                                 transient=transient(e)) from None
        names = [i.base_name.removesuffix(".parquet") for i in infos
                 if i.type == FileType.Directory or (i.type == FileType.File and i.base_name.endswith(".parquet"))]
        return sorted(set(names))

    def schema(self, table: str) -> pa.Schema:
        return self._dataset(table).schema

    def time_range(self, table: str, time_column: str):
        col = self._dataset(table).to_table(columns=[time_column]).column(0)
        import pyarrow.compute as pc

        mm = pc.min_max(col)
        return mm["min"].as_py(), mm["max"].as_py()

    def freshness(self, table: str, time_column: str) -> tuple[int, datetime | None]:
        """Rows and the newest timestamp from the files' footers (row counts and row-group statistics);
        the column is scanned only where a file carries no statistics."""
        data = self._dataset(table)
        newest = None
        for fragment in data.get_fragments():
            top = _footer_max(fragment, time_column)
            if top is _NO_STATS:
                col = fragment.to_table(columns=[time_column]).column(0)
                top = pc.max(col).as_py() if len(col) else None
            if top is not None:
                top = utc_naive(top)
                newest = top if newest is None else max(newest, top)
        return data.count_rows(), newest

    def partition_counts(self, table: str, time_column: str, grain: str) -> dict[datetime, tuple[int, datetime]]:
        """{start of each month (grain 'month') or day ('day'): (rows, newest timestamp)}, UTC; reads
        only the time column."""
        if grain not in ("month", "day"):
            raise ValueError(f"grain must be 'month' or 'day', got {grain!r}")
        col = self._dataset(table).to_table(columns=[time_column]).column(0).drop_null()
        if len(col) == 0:
            return {}
        ts = pc.cast(col, pa.timestamp("us"))  # a zone-aware column keeps its UTC instant; dates -> midnight
        grouped = pa.table({"p": pc.floor_temporal(ts, unit=grain), "t": ts}).group_by("p").aggregate(
            [("t", "count"), ("t", "max")])
        return {p: (n, m) for p, n, m in zip(grouped.column("p").to_pylist(), grouped.column("t_count").to_pylist(),
                                             grouped.column("t_max").to_pylist())}

    def read(self, table: str, columns: list[str] | None = None, time_column: str | None = None,
             start: datetime | None = None, end: datetime | None = None,
             batch_rows: int = 1 << 17, where: str | None = None) -> Iterator[pa.RecordBatch]:
        """`columns` of the rows in [start, end) of `time_column` that pass the row filter `where`
        (resources/warehouses/row_filter.py as a pyarrow expression): both pushed into the dataset scan."""
        data = self._dataset(table)
        flt = None
        if where:
            from habitus.resources.warehouses import row_filter

            try:
                flt = row_filter.arrow_filter(where, data.schema)
            except row_filter.FilterError as e:
                raise WarehouseError(f"table {table!r}: the row filter `where: {where}`: {e}") from None
        if time_column is not None:
            field = ds.field(time_column)
            typ = data.schema.field(time_column).type
            if start is not None:
                cond = field >= pa.scalar(start, pa.timestamp("us")).cast(typ)
                flt = cond if flt is None else flt & cond
            if end is not None:
                cond = field < pa.scalar(end, pa.timestamp("us")).cast(typ)
                flt = cond if flt is None else flt & cond
        # One row group at a time, in order: the scanner's read-ahead outruns a slower consumer (the
        # Parquet writer) and its memory then grows with the file; this stays at one row group
        # (bench/extract_memory.py). Row groups whose statistics exclude the window are skipped.
        try:
            for fragment in data.get_fragments(filter=flt):
                for part in fragment.split_by_row_group(flt, schema=data.schema):
                    yield from part.to_batches(schema=data.schema, columns=columns, filter=flt,
                                               batch_size=batch_rows, use_threads=False)
        except OSError as e:  # object storage: the endpoint went away or answered an error mid-read
            if self._s3() is None:
                raise
            raise self._s3_error(table, e, " while reading") from None

    def write(self, table: str, batches: Iterable[pa.RecordBatch], schema: pa.Schema,
              replace: tuple[str, object] | None = None) -> int:
        """One file per replaced value: `<path>/<table>/<column>=<value>.parquet`, written whole."""
        table = confined(table, self.path)
        name = f"{replace[0]}={_safe(replace[1])}.parquet" if replace else "part.parquet"
        s3 = self._s3()
        if s3 is not None:
            # written under a temporary key, then copied to its name (the copy appears whole): closing a
            # writer whose batches failed completes its upload, which would replace the day's object with
            # the rows written before the failure. Dataset reads skip the '.'-prefixed key.
            fs, base, _ = s3
            final, tmp = f"{base}/{table}/{name}", f"{base}/{table}/.{name}.tmp-{uuid.uuid4().hex}"
            rows = 0
            try:
                with pq.ParquetWriter(tmp, schema, filesystem=fs) as w:
                    for b in batches:
                        w.write_batch(b)
                        rows += len(b)
                fs.move(tmp, final)
            except OSError as e:  # the day's object is untouched: only the temporary key was written
                raise self._s3_error(table, e, f" while writing {name}") from None
            finally:
                with contextlib.suppress(OSError):
                    if fs.get_file_info(tmp).type != pafs.FileType.NotFound:
                        fs.delete_file(tmp)
            return rows
        folder = Path(self.path) / table
        folder.mkdir(parents=True, exist_ok=True)
        name = f"{replace[0]}={_safe(replace[1])}.parquet" if replace else "part.parquet"
        tmp = folder / f".{name}.tmp-{os.getpid()}"
        rows = 0
        with pq.ParquetWriter(tmp, schema) as w:
            for b in batches:
                w.write_batch(b)
                rows += len(b)
        durable_replace(tmp, folder / name)
        return rows


def confined(table: str, path: str) -> str:
    """`table` when it names a file or folder inside the connection's folder: '/'-separated names, none
    empty, '.' or '..', no backslash or NUL, not absolute. A sink or source `../x` or `/etc/x` would read
    or write outside it."""
    parts = table.split("/") if isinstance(table, str) else [""]
    if table.startswith("/") or any(p in ("", ".", "..") or "\\" in p or "\x00" in p for p in parts):
        raise WarehouseError(f"table {table!r}: not a name inside the parquet connection's folder {path} (no "
                             f"'..', absolute path, backslash or empty part)")
    return table


def _safe(value) -> str:
    text = value.strftime("%Y-%m-%dT%H%M%S") if isinstance(value, datetime) else str(value)
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text)


_NO_STATS = object()


def _footer_max(fragment, column: str):
    """The largest value of `column` in a Parquet file according to its footer; _NO_STATS when a row
    group has no statistics (or the column is not stored in the file, e.g. a hive partition key)."""
    md = fragment.metadata
    names = [md.schema.column(i).name for i in range(md.num_columns)]
    if column not in names:
        return _NO_STATS
    i, top = names.index(column), None
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        stats = rg.column(i).statistics
        if rg.num_rows == 0 or (stats is not None and stats.null_count == rg.num_rows):
            continue
        if stats is None or not stats.has_min_max:
            return _NO_STATS
        top = stats.max if top is None else max(top, stats.max)
    return top
