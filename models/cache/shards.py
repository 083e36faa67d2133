"""The shard writer: a build's encoded, sorted events streamed into one Arrow file per shard."""

from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from habitus.models.cache.stored import BATCH_ROWS, IPC_OPTIONS, _to_stored, _values


class _Tie(Exception):
    """Two rows sort equal on (entity, ts, row hash): exact copies, or a hash collision."""


class _ShardFiles:
    """Streams (shard, entity, ts)-ordered batches into one Arrow file per shard, named name(shard), in
    record batches of exactly BATCH_ROWS rows (the last one shorter), so that the bytes do not depend on
    how the result was chunked. With `check`, raises _Tie at two rows equal on (entity, ts, row hash)."""

    def __init__(self, out: Path, name, check: bool, stored: Callable[[pa.Schema], pa.Schema]):
        self.out, self.name, self.check, self.stored = out, name, check, stored
        self.schema: pa.Schema | None = None
        self.open: dict[int, list] = {}  # shard -> [writer, pending batches, pending rows, rows written]
        self.last = None

    def write(self, reader: pa.RecordBatchReader) -> None:
        if self.schema is None:
            self.schema = self.stored(pa.schema([f for f in reader.schema if f.name not in ("__shard", "__h")]))
        for batch in reader:
            if not len(batch):
                continue
            if self.check:
                e, t, h = (_values(batch.column(c)) for c in ("entity", "ts", "__h"))
                if (np.any((e[1:] == e[:-1]) & (t[1:] == t[:-1]) & (h[1:] == h[:-1]))
                        or self.last == (e[0], t[0], h[0])):
                    raise _Tie()
                self.last = (e[-1], t[-1], h[-1])
            sid = _values(batch.column("__shard"))
            body = _to_stored(batch.drop_columns(["__shard", "__h"]), self.schema)
            cuts = np.flatnonzero(np.diff(sid)) + 1
            for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, len(sid)]):
                self._add(int(sid[lo]), body.slice(lo, hi - lo))

    def _add(self, shard: int, part: pa.RecordBatch) -> None:
        if shard not in self.open:
            writer = ipc.new_file(str(self.out / self.name(shard)), self.schema, options=IPC_OPTIONS)
            self.open[shard] = [writer, [], 0, 0]
        state = self.open[shard]
        state[1].append(part)
        state[2] += len(part)
        if state[2] >= BATCH_ROWS:
            self._flush(state, final=False)

    @staticmethod
    def _flush(state: list, final: bool) -> None:
        """Write the pending rows as batches of BATCH_ROWS (and the rest, when `final`). Each batch is
        copied into buffers of its own (pa.concat_batches): the IPC bytes of a slice depend on the
        buffer it was cut from, so slices of DuckDB's chunks would not give the same bytes twice."""
        writer, pending, rows, written = state
        while rows >= BATCH_ROWS or (final and rows):
            want, take = min(BATCH_ROWS, rows), []
            while want:
                head = pending[0]
                take.append(head.slice(0, want))
                if len(head) <= want:
                    pending.pop(0)
                else:
                    pending[0] = head.slice(want)
                want -= len(take[-1])
            batch = pa.concat_batches(take)
            writer.write_batch(batch)
            rows, written = rows - len(batch), written + len(batch)
        state[2], state[3] = rows, written

    def close(self) -> dict[int, tuple[str, int]]:
        """shard -> (file, rows) of every shard written."""
        for state in self.open.values():
            self._flush(state, final=True)
            state[0].close()
        return {s: (self.name(s), state[3]) for s, state in sorted(self.open.items())}

    def abandon(self) -> None:
        for s, state in self.open.items():
            try:
                state[0].close()
            except Exception:  # noqa: BLE001 - the file is removed anyway
                pass
            (self.out / self.name(s)).unlink(missing_ok=True)
        self.open = {}
