"""Runs: the runner that materializes a selection of assets with its checks and stop rules, the days a
run scores, the progress display, the report and the managed-job stages."""
