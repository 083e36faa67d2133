"""The runner's stop rules (pipelines/run/runner.py), which `habitus materialize`, habitus.Project and the
managed jobs share: which failed checks fail a run, and which stop the stages after them."""

from habitus.pipelines.run.runner import blocking_failures, is_blocking, only_scenarios_blocked


def _failure(asset: str, check: str, severity: str, blocking: bool) -> dict:
    return {"asset": asset, "check": check, "severity": severity, "blocking": blocking, "reason": "r"}


def test_only_a_blocking_error_fails_the_run():
    warn = _failure("cache", "join_coverage", "warn", True)  # a blocking check that failed with WARN
    plain_error = _failure("source/purchases", "timestamps_plausible", "error", False)
    blocking = _failure("cache", "rows_quarantined", "error", True)
    assert [is_blocking(f) for f in (warn, plain_error, blocking)] == [False, False, True]
    assert blocking_failures({"failures": [warn, plain_error]}) == []
    assert blocking_failures({"failures": [warn, plain_error, blocking]}) == [blocking]


def test_a_blocked_scenario_stops_only_itself():
    scenario = _failure("scenario/churn", "beats_baselines", "error", True)
    cache = _failure("cache", "free_space_for_training", "error", True)
    assert only_scenarios_blocked([scenario])  # the other scenarios score, each from its serving version
    assert only_scenarios_blocked([scenario, _failure("cache", "join_coverage", "warn", True)])
    assert not only_scenarios_blocked([scenario, cache])  # nothing after the cache runs
    assert only_scenarios_blocked([])
