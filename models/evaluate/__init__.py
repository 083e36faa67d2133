"""The hold-out: metrics, baselines and the evaluation of a scenario."""
