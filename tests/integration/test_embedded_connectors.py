"""The embedded default (DuckDB) and local Parquet through the same type contract as the servers:
each type written, read back and extracted as canonical Parquet keeps its values."""

import pytest

from resources.duckdb import DuckDBWarehouse
from resources.parquet import ParquetWarehouse

pytestmark = pytest.mark.integration


def test_duckdb_types_survive_extraction(contract, tmp_path):
    contract.types_survive_extraction(DuckDBWarehouse(path=str(tmp_path / "wh.duckdb")), tmp_path)


def test_parquet_types_survive_extraction(contract, tmp_path):
    (tmp_path / "lake").mkdir()
    contract.types_survive_extraction(ParquetWarehouse(path=str(tmp_path / "lake")), tmp_path)
