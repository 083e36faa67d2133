"""A source's `where:` row filter: one SQL boolean expression, parsed by sqlglot as an expression and
nothing else, then written in each warehouse's dialect (the extraction query's WHERE) or turned into a
pyarrow dataset filter (Parquet). Only what both can run is accepted: comparisons, AND / OR / NOT,
IN (a list of values), IS [NOT] NULL, BETWEEN, LIKE, LOWER / UPPER of a column, and literals (strings,
numbers, TRUE / FALSE, DATE '...' / TIMESTAMP '...'). Statements, subqueries, other functions, a
second statement after ';' and qualified names (t.col) are refused with the construct named; column
names are quoted like every other identifier habitus writes, so they are never pasted as SQL."""

import operator
from datetime import date, datetime
from functools import lru_cache

from sqlglot import exp

COMPARISONS = {exp.EQ: operator.eq, exp.NEQ: operator.ne, exp.GT: operator.gt, exp.GTE: operator.ge,
               exp.LT: operator.lt, exp.LTE: operator.le}
FLIPPED = {operator.gt: operator.lt, operator.ge: operator.le, operator.lt: operator.gt, operator.le: operator.ge}
FUNCTIONS = {exp.Lower: "utf8_lower", exp.Upper: "utf8_upper"}
CAST_TYPES = {exp.DataType.Type.DATE, exp.DataType.Type.TIMESTAMP}
ALLOWED = (exp.Column, exp.Identifier, exp.Literal, exp.Boolean, exp.Null, exp.And, exp.Or, exp.Not, exp.Paren,
           exp.In, exp.Is, exp.Between, exp.Like, exp.Neg, exp.Cast, exp.DataType, *COMPARISONS, *FUNCTIONS)


class FilterError(ValueError):
    """A `where:` that cannot be pushed down; the message names the construct."""


@lru_cache(maxsize=256)
def _parsed(text: str) -> exp.Expression:
    import sqlglot
    from sqlglot.errors import ParseError, TokenError

    try:
        statements = [s for s in sqlglot.parse(text) if s is not None]
    except (ParseError, TokenError) as e:
        raise FilterError(f"does not parse as SQL: {str(e).splitlines()[0]}") from None
    if len(statements) != 1:
        raise FilterError("must be one expression (a ';' ends a statement: only a condition is accepted)")
    tree = statements[0]
    for node in tree.walk():
        if isinstance(node, exp.Cast):
            if not (isinstance(node.this, exp.Literal) and node.to.this in CAST_TYPES):
                raise FilterError(f"{node.sql()}: only DATE '...' or TIMESTAMP '...' literals are cast")
        elif isinstance(node, exp.DataType):
            if not isinstance(node.parent, exp.Cast):
                raise FilterError(f"the type {node.sql()} is not a condition")
        elif isinstance(node, exp.In) and (node.args.get("query") or node.args.get("unnest")):
            raise FilterError(f"{node.sql()}: IN takes a list of values, not a subquery")
        elif isinstance(node, exp.In) and not all(_is_value(v) for v in node.expressions):
            raise FilterError(f"{node.sql()}: IN takes a list of literal values")
        elif isinstance(node, exp.Column) and (node.table or node.args.get("db") or node.args.get("catalog")):
            raise FilterError(f"{node.sql()}: name the column alone, without a table")
        elif isinstance(node, exp.Like) and not (isinstance(node.expression, exp.Literal) and node.expression.is_string):
            raise FilterError(f"{node.sql()}: LIKE takes a string pattern")
        elif isinstance(node, exp.Is) and not isinstance(node.expression, exp.Null):
            raise FilterError(f"{node.sql()}: IS takes NULL (IS NULL, IS NOT NULL); compare a boolean with = TRUE")
        elif type(node) in COMPARISONS and (isinstance(node.this, exp.Null) or isinstance(node.expression, exp.Null)):
            raise FilterError(f"{node.sql()}: a comparison with NULL is never true; write IS NULL or IS NOT NULL")
        elif isinstance(node, exp.Neg) and not isinstance(node.this, exp.Literal):
            raise FilterError(f"{node.sql()}: only a number is negated")
        elif isinstance(node, exp.Func) and not isinstance(node, ALLOWED):
            raise FilterError(f"the function {node.sql_name()} is not allowed (only LOWER and UPPER of a column)")
        elif not isinstance(node, ALLOWED):
            raise FilterError(f"{_construct(node)} is not allowed in a row filter (comparisons, AND, OR, NOT, IN, "
                              f"IS NULL, BETWEEN, LIKE, LOWER/UPPER and literals are)")
    if isinstance(tree, (exp.Literal, exp.Null, exp.Neg, exp.Cast, exp.Lower, exp.Upper)):
        raise FilterError(f"{tree.sql()} is a value, not a condition")
    for col in tree.find_all(exp.Column):
        col.this.set("quoted", True)
    return _explicit(tree)


