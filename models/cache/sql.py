"""SQL text for the DuckDB statements of a build: quoting, reading Parquet files, times as UTC seconds."""

import pyarrow as pa
import pyarrow.parquet as pq

from habitus.models.cache.spec import CacheError, TableInput


def _q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _files_sql(files: list[str]) -> str:
    return "read_parquet([" + ", ".join("'" + f.replace("'", "''") + "'" for f in files) + "], union_by_name=true)"


def _epoch_s(expr: str) -> str:
    """Seconds since 1970 of a plain (UTC) TIMESTAMP expression."""
    return f"epoch_us({expr}) // 1000000"


def _utc(expr: str, arrow_type: pa.DataType) -> str:
    """A time column as a plain UTC TIMESTAMP. A zone-aware one keeps its instant: a plain CAST would
    shift it to this machine's local zone."""
    if pa.types.is_timestamp(arrow_type) and arrow_type.tz is not None:
        return f"make_timestamp(epoch_us({expr}))"
    return f"CAST({expr} AS TIMESTAMP)"


def _field_type(t: TableInput, column: str) -> pa.DataType:
    schema = pq.read_schema(t.files[0])
    if column not in schema.names:
        raise CacheError(f"column {column!r} is not in source {t.name!r} (columns: {schema.names}); "
                         f"fix the project config")
    return schema.field(column).type


def _column_sql(t: TableInput, column: str) -> str:
    """An events column as read: a time becomes seconds since 1970 (the model reads it as a number)."""
    if t.columns[column] == "timestamp" or pa.types.is_timestamp(_field_type(t, column)) \
            or pa.types.is_date(_field_type(t, column)):
        return _epoch_s(_utc(_q(column), _field_type(t, column)))
    return _q(column)


def _lit(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _one(con, sql: str) -> tuple:
    """The single row of a query (DuckDB 2 relations keep no cursor, so fetch all of one row)."""
    return con.sql(sql).fetchall()[0]
