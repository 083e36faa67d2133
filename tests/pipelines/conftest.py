"""Fixtures of the pipelines tests: `habitus init` run in process, and small DuckDB files to run it on."""

import pytest
import yaml

from habitus.pipelines.cli import main as cli


class InitCommand:
    """`habitus init ARGS` in this process, its output read from capsys."""

    def __init__(self, capsys):
        self.capsys = capsys

    def __call__(self, *argv: str) -> tuple[int, str, str]:
        """(exit code, stdout, stderr)."""
        rc = cli(["init", *argv])
        out = self.capsys.readouterr()
        return rc, out.out, out.err

    def suggestion(self, *argv: str) -> tuple[dict, str, str]:
        """(the suggested config, stdout, stderr) of a run that must succeed."""
        rc, out, err = self(*argv)
        assert rc == 0, err
        return yaml.safe_load(out), out, err


@pytest.fixture
def habitus_init(capsys) -> InitCommand:
    return InitCommand(capsys)


@pytest.fixture
def duckdb_file(tmp_path, duckdb_sql):
    """`duckdb_file(name, *statements)`: a DuckDB file in tmp_path made by the statements; its path."""
    return lambda name, *statements: duckdb_sql(tmp_path / name, *statements)
