"""The Dagster objects built from a project config: assets and resources, partitions, jobs, sensors,
schedules, the instance and the Kubernetes executor."""
