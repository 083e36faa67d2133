"""BigQuery through google-cloud-bigquery. Reads go through the Storage Read API on the table
itself (selected columns + a row restriction holding the time window: projection and filter
pushed down, no query cost, Arrow record batches streamed per page); a view, or
`storage_api: false`, reads through a query whose result pages stream as Arrow. Writes create the
table if missing and load Parquet files (load jobs, the bulk path) into a staging table, then
replace the partition's rows in one multi-statement transaction (DELETE + INSERT ... SELECT).

Install with `pip install 'habitus[bigquery]'`. Config (secrets as ${ENV} references):

    connections:
      bq: {type: bigquery, project: my-project, dataset: shop, location: EU}
          # credentials: the environment's (GOOGLE_APPLICATION_CREDENTIALS, workload identity),
          # or credentials_json: ${BQ_SERVICE_ACCOUNT_JSON}

`api_endpoint` / `grpc_endpoint` point the client at an emulator (no credentials then).
"""

import contextlib
import io
import json
import uuid
from datetime import datetime, timedelta
from typing import Any, Iterable, Iterator

import dagster as dg
import pyarrow as pa
from sqlglot import exp

from habitus.resources.warehouses.errors import AUTH, WarehouseError, network_error, tables_there
from habitus.resources.warehouses.remote import (ChunkReads, as_time, connect_error, first_lines, naive_utc, period_counts,
                                      query_error)
from habitus.resources.warehouses.masking import secret_values, value
from habitus.resources.warehouses.sql import create_table_sql, freshness_sql, partition_counts_sql, range_sql, table_expr

DIALECT = "bigquery"

_SIMPLE = {"INTEGER": pa.int64(), "INT64": pa.int64(), "FLOAT": pa.float64(), "FLOAT64": pa.float64(),
           "STRING": pa.string(), "BOOLEAN": pa.bool_(), "BOOL": pa.bool_(), "DATE": pa.date32(),
           "DATETIME": pa.timestamp("us"), "TIMESTAMP": pa.timestamp("us", "UTC"), "BYTES": pa.binary(),
           "TIME": pa.time64("us"), "JSON": pa.string(), "GEOGRAPHY": pa.string()}


def arrow_type(name: str, field_type: str, mode: str = "NULLABLE", precision=None, scale=None) -> pa.DataType:
    """The Arrow type of a BigQuery schema field."""
    t = field_type.upper()
    if mode == "REPEATED" or t in ("RECORD", "STRUCT", "RANGE"):
        raise WarehouseError(f"column {name!r}: BigQuery {mode} {field_type} has no flat Arrow mapping; leave it "
                             f"out of `columns` or flatten it in a view")
    if t in ("NUMERIC", "DECIMAL"):
        return pa.decimal128(int(precision), int(scale or 0)) if precision else pa.decimal128(38, 9)
    if t in ("BIGNUMERIC", "BIGDECIMAL"):
        return pa.decimal256(int(precision), int(scale or 0)) if precision else pa.decimal256(76, 38)
    if t in _SIMPLE:
        return _SIMPLE[t]
    raise WarehouseError(f"column {name!r}: BigQuery type {field_type} has no Arrow mapping")


def window(time_column: str, typ: pa.DataType, start: datetime | None, end: datetime | None) -> exp.Expression | None:
    """[start, end) on a column, the bounds typed as the column is: TIMESTAMP, DATETIME or DATE
    (BigQuery compares no DATETIME with a TIMESTAMP or a DATE)."""
    col = exp.column(time_column, quoted=True)

    def bound(v: datetime) -> exp.Expression:
        v = naive_utc(v)
        if pa.types.is_date(typ):  # [start, end) in whole days: a partial first day starts the day after
            d = v.date() + (timedelta(days=1) if v.time() != datetime.min.time() else timedelta())
            return exp.cast(exp.Literal.string(d.isoformat()), exp.DataType.build("DATE"))
        kind = "TIMESTAMPTZ" if getattr(typ, "tz", None) else "DATETIME"
        return exp.cast(exp.Literal.string(v.isoformat(sep=" ")), exp.DataType.build(kind))

    conds = []
    if start is not None:
        conds.append(exp.GTE(this=col, expression=bound(start)))
    if end is not None:
        conds.append(exp.LT(this=col.copy(), expression=bound(end)))
    return exp.and_(*conds) if conds else None


