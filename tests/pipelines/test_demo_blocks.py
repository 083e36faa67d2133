"""The demo generator a block of customers at a time (habitus.pipelines.demo.simulation.simulate_blocks): what
lets bench/speed.py write 100M purchases without holding them in memory."""

from datetime import date

import duckdb
import numpy as np
import pyarrow as pa

from habitus.pipelines.demo import simulation as demo_simulation
from habitus.pipelines.demo.data import generate_demo_warehouse

START = date(2026, 3, 1)


def test_one_block_is_the_whole_draw_and_more_blocks_keep_it_first(monkeypatch):
    """Up to BLOCK_CUSTOMERS customers, one block: the tables a single draw gives. With smaller blocks the
    first block is still that draw of its customers, and the later ones add customers of their own."""
    whole = demo_simulation.simulate_tables(START, 90, 120, 80, 5, 3)
    monkeypatch.setattr(demo_simulation, "BLOCK_CUSTOMERS", 50)
    blocks = list(demo_simulation.simulate_blocks(START, 90, 120, 80, 5, 3))
    assert [len(b["customers"]) for b in blocks] == [50, 50, 20]
    assert set(blocks[0]) == {"customers", "products", "stores", "purchases"}
    assert all(set(b) == {"customers", "purchases"} for b in blocks[1:])
    assert blocks[0]["products"].equals(whole["products"]) and blocks[0]["stores"].equals(whole["stores"])
    first50 = demo_simulation.simulate_tables(START, 90, 50, 80, 5, 3)
    assert blocks[0]["customers"].equals(first50["customers"])
    assert blocks[0]["purchases"].equals(first50["purchases"])
    ids = pa.concat_tables([b["customers"] for b in blocks]).column("customer_id").to_pylist()
    assert ids == [f"C{i:07d}" for i in range(1, 121)]
    for b in blocks:  # every purchase is by one of its own block's customers, sorted by time within the block
        assert set(b["purchases"].column("customer_id").to_pylist()) <= set(b["customers"].column("customer_id").to_pylist())
        ts = b["purchases"].column("ts").cast(pa.int64()).to_numpy()
        assert len(ts) > 0 and np.all(np.diff(ts) >= 0)
    assert not blocks[1]["purchases"].equals(blocks[2]["purchases"].slice(0, len(blocks[1]["purchases"])))


def test_the_warehouse_holds_every_block(tmp_path, monkeypatch):
    monkeypatch.setattr(demo_simulation, "BLOCK_CUSTOMERS", 40)
    expected = demo_simulation.simulate_tables(START, 60, 100, 50, 4, 1)
    counts = generate_demo_warehouse(tmp_path / "w.duckdb", customers=100, products=50, stores=4,
                                     start="2026-03-01", end="2026-04-29", seed=1)
    assert counts == {name: len(t) for name, t in expected.items()}
    con = duckdb.connect(str(tmp_path / "w.duckdb"), read_only=True)
    try:
        for name, table in expected.items():
            got = con.sql(f'SELECT * FROM "{name}"').to_arrow_table()
            assert got.cast(table.schema).equals(table), name  # (insertion order kept, block after block)
    finally:
        con.close()
