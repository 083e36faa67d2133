"""Quarantine of bad event rows before they are encoded: each dropped or repaired row is counted by
reason, never silently lost or silently trained on.

    kept, counts = quarantine(con, "raw_events", {"product_id": "categorical", "price": "numeric"},
                              now_s=int(time.time()))

(`screen` + `finish` are the same in two steps, for a caller that drops the duplicates itself: the
cache finds them in its sorted encoding pass instead of a DISTINCT over every row.)

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


def screen(con, view: str, columns: dict[str, str], *, now_s: int) -> tuple[str, dict]:
    """One pass over `view`: the counts by drop and repair reason, all but `duplicate_event` (which
    needs the rows compared with one another). Creates the view `<view>_valid` of the rows that pass,
    numerics repaired, and returns its name and the counts; `finish` completes the counts once the
    duplicates are known."""
    for column, kind in columns.items():
        if kind not in ("categorical", "numeric"):
            raise ValueError(f"column {column!r}: type {kind!r} cannot be quarantined (categorical or numeric)")
    future = f"make_timestamp(CAST({int(now_s) + FUTURE_SLACK_S} AS BIGINT) * 1000000)"
    # the first reason that applies, as its index in DROP_REASONS; NULL: the row passes
    reason = ("CASE WHEN __entity IS NULL THEN 0 "
              "WHEN trim(__entity) = '' THEN 1 "
              "WHEN __ts IS NULL THEN 2 "
              "WHEN __ts < TIMESTAMP '1970-01-01 00:00:00' THEN 3 "
              f"WHEN __ts > {future} THEN 4 ELSE NULL END")
    numeric = [c for c, kind in columns.items() if kind == "numeric"]
    # per numeric column, what its raw value needs: 0 nothing, 1 not finite (inf, nan), 2 not a number at all
    flags = "".join(f", CASE WHEN {_as_double(c)} IS NOT NULL AND NOT isfinite({_as_double(c)}) THEN 1 "
                    f"WHEN {q(c)} IS NOT NULL AND {_as_double(c)} IS NULL THEN 2 ELSE 0 END AS __bad{i}"
                    for i, c in enumerate(numeric))
    # grouped by reason and repairs (a handful of groups), not counted with one FILTER per reason and
    # column: one cheap pass however many reasons and columns
    keys = ["__why"] + [f"__bad{i}" for i in range(len(numeric))]
    groups = con.sql(f"SELECT {', '.join(keys)}, count(*) FROM (SELECT {reason} AS __why{flags} FROM {q(view)}) "
                     f"GROUP BY ALL").fetchall()
    k = len(keys)
    counts = {"rows_in": sum(g[k] for g in groups)}
    counts.update({r: sum(g[k] for g in groups if g[0] == i) for i, r in enumerate(DROP_REASONS[:-1])})
    valid_groups = [g for g in groups if g[0] is None]
    counts["rows_repaired"] = sum(g[k] for g in valid_groups if any(g[1:k]))
    for i, c in enumerate(numeric):
        counts[f"numeric_not_finite.{c}"] = sum(g[k] for g in valid_groups if g[1 + i] == 1)
        counts[f"numeric_unparseable.{c}"] = sum(g[k] for g in valid_groups if g[1 + i] == 2)
    for r in REPAIR_REASONS:
        counts[r] = sum(counts[f"{r}.{c}"] for c in numeric)
    counts["rows_valid"] = sum(g[k] for g in valid_groups)

    # every column of `view` is kept (others pass through unchanged); numerics become DOUBLE, repaired.
    # Only the rules that dropped or repaired a row are applied again: on clean data the view is a
    # plain projection, which keeps the passes over it as cheap as scans (DuckDB keeps Parquet's
    # dictionary-encoded strings as they are through a projection, not through the CASE above)
    rules = {"null_entity": "__entity IS NOT NULL", "blank_entity": "trim(__entity) <> ''",
             "null_timestamp": "__ts IS NOT NULL", "timestamp_before_1970": "__ts >= TIMESTAMP '1970-01-01 00:00:00'",
             "timestamp_in_future": f"__ts <= {future}"}
    where = " AND ".join(rule for r, rule in rules.items() if counts[r]) or "true"
    fixes = ", ".join(f"CASE WHEN isfinite({_as_double(c)}) THEN {_as_double(c)} END AS {q(c)}"
                      if counts[f"numeric_not_finite.{c}"] or counts[f"numeric_unparseable.{c}"]
                      else f"{_as_double(c)} AS {q(c)}" for c in numeric)
    name = f"{view}_valid"
    con.sql(f"CREATE OR REPLACE TEMP VIEW {q(name)} AS SELECT *{f' REPLACE ({fixes})' if fixes else ''} "
            f"FROM {q(view)} WHERE {where}")
    return name, counts


def finish(counts: dict, rows_kept: int) -> dict:
    """The counts of `screen` completed with the rows kept once exact copies are dropped."""
    counts = {k: v for k, v in counts.items() if k != "rows_valid"} | {"rows_kept": int(rows_kept)}
    valid = counts["rows_in"] - sum(counts[r] for r in DROP_REASONS[:-1])
    counts["duplicate_event"] = valid - counts["rows_kept"]
    counts["dropped_share"] = round((counts["rows_in"] - counts["rows_kept"]) / counts["rows_in"], 6) \
        if counts["rows_in"] else 0.0
    counts["repaired_share"] = round(counts["rows_repaired"] / counts["rows_in"], 6) if counts["rows_in"] else 0.0
    return counts


def quarantine(con, view: str, columns: dict[str, str], *, now_s: int) -> tuple[str, dict]:
    """Create the view `<view>_kept` of the rows to keep (numerics repaired, exact copies dropped)
    and return its name and the counts by reason (see the module docstring)."""
    valid, counts = screen(con, view, columns, now_s=now_s)
    kept = f"{view}_kept"
    con.sql(f"CREATE OR REPLACE TEMP VIEW {q(kept)} AS SELECT DISTINCT * FROM {q(valid)}")
    return kept, finish(counts, con.sql(f"SELECT count(*) FROM {q(kept)}").fetchall()[0][0])


def summary(counts: dict) -> str:
    """One line for a log or a check: the reasons that occurred, with their row counts."""
    parts = [f"{counts[r]:,} {r.replace('_', ' ')}" for r in DROP_REASONS + REPAIR_REASONS if counts.get(r)]
    head = f"{counts.get('rows_in', 0):,} rows in, {counts.get('rows_kept', 0):,} kept"
    return head + (": " + ", ".join(parts) if parts else "; nothing dropped or repaired")
