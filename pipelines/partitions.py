"""The partitions: event sources by month (or day), predictions by day."""

import dagster as dg


def events_partitions(source) -> dg.TimeWindowPartitionsDefinition:
    start = source.start.isoformat()
    if source.partition == "daily":
        return dg.DailyPartitionsDefinition(start_date=start)
    return dg.MonthlyPartitionsDefinition(start_date=start)


def predictions_partitions(project) -> dg.DailyPartitionsDefinition:
    start = project.predictions.start or project.events_sources[0].start
    return dg.DailyPartitionsDefinition(start_date=start.isoformat())
