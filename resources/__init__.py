"""What the assets read, write and train on. Its rooms, bottom to top:

    store < warehouses < training

A module imports its own room and the rooms below it, never one above (tests/pipelines/test_layers.py):

- store: the workspace on disk, the `output:` store it uploads to and restores from, their manifests,
  the free-space check, and the one redactor of URLs and messages (every room's errors use it);
- warehouses: one connector per warehouse (DuckDB, Parquet, Snowflake, ClickHouse, Databricks, Synapse,
  Hive, BigQuery), the SQL and row filters they run, the canonical Arrow schema of what they extract,
  their errors and retries, and which values are secrets (by key name and by origin);
- training: where training runs (the executor: device, precision, processes) and where it is recorded
  (MLflow tracking, whose warnings and params go through the same redactor).
"""
