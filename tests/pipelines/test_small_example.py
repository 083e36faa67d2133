"""The small example as `make demo-small` runs it (examples/small.yaml, a 400-customer demo warehouse),
then read through the Python API as docs/guide/python-api.md does: the report table of every scenario,
the newest day's scores, and the same scores read back through `habitus.Project`."""

from pathlib import Path

import pyarrow.parquet as pq
import pytest

import habitus
from habitus.pipelines.cli import EXIT_OK, main

SMALL = Path(__file__).resolve().parents[2] / "examples" / "small.yaml"


@pytest.mark.slow
def test_make_demo_small_prints_its_table_and_the_api_reads_what_it_wrote(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HABITUS_WORKSPACE", str(tmp_path / "ws"))
    monkeypatch.setenv("HABITUS_DEMO_WAREHOUSE", str(tmp_path / "small_warehouse.duckdb"))
    rc = main(["demo", "--config", str(SMALL), "--customers", "400"])
    out = capsys.readouterr().out
    assert rc == EXIT_OK, out
    assert "demo warehouse " in out and "'customers': 400" in out
    assert "all assets materialized in " in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split() and line.split()[0] in ("churn", "brand_propensity", "spend", "next_products",
                                                   "next_category")}
    assert list(rows) == ["churn", "brand_propensity", "spend", "next_products", "next_category"], out
    assert rows["churn"][1:3] == ["binary", "auroc"] and 0.5 < float(rows["churn"][3]) <= 1

    project = habitus.Project(SMALL, log=lambda line: None)
    assert project.report().column("scenario").to_pylist() == list(rows)
    written = tmp_path / "ws" / "predictions" / "churn" / "2026-10-31.parquet"
    scores = project.predict("churn", "2026-10-31")
    assert scores.equals(pq.read_table(written)) and 0 < scores.num_rows <= 400
