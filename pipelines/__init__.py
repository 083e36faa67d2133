"""How habitus is driven: the project config, the Dagster wiring and the ways in. Its rooms, bottom to top:

    config < demo < orchestration < init < run

A module imports its own room and the rooms below it, never one above (tests/pipelines/test_layers.py):

- config: the project YAML parsed into typed settings (ProjectConfig, load_project), its file handling
  (`${VAR}`, paths, errors naming the key) and the generated config reference;
- demo: the generated retail warehouse of `habitus demo`;
- orchestration: the Dagster objects built from a config: assets and resources, partitions, jobs,
  sensors, schedules, the instance, the Kubernetes executor;
- init: `habitus init`, a suggested config from a connection's tables;
- run: the runner (a selection of assets materialized with its checks and stop rules), the days a run
  scores, the progress display, the report, and the managed-job stages.

On top of the rooms stand the three doors, thin shells over the runner and the wiring: cli.py (the
`habitus` command), api.py (`habitus.Project`) and definitions.py (the Dagster code location).
"""
