"""The partitions: event sources by month (or day), predictions by day. The events partitions are
the source assets' own (assets/sources.py: their keys name the files the cache reads)."""

import dagster as dg

from habitus.assets.sources import events_partitions

__all__ = ["events_partitions", "predictions_partitions"]


def predictions_partitions(project) -> dg.DailyPartitionsDefinition:
    start = project.predictions.start or project.events_sources[0].start
    ends = [s.end for s in project.events_sources]
    end = max(ends).isoformat() if all(ends) else None  # scoring stops where the data stopped
    return dg.DailyPartitionsDefinition(start_date=start.isoformat(), end_date=end)
