"""Which failures of an extraction are retried, and how.

The source assets carry a Dagster `RetryPolicy` (`extraction_retry_policy`): up to 3 retries of the
step after 10 s, 30 s and 70 s (Dagster's exponential backoff, (2**n - 1) x the delay, each +- 10 s of
jitter so that many runs do not come back at once), so a warehouse that restarts,
a connection that drops in the middle of a partition or a throttled endpoint costs a minute, not a
failed run. Only transient errors are retried (`retry_transient_only`): a `WarehouseError` whose
connector classified it as transient (resources/warehouses/errors.py, each connector's `transient`). Everything
else fails at once, without spending the retries: a refused login, a missing table or column, bad
SQL, a value that does not fit, a full disk. A retried step extracts its partitions again; each one
replaces its file whole (canonical Parquet, resources/warehouses/canonical.py), so the retried run's files have
the same bytes as an undisturbed one's.

The project config sets the number of retries and the first delay: `retries: {max_retries: 3, delay_s: 10}`
at the top level for every source, and in a source for that one (pipelines/config/operations.py:
RetrySettings, which holds the defaults).
"""

import functools

import dagster as dg

from habitus.resources.warehouses.errors import WarehouseError


def extraction_retry_policy(max_retries: int, delay_s: float) -> dg.RetryPolicy:
    """Dagster's RetryPolicy for a source asset: `max_retries` retries, the n-th after (2**n - 1) x `delay_s`
    seconds +- `delay_s` of jitter (a project's `retries:`, `ProjectConfig.extraction_retries(source)`)."""
    return dg.RetryPolicy(max_retries=max_retries, delay=delay_s, backoff=dg.Backoff.EXPONENTIAL,
                          jitter=dg.Jitter.PLUS_MINUS)


def _where(context) -> str:
    keys = context.partition_keys if context.has_partition_key_range or context.has_partition_key else []
    part = (f"partition {keys[0]}" if len(keys) == 1 else f"partitions {keys[0]}..{keys[-1]}") if keys else "table"
    attempt = getattr(context, "retry_number", 0) + 1
    return f"{context.asset_key.to_user_string()} ({part}, attempt {attempt})"


def retry_transient_only(fn):
    """The asset function `fn(context)` whose transient warehouse errors go to the RetryPolicy and whose
    other errors fail the step at once (`dg.Failure(allow_retries=False)`), each message naming the asset,
    its partitions and the attempt."""

    @functools.wraps(fn)
    def wrapper(context, *args, **kwargs):
        try:
            return fn(context, *args, **kwargs)
        except WarehouseError as e:
            if e.transient:
                context.log.warning(f"{_where(context)}: {e}; a transient error: the step is retried")
                raise dg.Failure(f"{_where(context)}: {e}", allow_retries=True) from e
            raise dg.Failure(f"{_where(context)}: {e} (a permanent error: not retried)", allow_retries=False) from None
        except dg.Failure as e:
            if not e.allow_retries:
                raise
            raise dg.Failure(e.description, metadata=e.metadata, allow_retries=False) from None
        except Exception as e:  # a bug, a full disk, an unclassified driver error: retrying changes nothing
            raise dg.Failure(f"{_where(context)}: {type(e).__name__}: {e} (not a transient warehouse error: not "
                             f"retried)", allow_retries=False) from e

    return wrapper