def _explicit(node: exp.Expression) -> exp.Expression:
    """A boolean column standing as a condition (`NOT is_test`) compared with TRUE: T-SQL has no bare
    boolean conditions, and the comparison means the same everywhere."""
    if isinstance(node, exp.Column):
        return exp.Paren(this=exp.EQ(this=node, expression=exp.true()))
    if isinstance(node, (exp.And, exp.Or)):
        node.set("this", _explicit(node.this))
        node.set("expression", _explicit(node.expression))
    elif isinstance(node, (exp.Not, exp.Paren)):
        node.set("this", _explicit(node.this))
    return node


def _construct(node: exp.Expression) -> str:
    kind = node.key.upper()
    return f"{kind} ({node.sql()[:60]})" if kind not in ("SELECT", "SUBQUERY") else f"a {kind.lower()}"


def _is_value(node: exp.Expression) -> bool:
    return isinstance(node, (exp.Literal, exp.Boolean, exp.Null, exp.Cast)) or (
        isinstance(node, exp.Neg) and isinstance(node.this, exp.Literal))


def parse(text: str) -> exp.Expression:
    """The filter as a sqlglot expression (a copy, free to be put into a query); FilterError says why not."""
    if not isinstance(text, str) or not text.strip():
        raise FilterError("is empty: write a condition such as country = 'PL' AND NOT is_test")
    return _parsed(text.strip()).copy()


def columns(text: str) -> list[str]:
    """The columns the filter reads, in order of first mention."""
    return list(dict.fromkeys(c.name for c in parse(text).find_all(exp.Column, bfs=False)))


def sql(text: str, dialect: str) -> str:
    """The filter in `dialect`'s SQL (what goes after WHERE)."""
    return parse(text).sql(dialect=dialect, comments=False)


# --------------------------------------------------------------------------- Parquet: a pyarrow dataset filter


def arrow_filter(text: str, schema):
    """The filter as a pyarrow.compute expression over `schema` (a literal compared with a column is cast
    to the column's type, e.g. '2026-03-01' to a timestamp). FilterError names what cannot be run."""
    return _arrow(parse(text), schema)


