"""Warehouse SQL built with sqlglot: identifiers are always quoted, never pasted from strings."""

from datetime import datetime, timezone

from sqlglot import exp


def table_expr(table: str) -> exp.Table:
    """'db.schema.table' (dots separate the qualifiers) -> a quoted table reference."""
    parts = table.split(".")
    if len(parts) > 3 or not all(parts):
        raise ValueError(f"table name {table!r}: expected table, schema.table or catalog.schema.table")
    name = parts[-1]
    db = parts[-2] if len(parts) >= 2 else None
    catalog = parts[-3] if len(parts) == 3 else None
    return exp.table_(name, db=db, catalog=catalog, quoted=True)


def select_sql(dialect: str, table: str, columns: list[str] | None = None, time_column: str | None = None,
               start: datetime | None = None, end: datetime | None = None, where: str | None = None) -> str:
    """SELECT the columns of `table` whose `time_column` is in [start, end) and that pass the source's
    row filter `where` (resources/warehouses/row_filter.py): projection and filters pushed down to the warehouse."""
    cols = [exp.column(c, quoted=True) for c in columns] if columns else [exp.Star()]
    return select_expr(table, cols, time_column, start, end, where).sql(dialect=dialect, comments=False)


def select_expr(table: str, projections: list[exp.Expression], time_column: str | None = None,
                start: datetime | None = None, end: datetime | None = None, where: str | None = None) -> exp.Select:
    """The query of `select_sql` with the projections given as expressions (a connector that must
    convert a column on the way out, e.g. a ClickHouse Enum to its label)."""
    query = exp.select(*projections).from_(table_expr(table))
    if where:
        from habitus.resources.warehouses import row_filter

        query = query.where(exp.paren(row_filter.parse(where), copy=False))
    if time_column and start is not None:
        query = query.where(exp.GTE(this=exp.column(time_column, quoted=True), expression=_ts(start)))
    if time_column and end is not None:
        query = query.where(exp.LT(this=exp.column(time_column, quoted=True), expression=_ts(end)))
    return query


def range_sql(dialect: str, table: str, time_column: str) -> str:
    col = exp.column(time_column, quoted=True)
    return exp.select(exp.Min(this=col), exp.Max(this=col)).from_(table_expr(table)).sql(dialect=dialect)


def delete_sql(dialect: str, table: str, column: str, value) -> str:
    cond = exp.EQ(this=exp.column(column, quoted=True), expression=_literal(value))
    return exp.delete(table_expr(table), where=cond).sql(dialect=dialect)


def _ts(value: datetime) -> exp.Expression:
    """A UTC timestamp literal, microseconds kept when there are any."""
    if value.tzinfo is not None:
        value = value.astimezone(timezone.utc).replace(tzinfo=None)
    return exp.cast(exp.Literal.string(value.isoformat(sep=" ")), exp.DataType.build("TIMESTAMP"))


def _literal(value) -> exp.Expression:
    if isinstance(value, datetime):
        return _ts(value)
    if isinstance(value, (int, float)):
        return exp.Literal.number(value)
    return exp.Literal.string(str(value))


# --------------------------------------------------------------------------- what new-data sensors ask, and the times they get back


def freshness_sql(dialect: str, table: str, time_column: str) -> str:
    col = exp.column(time_column, quoted=True)
    return exp.select(exp.Count(this=exp.Star()), exp.Max(this=col)).from_(table_expr(table)).sql(dialect=dialect)


def partition_counts_sql(dialect: str, table: str, time_column: str, grain: str) -> str:
    """Rows and newest time per month or day of `time_column`: one GROUP BY in the warehouse."""
    col = exp.column(time_column, quoted=True)
    period = period_expr(dialect, col, grain)
    return (exp.select(period.as_("period"), exp.Count(this=exp.Star()), exp.Max(this=col.copy()))
            .from_(table_expr(table)).where(exp.Not(this=exp.Is(this=col.copy(), expression=exp.Null())))
            .group_by(period.copy()).sql(dialect=dialect))  # by the expression: T-SQL has no GROUP BY 1


def period_expr(dialect: str, col: exp.Expression, grain: str) -> exp.Expression:
    """The first instant of the month or day holding `col`, written so that each warehouse accepts it
    for timestamp, zone-aware and date columns alike (a date or a timestamp comes back)."""
    if grain not in ("month", "day"):
        raise ValueError(f"grain must be 'month' or 'day', got {grain!r}")
    month = grain == "month"

    def fn(name, *args):  # as written: sqlglot would reorder or rename a function it knows
        return exp.Anonymous(this=name, expressions=list(args))

    if dialect == "bigquery":  # TIMESTAMP_TRUNC refuses DATETIME and DATE columns; DATE() takes all three
        day = fn("DATE", col)
        return fn("DATE_TRUNC", day, exp.var("MONTH")) if month else day
    if dialect == "clickhouse":
        return fn("toStartOfMonth" if month else "toDate", col)
    if dialect == "hive":  # Hive has no DATE_TRUNC; TRUNC(.., 'MM') and TO_DATE run on Hive and Spark
        return fn("TRUNC", col, exp.Literal.string("MM")) if month else fn("TO_DATE", col)
    if dialect == "tsql":  # DATETRUNC is SQL Server 2022 only; Synapse has DATEFROMPARTS
        if month:
            return fn("DATEFROMPARTS", fn("YEAR", col), fn("MONTH", col.copy()), exp.Literal.number(1))
        return exp.cast(col, exp.DataType.build("DATE"))
    return exp.TimestampTrunc(this=col, unit=exp.var(grain.upper()))


