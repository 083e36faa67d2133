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
               start: datetime | None = None, end: datetime | None = None) -> str:
    """SELECT the columns of `table` whose `time_column` is in [start, end): projection and time
    filter both pushed down to the warehouse."""
    cols = [exp.column(c, quoted=True) for c in columns] if columns else [exp.Star()]
    query = exp.select(*cols).from_(table_expr(table))
    if time_column and start is not None:
        query = query.where(exp.GTE(this=exp.column(time_column, quoted=True), expression=_ts(start)))
    if time_column and end is not None:
        query = query.where(exp.LT(this=exp.column(time_column, quoted=True), expression=_ts(end)))
    return query.sql(dialect=dialect)


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
