"""The partitions: event sources by month (or day), predictions by day."""

import dagster as dg


def events_partitions(source) -> dg.TimeWindowPartitionsDefinition:
    start = source.start.isoformat()
    end = source.end.isoformat() if source.end else None
    if source.partition == "daily":
        return dg.DailyPartitionsDefinition(start_date=start, end_date=end)
    return dg.MonthlyPartitionsDefinition(start_date=start, end_date=end)


def predictions_partitions(project) -> dg.DailyPartitionsDefinition:
    start = project.predictions.start or project.events_sources[0].start
    ends = [s.end for s in project.events_sources]
    end = max(ends).isoformat() if all(ends) else None  # scoring stops where the data stopped
    return dg.DailyPartitionsDefinition(start_date=start.isoformat(), end_date=end)
