"""Quarantine of bad event rows before they are encoded: each dropped or repaired row is counted by
reason, never silently lost or silently trained on.

    kept, counts = quarantine(con, "raw_events", {"product_id": "categorical", "price": "numeric"},
                              now_s=int(time.time()))

`view` has the columns `__entity` VARCHAR, `__ts` TIMESTAMP (UTC), `__source` INTEGER and the event
columns; `columns` names the categorical and numeric ones (any other column, e.g. a second time
column, passes through unchanged but still counts for duplicates). Each row is dropped for the first reason that applies, in this order:

    null_entity            no entity id
    blank_entity           an entity id of only blanks ('' or spaces): a placeholder, not an entity
    null_timestamp         no time
    timestamp_before_1970  before 1970-01-01 (a default value or a unit error)
    timestamp_in_future    more than a day after `now_s` (a typo, or milliseconds read as seconds)
    duplicate_event        an exact copy (every column, the source included) of a row that is kept

and numeric values are repaired to NULL (the row is kept; the model sees "missing"):

    numeric_not_finite     inf, -inf or NaN
    numeric_unparseable    a value that is not a number (e.g. text in a column configured numeric)

Counts: `rows_in`, `rows_kept`, one per drop reason, one per repair reason, and `<reason>.<column>`
for the repairs of each column. `dropped_share` / `repaired_share` (of rows_in) feed the asset check
that fails beyond a configured share. Names only ever reach SQL quoted.
"""

DROP_REASONS = ("null_entity", "blank_entity", "null_timestamp", "timestamp_before_1970", "timestamp_in_future",
                "duplicate_event")
REPAIR_REASONS = ("numeric_not_finite", "numeric_unparseable")
FUTURE_SLACK_S = 86_400  # clocks and time zones: a day ahead of now is still plausible


def q(name: str) -> str:
    """A SQL identifier, quoted (a name from a config or a table can hold any character)."""
    return '"' + str(name).replace('"', '""') + '"'


def _as_double(column: str) -> str:
    return f"TRY_CAST({q(column)} AS DOUBLE)"


def quarantine(con, view: str, columns: dict[str, str], *, now_s: int) -> tuple[str, dict]:
    """Create the view `<view>_kept` of the rows to keep (numerics repaired) and return its name and
    the counts by reason (see the module docstring)."""
    for column, kind in columns.items():
        if kind not in ("categorical", "numeric"):
            raise ValueError(f"column {column!r}: type {kind!r} cannot be quarantined (categorical or numeric)")
    future = f"make_timestamp(CAST({int(now_s) + FUTURE_SLACK_S} AS BIGINT) * 1000000)"
    reason = ("CASE WHEN __entity IS NULL THEN 'null_entity' "
              "WHEN trim(__entity) = '' THEN 'blank_entity' "
              "WHEN __ts IS NULL THEN 'null_timestamp' "
              "WHEN __ts < TIMESTAMP '1970-01-01 00:00:00' THEN 'timestamp_before_1970' "
              f"WHEN __ts > {future} THEN 'timestamp_in_future' ELSE NULL END")
    numeric = [c for c, kind in columns.items() if kind == "numeric"]
    repairs = []
    for c in numeric:
        repairs += [f"count(*) FILTER (WHERE __why IS NULL AND {_as_double(c)} IS NOT NULL "
                    f"AND NOT isfinite({_as_double(c)}))",
                    f"count(*) FILTER (WHERE __why IS NULL AND {q(c)} IS NOT NULL AND {_as_double(c)} IS NULL)"]
    any_bad = " OR ".join(f"({_as_double(c)} IS NOT NULL AND NOT isfinite({_as_double(c)})) OR "
                          f"({q(c)} IS NOT NULL AND {_as_double(c)} IS NULL)" for c in numeric) or "false"
    row = con.sql(
        f"SELECT count(*), {', '.join(f'count(*) FILTER (WHERE __why = {r!r})' for r in DROP_REASONS[:-1])}, "
        f"count(*) FILTER (WHERE __why IS NULL AND ({any_bad}))"
        + "".join(f", {r}" for r in repairs)
        + f" FROM (SELECT *, {reason} AS __why FROM {q(view)})").fetchall()[0]
    counts = {"rows_in": int(row[0])}
    counts.update({r: int(v) for r, v in zip(DROP_REASONS[:-1], row[1:len(DROP_REASONS)])})
    repaired_rows = int(row[len(DROP_REASONS)])
    per_column = [int(v) for v in row[len(DROP_REASONS) + 1:]]
    for i, c in enumerate(numeric):
        counts[f"numeric_not_finite.{c}"] = per_column[2 * i]
        counts[f"numeric_unparseable.{c}"] = per_column[2 * i + 1]
    for r in REPAIR_REASONS:
        counts[r] = sum(counts[f"{r}.{c}"] for c in numeric)

    # every column of `view` is kept (others pass through unchanged); numerics become DOUBLE, repaired
    repaired = ", ".join(f"CASE WHEN isfinite({_as_double(c)}) THEN {_as_double(c)} END AS {q(c)}" for c in numeric)
    kept = f"{view}_kept"
    con.sql(f"CREATE OR REPLACE TEMP VIEW {q(kept)} AS SELECT DISTINCT * EXCLUDE (__why)"
            f"{f' REPLACE ({repaired})' if repaired else ''} "
            f"FROM (SELECT *, {reason} AS __why FROM {q(view)}) WHERE __why IS NULL")
    valid = counts["rows_in"] - sum(counts[r] for r in DROP_REASONS[:-1])
    counts["rows_kept"] = int(con.sql(f"SELECT count(*) FROM {q(kept)}").fetchall()[0][0])
    counts["duplicate_event"] = valid - counts["rows_kept"]
    counts["rows_repaired"] = repaired_rows
    counts["dropped_share"] = round((counts["rows_in"] - counts["rows_kept"]) / counts["rows_in"], 6) \
        if counts["rows_in"] else 0.0
    counts["repaired_share"] = round(repaired_rows / counts["rows_in"], 6) if counts["rows_in"] else 0.0
    return kept, counts


def summary(counts: dict) -> str:
    """One line for a log or a check: the reasons that occurred, with their row counts."""
    parts = [f"{counts[r]:,} {r.replace('_', ' ')}" for r in DROP_REASONS + REPAIR_REASONS if counts.get(r)]
    head = f"{counts.get('rows_in', 0):,} rows in, {counts.get('rows_kept', 0):,} kept"
    return head + (": " + ", ".join(parts) if parts else "; nothing dropped or repaired")