def _arrow(node: exp.Expression, schema):
    import pyarrow.compute as pc

    if isinstance(node, exp.Paren):
        return _arrow(node.this, schema)
    if isinstance(node, exp.And):
        return _arrow(node.this, schema) & _arrow(node.expression, schema)
    if isinstance(node, exp.Or):
        return _arrow(node.this, schema) | _arrow(node.expression, schema)
    if isinstance(node, exp.Not):
        return ~_arrow(node.this, schema)
    if isinstance(node, exp.Boolean):
        return pc.scalar(node.this)
    if type(node) in COMPARISONS:
        op, left, right = COMPARISONS[type(node)], node.this, node.expression
        if _is_value(left) and not _is_value(right):  # 3 < price: price > 3, the literal cast to price's type
            op, left, right = FLIPPED.get(op, op), right, left
        return op(_operand(left, schema), _operand(right, schema, _type_of(left, schema)))
    if isinstance(node, exp.Is):  # IS NULL: parse() refuses IS anything else
        return _operand(node.this, schema).is_null()
    if isinstance(node, exp.In):
        typ = _type_of(node.this, schema)
        values = [_value(v, typ) for v in node.expressions]
        import pyarrow as pa

        return _operand(node.this, schema).isin(pa.array(values, typ) if typ is not None else values)
    if isinstance(node, exp.Between):
        typ = _type_of(node.this, schema)
        target = _operand(node.this, schema)
        return (target >= _operand(node.args["low"], schema, typ)) & (target <= _operand(node.args["high"], schema, typ))
    if isinstance(node, exp.Like):
        return pc.match_like(_operand(node.this, schema), node.expression.this)
    raise FilterError(f"{_construct(node)} is not a condition Parquet filters can run")


def _field(node: exp.Column, schema):
    import pyarrow.dataset as ds

    if node.name not in schema.names:
        raise FilterError(f"column {node.name!r} not found; the table has {schema.names}")
    return ds.field(node.name)


def _type_of(node: exp.Expression, schema):
    """The Arrow type a literal beside `node` is cast to: the column's (LOWER/UPPER: a string)."""
    import pyarrow as pa

    if isinstance(node, exp.Column) and node.name in schema.names:
        return schema.field(node.name).type
    if type(node) in FUNCTIONS:
        return pa.string()
    return None


def _operand(node: exp.Expression, schema, typ=None):
    import pyarrow.compute as pc

    if isinstance(node, exp.Column):
        return _field(node, schema)
    if type(node) in FUNCTIONS:
        return getattr(pc, FUNCTIONS[type(node)])(_operand(node.this, schema))
    if isinstance(node, exp.Paren):
        return _operand(node.this, schema, typ)
    return pc.scalar(_value(node, typ))


def _value(node: exp.Expression, typ=None):
    """A literal's Python value, cast to `typ` (the column's Arrow type) when given."""
    import pyarrow as pa

    if isinstance(node, exp.Paren):
        return _value(node.this, typ)
    if isinstance(node, exp.Null):
        return None
    if isinstance(node, exp.Boolean):
        value = node.this
    elif isinstance(node, exp.Neg):
        value = -_value(node.this)
    elif isinstance(node, exp.Cast):
        text = node.this.this
        value = date.fromisoformat(text) if node.to.this == exp.DataType.Type.DATE else datetime.fromisoformat(text)
    elif isinstance(node, exp.Literal):
        value = node.this if node.is_string else (float(node.this) if any(c in node.this for c in ".eE")
                                                   else int(node.this))
    else:
        raise FilterError(f"{_construct(node)} is not a value")
    if typ is None or value is None:
        return value
    try:
        if isinstance(value, str) and (pa.types.is_timestamp(typ) or pa.types.is_date(typ)):
            value = (date.fromisoformat(value) if pa.types.is_date(typ) else datetime.fromisoformat(value))
        if isinstance(value, date) and not isinstance(value, datetime) and pa.types.is_timestamp(typ):
            value = datetime(value.year, value.month, value.day)
        if pa.types.is_dictionary(typ):
            return value
        if pa.types.is_decimal(typ) and isinstance(value, (int, float)):  # exact, at the column's scale
            from decimal import Decimal

            exact = Decimal(str(value))
            if exact != exact.quantize(Decimal(1).scaleb(-typ.scale)):
                raise ValueError(f"it has more decimals than the column's {typ.scale}")
            return pa.scalar(exact.quantize(Decimal(1).scaleb(-typ.scale)), typ).as_py()
        return pa.scalar(value).cast(typ).as_py()
    except (ValueError, TypeError, pa.ArrowException) as e:
        raise FilterError(f"{node.sql()} cannot be compared with a column of type {typ}: {e}") from None
