"""Fixtures shared by every test package."""

import contextlib
import gc

import dagster as dg
import pytest


@contextlib.contextmanager
def clean_instance_for_test():
    """dg.instance_for_test(), restoring Dagster's current defs-state storage afterwards. In 1.13.27 an
    instance entered while another is current can leave a context manager behind that, when garbage
    collected later, sets the storage of a disposed instance as current; the next Definitions load in
    this process then fails with 'undefined DagsterInstance weakref'. Collect those here and reset."""
    from dagster._core.storage.defs_state.base import set_defs_state_storage

    with set_defs_state_storage(None):
        with dg.instance_for_test() as instance:
            yield instance
        gc.collect()


@pytest.fixture
def instance():
    """A temporary Dagster instance (runs, materializations, sensor state)."""
    with clean_instance_for_test() as inst:
        yield inst


def run_duckdb_sql(path, *statements: str):
    """The statements, in order, on the DuckDB file `path` (created when missing); returns `path`."""
    import duckdb

    con = duckdb.connect(str(path))
    try:
        for sql in statements:
            con.sql(sql)
    finally:
        con.close()
    return path


class SensorDriver:
    """A sensor ticked and the runs it requests executed in process, as the daemon would do them."""

    def __init__(self, defs, instance, resources):
        self.defs, self.instance, self.resources = defs, instance, resources

    def tick(self, name, cursor):
        context = dg.build_sensor_context(cursor=cursor, instance=self.instance, resources=self.resources,
                                          definitions=self.defs)
        return self.defs.resolve_sensor_def(name).evaluate_tick(context)

    def run(self, job, request):
        result = self.defs.resolve_job_def(job).execute_in_process(
            instance=self.instance, partition_key=request.partition_key, tags=request.tags,
            asset_selection=request.asset_selection, raise_on_error=False)
        assert result.success
        return result


@pytest.fixture(scope="session")
def sensor_driver():
    return SensorDriver


@pytest.fixture(scope="session")
def duckdb_sql():
    """`duckdb_sql(path, *statements)`: run SQL statements on a DuckDB file (a warehouse to break, a table
    to add); returns the path."""
    return run_duckdb_sql


class SmallProject:
    """Small projects on the generated demo warehouse (pipelines/demo/data.py), as the end-to-end, CLI,
    asset and fault tests build them: `config(...)` gives the shape they share (a DuckDB warehouse, the
    purchases/customers/products sources, a one-layer foundation), each test naming what differs;
    `write(...)` puts it next to its warehouse."""

    @staticmethod
    def config(*, purchases=("product_id", "price"), customers=("age",), products=("brand",), events=None,
               foundation=None, scenarios=None, predictions=None, workspace="ws", connection=None, **top) -> dict:
        """`purchases`, `customers`, `products`: each source's columns; `events`: more keys of the
        purchases source (end, partition, ...); `foundation`: keys over the small default one; `top`:
        any other top-level key (output, executor, ...)."""
        def source(name, role, columns, **keys):
            return {"name": name, "role": role, "connection": "warehouse", "table": name, **keys,
                    "columns": list(columns)}

        return {
            "workspace": workspace,
            "connections": {"warehouse": connection or {"type": "duckdb", "path": "warehouse.duckdb"}},
            "entity": "customer_id",
            "sources": [source("purchases", "events", purchases, **{"timestamp": "ts", "start": "2026-03-01",
                                                                     **(events or {})}),
                        source("customers", "entity_attributes", customers),
                        source("products", "attributes", products, key="product_id")],
            "foundation": {"horizon": "14d", "hidden": 16, "layers": 1, "epochs": 1, **(foundation or {})},
            "scenarios": scenarios or {},
            "predictions": predictions or {},
            **top,
        }

    @staticmethod
    def churn(within: str = "28d", **keys) -> dict:
        """A binary scenario: no purchase within the window."""
        return {"task": "binary", "target": {"no_event": "purchases", "within": within}, **keys}

    @staticmethod
    def brands(top: int, within: str = "28d", **keys) -> dict:
        """A multilabel scenario: the `top` brands bought within the window."""
        return {"task": "multilabel", "target": {"any_event": "purchases", "by": "brand", "within": within, "top": top},
                **keys}

    @staticmethod
    def append_day(warehouse) -> None:
        """A new day in a demo warehouse whose data ends on 2026-10-31: 30 of that day's purchases copied
        to 2026-11-01, one of them by a customer never seen before (C_NEW)."""
        run_duckdb_sql(
            warehouse,
            "CREATE TEMP TABLE d AS SELECT * FROM purchases WHERE ts >= TIMESTAMP '2026-10-31' ORDER BY ts LIMIT 30",
            "UPDATE d SET ts = ts + INTERVAL 1 DAY",
            "UPDATE d SET customer_id = 'C_NEW' WHERE ts = (SELECT min(ts) FROM d)",
            "INSERT INTO purchases SELECT * FROM d")

    @staticmethod
    def write(folder, config: dict, **warehouse):
        """`folder`/project.yaml from `config`; with `warehouse` (generate_demo_warehouse's arguments)
        the warehouse it reads is generated first, as `folder`/warehouse.duckdb. Returns the config's path."""
        import yaml

        if warehouse:
            from habitus.pipelines.demo.data import generate_demo_warehouse

            generate_demo_warehouse(folder / "warehouse.duckdb", **warehouse)
        path = folder / "project.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path


@pytest.fixture(scope="session")
def small_project() -> SmallProject:
    """How the tests build a small project: `small_project.config(...)`, `small_project.write(...)`."""
    return SmallProject()