# google.api_core's exceptions that may pass when retried (5xx, 429, a deadline, retries that ran out on
# a dropped connection); BadRequest (bad SQL), NotFound (a missing table or dataset), Unauthorized,
# Forbidden (except a rate limit) and Conflict are answers that a retry does not change.
_RETRYABLE = ("ServerError", "InternalServerError", "BadGateway", "ServiceUnavailable", "GatewayTimeout",
              "TooManyRequests", "DeadlineExceeded", "RetryError", "Aborted", "ResourceExhausted")


def transient(exc: BaseException) -> bool:
    """Whether an error of google-cloud-bigquery / the Storage Read API may pass when retried."""
    from google.api_core import exceptions as gexc

    if isinstance(exc, (gexc.Unauthenticated, gexc.PermissionDenied)):
        return False
    if isinstance(exc, gexc.Forbidden):  # 403 is also how BigQuery reports a rate or quota limit
        return any(e.get("reason") in ("rateLimitExceeded", "backendError") for e in (exc.errors or [])
                   if isinstance(e, dict))
    if isinstance(exc, gexc.GoogleAPIError) and not isinstance(exc, gexc.RetryError):
        # the api_core classes of one HTTP status or gRPC code (ServiceUnavailable is also a ServerError)
        return any(type(exc).__name__ == n or any(b.__name__ == n for b in type(exc).__mro__) for n in _RETRYABLE)
    if isinstance(exc, gexc.RetryError):  # the client's retries ran out: on what?
        return exc.cause is None or transient(exc.cause) or network_error(exc.cause)
    if AUTH.search(str(exc)) and type(exc).__module__.startswith("google.auth"):
        return False
    return network_error(exc)


