"""`habitus materialize` as a person runs it: days to score (--date, --from/--to) checked before any
work, a short output (progress lines, the report, the failed checks), and exit codes that say what
happened. The project's data ends on 2026-10-31 and the config's `end` is a week later (days after the
data can be asked for, with a warning): nothing here depends on today's date."""

from datetime import datetime

import pyarrow.parquet as pq
import pytest

from habitus.pipelines.cli import EXIT_CHECK_FAILED, EXIT_OK, EXIT_STAGE_FAILED, EXIT_USAGE, main
from habitus.pipelines.run.runner import scoring_days
from habitus.pipelines.config.project import ConfigError, load_project
from habitus.pipelines.run.report import failed_checks_table



def _config(small_project, purchases=("product_id", "quantity", "price")) -> dict:
    return small_project.config(
        purchases=purchases, events={"end": "2026-11-08"}, customers=["age", "region"],
        foundation={"epochs": 2, "batch_size": 256},
        scenarios={"churn": small_project.churn(epochs=2), "brands": small_project.brands(5, epochs=2)},
        predictions={"top_k": 3, "start": "2026-10-01"})


@pytest.fixture(scope="module")
def folder(tmp_path_factory, small_project):
    root = tmp_path_factory.mktemp("cli")
    small_project.write(root, _config(small_project), customers=250, products=60, stores=4, seed=4)
    return root


def test_days_are_checked_against_the_predictions_range(folder):
    project = load_project(folder / "project.yaml")
    assert scoring_days(project) == []
    assert scoring_days(project, "2026-10-15") == ["2026-10-15"]
    assert scoring_days(project, None, "2026-10-30", "2026-10-31") == ["2026-10-30", "2026-10-31"]
    with pytest.raises(ConfigError, match=r"2026-09-30 is before the first day that can be scored, 2026-10-01 "
                                          r"\(predictions.start\); set predictions.start to 2026-09-30 or earlier"):
        scoring_days(project, "2026-09-30")
    with pytest.raises(ConfigError, match=r"2026-11-08 is after the last day that can be scored, 2026-11-07 "
                                          r"\(the events' `end`, 2026-11-08, exclusive\)"):
        scoring_days(project, None, "2026-10-30", "2026-11-08")
    with pytest.raises(ConfigError, match="--from and --to go together"):
        scoring_days(project, None, "2026-10-30", None)
    with pytest.raises(ConfigError, match="--date 2026-10-32: a day is written YYYY-MM-DD"):
        scoring_days(project, "2026-10-32")


def test_a_day_before_predictions_start_is_a_usage_error_before_any_work(folder, capsys):
    rc = main(["materialize", "--config", str(folder / "project.yaml"), "--date", "2026-09-15"])
    err = capsys.readouterr().err
    assert rc == EXIT_USAGE and "(predictions.start)" in err
    assert not (folder / "ws" / "sources").exists()  # nothing was extracted


def test_failed_checks_table_names_severity_and_reason():
    table = failed_checks_table([
        {"asset": "source/purchases", "check": "volume_guidelines", "severity": "warn", "blocking": False,
         "reason": "370 entities (guideline: at least 10,000)"},
        {"asset": "cache", "check": "join_coverage", "severity": "error", "blocking": True,
         "reason": "3% of the events find their product"}])
    assert table.splitlines() == [
        "failed checks:",
        "  source/purchases volume_guidelines  WARN             370 entities (guideline: at least 10,000)",
        "  cache join_coverage                 ERROR, blocking  3% of the events find their product"]


@pytest.mark.slow
def test_materialize_a_date_then_a_range(folder, capsys):
    """--date D writes D's predictions and embeddings as of D+1 00:00; --from/--to writes each day.
    The output is short; a failed blocking check is not a success."""
    rc = main(["materialize", "--config", str(folder / "project.yaml"), "--date", "2026-10-15"])
    out = capsys.readouterr()
    lines = (out.out + out.err).splitlines()
    assert len(lines) <= 60, "\n".join(lines)
    assert not any(" - dagster - " in line for line in lines)  # Dagster's own log only with -v
    assert "predictions and embeddings for 2026-10-15" in out.err
    assert "  ✓ foundation_model" in out.err and "  ✓ scenario/brands" in out.err
    report = out.out
    assert "ERROR, blocking" not in report
    lost = [line for line in report.splitlines() if " beats_baselines " in line]
    if lost:  # listed plainly at the end, by name and reason, as a warning
        assert "failed checks:" in report and all("WARN" in line for line in lost)
    # a model that loses to its baselines is not promoted (its best baseline serves), and is not a failed run
    assert rc == EXIT_OK, report
    for path in (folder / "ws" / "predictions" / "churn" / "2026-10-15.parquet",
                 folder / "ws" / "predictions" / "brands" / "2026-10-15.parquet",
                 folder / "ws" / "embeddings" / "2026-10-15.parquet"):
        table = pq.read_table(path)
        assert table.num_rows > 0 and set(table.column("as_of").to_pylist()) == {datetime(2026, 10, 16)}
    assert not (folder / "ws" / "predictions" / "churn" / "2026-10-31.parquet").exists()

    rc = main(["materialize", "--config", str(folder / "project.yaml"), "--from", "2026-10-31", "--to", "2026-11-01"])
    out = capsys.readouterr()
    assert rc in (EXIT_OK, EXIT_CHECK_FAILED), out.err
    assert "predictions and embeddings for 2026-10-31 .. 2026-11-01" in out.err
    assert "scoring 2026-11-01: after the newest event in the data (2026-10-31)" in out.out
    for day, as_of in (("2026-10-31", datetime(2026, 11, 1)), ("2026-11-01", datetime(2026, 11, 2))):
        for path in (folder / "ws" / "predictions" / "brands" / f"{day}.parquet",
                     folder / "ws" / "embeddings" / f"{day}.parquet"):
            assert set(pq.read_table(path).column("as_of").to_pylist()) == {as_of}


def test_a_stage_that_fails_is_exit_code_3_with_its_message(folder, tmp_path, capsys, small_project):
    import shutil

    shutil.copy(folder / "warehouse.duckdb", tmp_path / "warehouse.duckdb")
    small_project.write(tmp_path, _config(small_project, purchases=["product_id", "nope"]))
    rc = main(["materialize", "--config", str(tmp_path / "project.yaml")])
    err = capsys.readouterr().err
    assert rc == EXIT_STAGE_FAILED
    assert "error: a stage failed: source/purchases: source 'purchases' (table 'purchases'): column(s) ['nope'] " \
           "not found" in err
    assert "Traceback" not in err and " - dagster - " not in err
    # -v: Dagster's own log, DEBUG events included
    rc = main(["materialize", "--config", str(tmp_path / "project.yaml"), "-v"])
    out = capsys.readouterr()
    assert rc == EXIT_STAGE_FAILED and " - dagster - DEBUG - " in out.out + out.err
