"""The project config's connections and sources (`connections:`, `sources:`): where the data is and which
tables habitus reads. habitus.pipelines.config.project holds the rest of the schema and re-exports these."""

from datetime import date
from typing import Annotated, Literal, Union

from pydantic import ConfigDict, Field, model_validator

from habitus.pipelines.config.base import Strict
from habitus.pipelines.config.operations import RetrySettings


# --------------------------------------------------------------------------- connections


class DuckDBConnection(Strict):
    type: Literal["duckdb"] = Field(description="the embedded engine reading one database file")
    path: str = Field(description="DuckDB database file")


class ParquetConnection(Strict):
    type: Literal["parquet"] = Field(description="Parquet files in a folder or under an s3:// prefix")
    path: str = Field(description="folder holding <table>.parquet files or <table>/ folders")
    endpoint: str | None = Field(None, description="s3:// paths: an S3-compatible endpoint, 'http://host:port'")
    region: str | None = Field(None, description="s3:// paths: the bucket's region")


class WarehouseConnection(Strict):
    """Connectors beyond the embedded default; parameters are passed to the driver as given."""

    model_config = ConfigDict(extra="allow", frozen=True)
    type: Literal["snowflake", "bigquery", "clickhouse", "synapse", "databricks", "hive"] = Field(
        description="the warehouse; install its extra, e.g. pip install -e '.[snowflake]' (the connectors page)")


Connection = Annotated[Union[DuckDBConnection, ParquetConnection, WarehouseConnection], Field(discriminator="type")]


# --------------------------------------------------------------------------- sources

ColumnType = Literal["categorical", "numeric", "timestamp", "text"]


class Source(Strict):
    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="the source's name: its asset is "
                      "source/<name>, and targets name it (`no_event: purchases`)")
    role: Literal["events", "entity_attributes", "attributes"] = Field(
        description="events: timestamped rows of an entity; entity_attributes: one row per entity, joined on "
                    "`entity`; attributes: one row per value of an event column, joined on `key`")
    connection: str = Field(description="a name under `connections:`")
    table: str = Field(description="the table (schema.table and catalog.schema.table work; Parquet: the file's "
                                   "or folder's name)")
    timestamp: str | None = Field(None, description="the time column; required for events")
    key: str | None = Field(None, description="join key of an `attributes` table (a column of the events)")
    columns: list[str] = Field(default_factory=list, description="columns to use; empty = all")
    types: dict[str, ColumnType] = Field(default_factory=dict, description="override inferred column types; `text`: "
                                         "a string column of names or descriptions, also embedded as a vector "
                                         "(events and attributes sources)")
    where: str | None = Field(None, description="a row filter run in the warehouse (Parquet: in the scan), e.g. "
                              "`country = 'PL' AND NOT is_test`: comparisons, AND/OR/NOT, IN (values), IS [NOT] NULL, "
                              "BETWEEN, LIKE, LOWER/UPPER of a column; a change extracts the source again")
    partition: Literal["monthly", "daily"] = Field("monthly", description="an events source's partitions: "
                                                   "one extraction per month or per day")
    start: date | None = Field(None, description="first partition of an events source")
    end: date | None = Field(None, description="end of the last partition (exclusive), for data that stopped")
    retries: RetrySettings | None = Field(None, description="this source's extraction retries, key by key over "
                                                            "the top-level `retries:`")

    @model_validator(mode="after")
    def _role_needs(self):
        if self.role == "events" and (self.timestamp is None or self.start is None):
            raise ValueError("an events source needs `timestamp` (its time column) and `start` (first partition date)")
        if self.role == "attributes" and self.key is None:
            raise ValueError("an attributes source needs `key`: the event column it joins on")
        text = sorted(c for c, kind in self.types.items() if kind == "text")
        if text and self.role == "entity_attributes":
            raise ValueError(f"source {self.name!r}: `type: text` ({text}) describes events or the items of an attributes "
                             f"source; an entity's text column is `categorical`")
        if set(text) & {self.timestamp, self.key}:
            raise ValueError(f"source {self.name!r}: column {sorted(set(text) & {self.timestamp, self.key})[0]!r} is the "
                             f"source's `timestamp` or `key`; it cannot be `type: text`")
        if self.where is not None:
            from habitus.resources.warehouses import row_filter

            try:
                row_filter.parse(self.where)
            except row_filter.FilterError as e:
                raise ValueError(f"source {self.name!r}: `where: {self.where}` {e}") from None
        if len(set(self.columns)) != len(self.columns):
            dup = sorted({c for c in self.columns if self.columns.count(c) > 1})
            raise ValueError(f"columns named more than once: {dup}")
        return self