def utc_naive(value):
    """A warehouse time as a naive UTC datetime (dates become midnight); None stays None."""
    if value is None:
        return None
    if not isinstance(value, datetime):  # a date
        return datetime(value.year, value.month, value.day)
    if value.tzinfo is not None:
        value = value.astimezone(timezone.utc).replace(tzinfo=None)
    return value


# --------------------------------------------------------------------------- helpers for the networked connectors


def limit0_sql(dialect: str, table: str, columns: list[str] | None = None) -> str:
    """The columns of `table` with no rows: what a driver describes to give the table's schema."""
    cols = [exp.column(c, quoted=True) for c in columns] if columns else [exp.Star()]
    return exp.select(*cols).from_(table_expr(table)).limit(0).sql(dialect=dialect)


def count_sql(dialect: str, table: str) -> str:
    return exp.select(exp.Count(this=exp.Star())).from_(table_expr(table)).sql(dialect=dialect)


def arrow_sql_type(arrow_type, dialect: str) -> exp.DataType:
    """The warehouse column type that holds an Arrow type without loss (used when creating a table
    for predictions). Raises ValueError naming the type when there is none."""
    import pyarrow as pa

    t = arrow_type
    if pa.types.is_boolean(t):
        name = "BOOLEAN"
    elif pa.types.is_integer(t):
        name = "BIGINT" if t.bit_width > 32 or (pa.types.is_unsigned_integer(t) and t.bit_width == 32) else "INT"
    elif pa.types.is_floating(t):
        name = "DOUBLE"
    elif pa.types.is_decimal(t):
        name = f"DECIMAL({t.precision}, {t.scale})"
    elif pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_dictionary(t):
        name = "TEXT"
    elif pa.types.is_date(t):
        name = "DATE"
    elif pa.types.is_timestamp(t):
        if dialect == "clickhouse":
            digits = {"s": 0, "ms": 3, "us": 6, "ns": 9}[t.unit]
            # Nullable: ClickHouse columns are not, and a NULL would silently become 1970-01-01
            return exp.DataType.build(f"Nullable(DateTime64({digits}{', ' + repr(t.tz) if t.tz else ''}))"
                                      .replace('"', "'"), dialect="clickhouse")
        name = "TIMESTAMPTZ" if t.tz else ("TIMESTAMPNTZ" if dialect in ("snowflake", "databricks", "spark") else "TIMESTAMP")
        if dialect == "tsql" and not t.tz:
            name = "DATETIME2"
    elif pa.types.is_binary(t) or pa.types.is_large_binary(t):
        name = "BINARY" if dialect != "tsql" else "VARBINARY(MAX)"
    else:
        raise ValueError(f"no {dialect} column type for Arrow type {t}")
    if dialect == "tsql" and name == "TEXT":
        name = "NVARCHAR(MAX)"
    if dialect == "tsql" and name == "BOOLEAN":
        name = "BIT"
    return exp.DataType.build(name, dialect=dialect if name in ("DATETIME2", "NVARCHAR(MAX)", "VARBINARY(MAX)") else None)


def create_table_sql(dialect: str, table: str, schema, if_not_exists: bool = True,
                     partition_by: str | None = None) -> str:
    """CREATE TABLE [IF NOT EXISTS] for an Arrow schema, identifiers quoted for the dialect; in
    ClickHouse PARTITION BY `partition_by` when given (a partition is then replaced in one step)."""
    cols = []
    for f in schema:
        kind = arrow_sql_type(f.type, dialect)
        if dialect == "clickhouse" and f.name == partition_by:
            kind.set("nullable", False)  # a partition key may not be Nullable
        cols.append(exp.ColumnDef(this=exp.to_identifier(f.name, quoted=True), kind=kind))
    create = exp.Create(this=exp.Schema(this=table_expr(table), expressions=cols), kind="TABLE", exists=if_not_exists)
    if dialect == "clickhouse":  # a MergeTree without a sort key: predictions are read whole or by as_of
        props = [exp.EngineProperty(this=exp.var("MergeTree"))]
        if partition_by:
            props.append(exp.PartitionedByProperty(this=exp.column(partition_by, quoted=True)))
        props.append(exp.Order(expressions=[exp.Ordered(this=exp.Tuple(expressions=[]))]))
        create.set("properties", exp.Properties(expressions=props))
    return create.sql(dialect=dialect)