class BigQueryWarehouse(ChunkReads, dg.ConfigurableResource):
    name: str = ""
    project: str
    dataset: str | None = None
    location: str | None = None
    credentials_json: str | None = None
    api_endpoint: str | None = None
    grpc_endpoint: str | None = None
    storage_api: bool = True
    timeout: int = 30  # seconds for a metadata call, retries included: a bad endpoint fails fast
    options: dict[str, Any] = {}

    def _secrets(self) -> list:
        return secret_values(self)

    def _ref(self, table: str) -> tuple[str, str, str]:
        t = table_expr(table)
        dataset = t.db or value(self.dataset)
        if not dataset:
            raise WarehouseError(f"table {table!r}: name it dataset.table or set the connection's `dataset`")
        return t.catalog or value(self.project), dataset, t.name

    def _where(self) -> str:
        return " and ".join(e for e in (self.api_endpoint, self.grpc_endpoint) if e) or "bigquery.googleapis.com"

    def _qualified(self, table: str) -> str:
        return ".".join(self._ref(table))

    def _credentials(self):
        if self.api_endpoint:
            from google.auth.credentials import AnonymousCredentials

            return AnonymousCredentials()
        if self.credentials_json:
            from google.oauth2 import service_account

            return service_account.Credentials.from_service_account_info(json.loads(value(self.credentials_json)))
        return None

    def _client(self):
        from google.cloud import bigquery

        kw = {"project": value(self.project), "location": value(self.location), "credentials": self._credentials()}
        if self.api_endpoint:
            from google.api_core.client_options import ClientOptions

            kw["client_options"] = ClientOptions(api_endpoint=self.api_endpoint)
        try:
            return bigquery.Client(**{k: v for k, v in kw.items() if v is not None}, **value(self.options))
        except Exception as e:
            raise connect_error("bigquery", self.name, self.api_endpoint or f"project {self.project}", e,
                                self._secrets()) from None

    def _storage(self):
        from google.cloud import bigquery_storage_v1

        if self.grpc_endpoint:
            import grpc
            from google.cloud.bigquery_storage_v1.services.big_query_read.transports import BigQueryReadGrpcTransport

            channel = grpc.insecure_channel(self.grpc_endpoint)
            return bigquery_storage_v1.BigQueryReadClient(transport=BigQueryReadGrpcTransport(channel=channel))
        return bigquery_storage_v1.BigQueryReadClient(credentials=self._credentials())

    @contextlib.contextmanager
    def _session(self, table: str):
        import requests
        from google.api_core.exceptions import GoogleAPIError, NotFound, RetryError

        client = self._client()
        try:
            yield client
        except (RetryError, requests.exceptions.ConnectionError) as e:
            raise connect_error("bigquery", self.name, self._where(), e, self._secrets(), transient(e)) from None
        except GoogleAPIError as e:
            message = _message(e)
            if isinstance(e, NotFound):  # a missing table; of a missing dataset the listing fails too and adds nothing
                message += tables_there(lambda: self._tables(client, self._ref(table)[:2]))
            raise query_error("bigquery", self.name, table, RuntimeError(message), self._secrets(),
                              where=self._where(), transient=transient(e)) from None
        except Exception as e:
            if type(e).__module__.startswith(("google.", "grpc")) or network_error(e):
                raise query_error("bigquery", self.name, table, e, self._secrets(), where=self._where(),
                                  transient=transient(e)) from None
            raise
        finally:
            client.close()

    def tables(self) -> list[str]:
        """The tables and views of the connection's `dataset` (the client's list_tables)."""
        if not value(self.dataset):
            raise WarehouseError(f"connection {self.name or '?'!r} (bigquery): set its `dataset` to list its tables")
        with self._session(f"{value(self.dataset)}.*") as client:
            return self._tables(client, (value(self.project), value(self.dataset)))

    def _tables(self, client, dataset: tuple[str, str]) -> list[str]:
        from google.cloud.bigquery import DEFAULT_RETRY

        listing = client.list_tables(".".join(dataset), retry=DEFAULT_RETRY.with_deadline(self.timeout),
                                     timeout=self.timeout)
        return sorted(t.table_id for t in listing)

    # ------------------------------------------------------------------ reading

    def _table(self, client, table: str):
        from google.cloud.bigquery import DEFAULT_RETRY

        return client.get_table(self._qualified(table), retry=DEFAULT_RETRY.with_deadline(self.timeout),
                                timeout=self.timeout)

    def _describe(self, bq_table, table: str, columns: list[str] | None) -> pa.Schema:
        fields = {f.name: f for f in bq_table.schema}
        names = columns or list(fields)
        missing = [c for c in names if c not in fields]
        if missing:
            raise WarehouseError(f"table {table!r}: column(s) {missing} not found; it has {list(fields)}")
        return pa.schema([pa.field(c, arrow_type(c, fields[c].field_type, fields[c].mode, fields[c].precision,
                                                 fields[c].scale)) for c in names])

    def schema(self, table: str) -> pa.Schema:
        with self._session(table) as client:
            return self._describe(self._table(client, table), table, None)

    def time_range(self, table: str, time_column: str) -> tuple[datetime | None, datetime | None]:
        with self._session(table) as client:
            self._table(client, table)  # a missing table or a bad endpoint is reported before querying
            row = list(client.query(range_sql(DIALECT, self._qualified(table), time_column)).result())[0]
            lo, hi = row[0], row[1]
            return naive_utc(_midnight(lo)), naive_utc(_midnight(hi))

    def freshness(self, table: str, time_column: str) -> tuple[int, datetime | None]:
        """Rows and the newest time (naive UTC): one aggregate query per sensor tick."""
        with self._session(table) as client:
            self._table(client, table)  # a missing table or a bad endpoint is reported before querying
            row = list(client.query(freshness_sql(DIALECT, self._qualified(table), time_column)).result())[0]
            return int(row[0]), as_time(row[1])

    def partition_counts(self, table: str, time_column: str, grain: str) -> dict[datetime, tuple[int, datetime]]:
        """{start of each month or day (UTC): (rows, newest time)}: one GROUP BY query."""
        with self._session(table) as client:
            self._table(client, table)
            sql = partition_counts_sql(DIALECT, self._qualified(table), time_column, grain)
            return period_counts(tuple(r.values()) for r in client.query(sql).result())

    def _chunks(self, table, columns, time_column, start, end, batch_rows, where=None) -> Iterator:
        """The source of `Batches`: the described schema, then the result's Arrow batches."""
        with self._session(table) as client:
            bq_table = self._table(client, table)
            schema = self._describe(bq_table, table, columns)
            yield schema
            typ = self._describe(bq_table, table, [time_column]).field(0).type if time_column else None
            cond = window(time_column, typ, start, end) if time_column else None
            if where:
                from habitus.resources.warehouses import row_filter

                cond = exp.and_(exp.paren(row_filter.parse(where), copy=False), *([cond] if cond is not None else []))
            if self.storage_api and bq_table.table_type == "TABLE":
                chunks = self._read_storage(bq_table, schema.names, cond)
            else:
                query = exp.select(*[exp.column(c, quoted=True) for c in schema.names]).from_(
                    table_expr(self._qualified(table)))
                if cond is not None:
                    query = query.where(cond)
                rows = client.query(query.sql(dialect=DIALECT, comments=False)).result(page_size=batch_rows)
                chunks = rows.to_arrow_iterable()
            yield from chunks

    def _read_storage(self, bq_table, names: list[str], cond) -> Iterator[pa.RecordBatch]:
        from google.cloud.bigquery_storage_v1 import types

        storage = self._storage()
        options = types.ReadSession.TableReadOptions(
            selected_fields=names, row_restriction=cond.sql(dialect=DIALECT, comments=False) if cond is not None else "")
        session = storage.create_read_session(
            parent=f"projects/{bq_table.project}",
            read_session=types.ReadSession(table=f"projects/{bq_table.project}/datasets/{bq_table.dataset_id}/"
                                                 f"tables/{bq_table.table_id}",
                                           data_format=types.DataFormat.ARROW, read_options=options),
            max_stream_count=1)  # one ordered stream; the pipeline parallelizes over partitions
        for stream in session.streams:
            for page in storage.read_rows(stream.name).rows(session).pages:
                batch = page.to_arrow()  # a RecordBatch per page of the stream
                yield batch.select(names)

    # ------------------------------------------------------------------ writing

    def write(self, table: str, batches: Iterable[pa.RecordBatch], schema: pa.Schema,
              replace: tuple[str, object] | None = None, file_rows: int = 1_000_000) -> int:
        """Create `table` if missing and write `batches` with Parquet load jobs (the bulk path).
        With `replace`, the rows go to a staging table first; then one multi-statement transaction
        deletes the rows where replace[0] == replace[1] and inserts the staged ones: a failed load
        keeps the previous rows, a re-run never duplicates them. Returns the rows loaded."""
        qualified = self._qualified(table)
        with self._session(table) as client:
            client.query(create_table_sql(DIALECT, qualified, schema)).result()
            if replace is None:
                return self._load(client, qualified, batches, schema, file_rows)
            project, dataset, _ = self._ref(table)
            stage = f"{project}.{dataset}._habitus_stage_{uuid.uuid4().hex[:12]}"
            client.query(create_table_sql(DIALECT, stage, schema, if_not_exists=False)).result()
            try:
                loaded = self._load(client, stage, batches, schema, file_rows)
                typ = self._describe(self._table(client, table), table, [replace[0]]).field(0).type
                v = replace[1]
                lit = (window(replace[0], typ, v, None).expression if isinstance(v, datetime)
                       else exp.Literal.number(v) if isinstance(v, (int, float)) else exp.Literal.string(str(v)))
                delete = exp.delete(table_expr(qualified), where=exp.EQ(this=exp.column(replace[0], quoted=True),
                                                                          expression=lit))
                cols = [exp.column(f.name, quoted=True) for f in schema]
                insert = exp.insert(exp.select(*cols).from_(table_expr(stage)), table_expr(qualified), columns=[
                    exp.to_identifier(f.name, quoted=True) for f in schema])
                client.query(f"BEGIN TRANSACTION; {delete.sql(dialect=DIALECT)}; {insert.sql(dialect=DIALECT)}; "
                             f"COMMIT TRANSACTION;").result()
                return loaded
            finally:
                client.delete_table(stage, not_found_ok=True)

    @staticmethod
    def _load(client, qualified: str, batches: Iterable[pa.RecordBatch], schema: pa.Schema, file_rows: int) -> int:
        """Append `batches` to `qualified` as Parquet load jobs of up to `file_rows` rows each."""
        import pyarrow.parquet as pq
        from google.cloud import bigquery

        config = bigquery.LoadJobConfig(source_format=bigquery.SourceFormat.PARQUET,
                                        write_disposition=bigquery.WriteDisposition.WRITE_APPEND)
        loaded, pending, n = 0, [], 0

        def load(parts):
            buf, data = io.BytesIO(), pa.Table.from_batches(parts, schema=schema)
            pq.write_table(data, buf, coerce_timestamps="us")
            buf.seek(0)
            client.load_table_from_file(buf, qualified, job_config=config).result()  # raises when it failed
            return data.num_rows

        for b in batches:
            if len(b):
                pending.append(b)
                n += len(b)
            if n >= file_rows:
                loaded += load(pending)
                pending, n = [], 0
        if pending:
            loaded += load(pending)
        return loaded


def _midnight(v):
    """A DATE bound as a datetime at midnight (the pipeline's times are datetimes)."""
    from datetime import date

    if isinstance(v, date) and not isinstance(v, datetime):
        return datetime(v.year, v.month, v.day)
    return v


def _message(e) -> str:
    return getattr(e, "message", None) or first_lines(e, 2)
