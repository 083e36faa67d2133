"""A day's scores (or embeddings) from N processes, each writing its own part; the day's file is
written from the parts only once every entity chunk is in a complete one.

    <folder>/.<day>.parts/manifest.json   what the parts hold: the job's key and its chunk count
    <folder>/.<day>.parts/deal            the next chunk to hand out (a counter under flock), of deal.todo
    <folder>/.<day>.parts/<id>.arrow      one process's scored batches (Arrow IPC), renamed into place whole
    <folder>/.<day>.parts/<id>.part.json  written after its .arrow: the part is complete (its chunks)

Process 0 is the caller's own, so one process is the plain path with nothing staged; the others are
started once per run (a backfill's days reuse them), each with `threads` torch threads so N processes
do not oversubscribe the cores, and on GPUs a GPU each. On CPUs with one thread each they are forked
from process 0 with its model loaded (no start-up: importing torch alone is ~4 CPU-seconds; a forked
child must not use OpenMP's pool, which one thread never does); otherwise `python -m habitus.models.serve.parts`
children are spawned, and import torch while process 0 already scores. Chunks are dealt as they are
asked for, so a process that starts later or sits on a busier core takes fewer. A chunk is scored by the same code
on the same rows whichever process takes it, so the day's file is the one a single process writes:
the batches are read back in chunk order (tests/models/test_predict_parts.py checks bit for bit).

A process that fails or is killed fails the day: its part never gets its .json, the day's file is
not replaced (the previous one stays whole), and the next run with the same key scores only the
chunks no complete part holds. Another key (model, cache, cut-off or settings) starts afresh.
"""

import fcntl
import json
import os
import shutil
import subprocess
import sys
import traceback
import uuid
from dataclasses import dataclass, field
from importlib import import_module
from pathlib import Path
from typing import Callable, Iterable, Iterator

import pyarrow as pa

from habitus.models.storage.files import DiskFullError, is_disk_full, read_json, recover_tree, write_json
from habitus.models.train.launch import child_env

FORMAT = 1
ROOT = Path(__file__).resolve().parents[2]  # the repository (a spawned child runs from there)

# score(cutoff, chunk indices) -> (chunk index, batch) for every chunk with rows, in the order taken
Score = Callable[[int, Iterable[int]], Iterator[tuple[int, pa.RecordBatch]]]


class PartsError(RuntimeError):
    """A scoring process failed; the day's previous output is intact and its complete parts are kept."""


@dataclass(frozen=True)
class Scorer:
    """What every process builds its scoring from: `build` ("module:function") called with `params`
    (plain JSON values: paths, fingerprints, settings) returns a Score."""
    build: str
    params: dict = field(default_factory=dict)

    def make(self, device: str, rank: int = 0) -> Score:
        """The Score of process `rank` on `device` (both join the params)."""
        module, _, name = self.build.partition(":")
        return getattr(import_module(module), name)({**self.params, "device": device, "rank": rank})


def staging(folder: str | os.PathLike, day: str) -> Path:
    return Path(folder) / f".{day}.parts"


class Parts:
    """One day's staging folder, for the job `key` over `chunks` entity chunks."""

    def __init__(self, path: str | os.PathLike, key: str, chunks: int):
        self.path, self.key, self.chunks = Path(path), key, chunks
        manifest = {"format": FORMAT, "key": key, "chunks": chunks}
        if self.path.is_dir() and _manifest(self.path) != manifest:
            shutil.rmtree(self.path)  # another job's parts (other model, cut-off, settings): start afresh
        self.path.mkdir(parents=True, exist_ok=True)
        recover_tree(self.path)  # the unfinished .arrow of a process that died
        named = {r["file"] for r in self.complete()}
        for orphan in self.path.glob("*.arrow"):  # whole, but its process died before its .part.json
            if orphan.name not in named:
                orphan.unlink()
        if _manifest(self.path) is None:
            write_json(self.path / "manifest.json", manifest)

    @classmethod
    def existing(cls, path: str | os.PathLike, key: str, chunks: int) -> "Parts":
        """The folder another process set up for the same job (a child's view: nothing is reset)."""
        parts = cls.__new__(cls)
        parts.path, parts.key, parts.chunks = Path(path), key, chunks
        if _manifest(parts.path) != {"format": FORMAT, "key": key, "chunks": chunks}:
            raise PartsError(f"{parts.path}: its manifest is not this job's ({key[:16]}, {chunks} chunks)")
        return parts

    def complete(self) -> list[dict]:
        """Every complete part's record: {file, chunks, batches, rows}. A record whose file is missing or
        does not hold its batches (a power cut after an unsynced write) is dropped, its chunks to score again."""
        out = []
        for p in sorted(self.path.glob("*.part.json")):
            record = read_json(p)
            if record["file"] is None or _holds(self.path / record["file"], len(record["batches"])):
                out.append(record)
            else:
                p.unlink()
        return out

    def todo(self) -> list[int]:
        """The chunks no complete part holds, in order."""
        done = {c for r in self.complete() for c in r["chunks"]}
        return [c for c in range(self.chunks) if c not in done]

    def deal(self, todo: list[int]) -> None:
        """Start handing out `todo` from its first chunk."""
        (self.path / "deal").write_text("0")
        (self.path / "deal.todo").write_text(json.dumps(todo))

    def taken(self) -> Iterator[int]:
        """Chunks for this process, one at a time, until none is left (every process draws from one counter)."""
        todo = json.loads((self.path / "deal.todo").read_text())
        with open(self.path / "deal", "r+") as f:
            while True:
                fcntl.flock(f, fcntl.LOCK_EX)
                try:
                    f.seek(0)
                    i = int(f.read() or 0)
                    f.seek(0)
                    f.write(str(i + 1))
                    f.truncate()
                    f.flush()
                finally:
                    fcntl.flock(f, fcntl.LOCK_UN)
                if i >= len(todo):
                    return
                yield todo[i]

    def write(self, scored: Iterator[tuple[int, pa.RecordBatch]], chunks: Iterable[int]) -> dict:
        """One part from `scored`, which draws its chunks from `chunks`: the .arrow whole, then its
        .json. Returns the record."""
        name = uuid.uuid4().hex
        taken: list[int] = []
        order, rows, writer = [], 0, None

        def recorded():
            for c in chunks:
                taken.append(c)
                yield c

        # scratch: renamed into place without an fsync (a day of embeddings at 18M entities is ~10 GB);
        # a part that lost its bytes to a power cut fails `complete`'s footer check and is scored again
        tmp = self.path / f".{name}.arrow.tmp-{os.getpid()}"
        try:
            for c, batch in scored(recorded()):
                writer = writer or pa.ipc.new_file(str(tmp), batch.schema)
                writer.write_batch(batch)
                order.append(c)
                rows += len(batch)
            if writer is not None:
                writer.close()
                os.replace(tmp, self.path / f"{name}.arrow")
        except OSError as e:
            if is_disk_full(e):
                raise DiskFullError(self.path / f"{name}.arrow", tmp.stat().st_size if tmp.exists() else 0,
                                    None) from e
            raise
        finally:
            if tmp.exists():
                tmp.unlink()
        record = {"file": f"{name}.arrow" if writer is not None else None, "chunks": taken, "batches": order,
                  "rows": rows}
        write_json(self.path / f"{name}.part.json", record)
        return record

    def batches(self) -> Iterator[pa.RecordBatch]:
        """The day's batches in chunk order, as one process yields them. Refuses a day that is not whole."""
        records = self.complete()
        missing = self.todo()
        if missing:
            raise PartsError(f"{self.path}: chunks {missing[:5]}{'...' if len(missing) > 5 else ''} ({len(missing)} of "
                             f"{self.chunks}) are in no complete part; the day's output is not written")
        where = {}
        for r in records:
            for j, c in enumerate(r["batches"]):
                where[c] = (r["file"], j)
        readers = {}
        try:
            for c in sorted(where):
                file, j = where[c]
                if file not in readers:
                    readers[file] = pa.ipc.open_file(pa.OSFile(str(self.path / file)))
                yield readers[file].get_batch(j)
        finally:
            readers.clear()

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _holds(path: Path, batches: int) -> bool:
    try:
        return pa.ipc.open_file(pa.OSFile(str(path))).num_record_batches == batches
    except (OSError, pa.ArrowInvalid):
        return False


def _manifest(path: Path) -> dict | None:
    try:
        return read_json(path / "manifest.json")
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------- the processes


class Pool:
    """`processes` scoring processes for a run: this one (process 0, on `devices[0]`) and children
    1.. on `devices[i]`, `threads` torch threads each. Use as a context manager; `day` scores one
    day's parts whole. `start`: auto (fork where it is safe: CPUs, one thread each), or spawn."""

    def __init__(self, scorer: Scorer, processes: int, devices: list[str], threads: int, log=print,
                 start: str = "auto"):
        if processes < 1 or len(devices) != processes:
            raise ValueError(f"{processes} scoring processes need as many devices, got {devices}")
        if start not in ("auto", "spawn"):
            raise ValueError(f"start {start!r}: choose auto or spawn")
        self.scorer, self.processes, self.devices, self.threads, self.log = scorer, processes, devices, threads, log
        self.start = start
        self.children: list[subprocess.Popen] = []
        self._score: Score | None = None
        self._threads_before: int | None = None

    def __enter__(self) -> "Pool":
        import torch

        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            # one thread per process on CPUs: fork, the children start with this one's model and no import
            # (torch's OpenMP pool does not survive a fork, and one thread never uses it); else spawn
            forked = (self.start == "auto" and self.threads == 1 and all(d == "cpu" for d in self.devices)
                      and hasattr(os, "fork"))
            if forked:
                self._score = self.scorer.make(self.devices[0])
            for rank in range(1, self.processes):  # spawned, they import torch while process 0 gets on with it
                self.children.append(_fork(self._score, rank, self.children) if forked else
                                     _start(self.scorer, rank, self.devices[rank], self.threads))
            self.log(f"scoring processes: 0 (pid {os.getpid()}, {self.devices[0]}) and "
                     + ", ".join(f"{r} (pid {c.pid}, {self.devices[r]})" for r, c in enumerate(self.children, 1))
                     + f"; {self.threads} torch thread(s) each, {'forked' if forked else 'spawned'}")
            if not forked:
                self._score = self.scorer.make(self.devices[0])
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        import torch

        for child in self.children:
            if child.poll() is None:
                if exc and exc[0] is not None:
                    child.kill()  # a failed day: the others' unfinished parts go (recover_tree, next run)
                else:
                    child.stdin.close()  # EOF: the child leaves
        for child in self.children:
            try:
                child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            child.stdout.close()
        self.children = []
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)

    def day(self, parts: Parts, cutoff: int) -> list[dict]:
        """Score the chunks of `parts` that no complete part holds, over every process: each one's rows
        and chunks ({rank, rows, chunks}). Raises PartsError naming the process that failed (the complete
        parts stay for the next run)."""
        todo = parts.todo()
        if not todo:
            return []
        parts.deal(todo)
        message = json.dumps({"parts": str(parts.path), "key": parts.key, "chunks": parts.chunks, "cutoff": int(cutoff)})
        for child in self.children:
            try:
                child.stdin.write(message + "\n")
                child.stdin.flush()
            except (BrokenPipeError, OSError):
                pass  # gone: its reply below says how
        mine = parts.write(lambda chunks: self._score(cutoff, chunks), parts.taken())
        done, errors = [{"rank": 0, "rows": mine["rows"], "chunks": len(mine["chunks"])}], []
        for rank, child in enumerate(self.children, 1):
            line = child.stdout.readline()
            reply = json.loads(line) if line.strip() else None
            if reply is not None and "error" not in reply:
                done.append(reply)
            elif reply is None:
                code = child.wait()
                errors.append(f"scoring process {rank} (pid {child.pid}) exited with status {code} before finishing "
                              f"its part")
            elif "error" in reply:
                errors.append(f"scoring process {rank} failed:\n{reply['error']}")
        if errors:
            raise PartsError(f"{parts.path}: " + "\n".join(errors) + f"\n{len(parts.todo())} of {parts.chunks} chunks "
                             f"are in no complete part; the day's previous output is intact, and the next run scores "
                             f"only those")
        return done


def _start(scorer: Scorer, rank: int, device: str, threads: int) -> subprocess.Popen:
    env = child_env({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)})
    cmd = [sys.executable, "-m", "habitus.models.serve.parts"]
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    child.stdin.write(json.dumps({"build": scorer.build, "params": scorer.params, "rank": rank, "device": device,
                                  "threads": threads}) + "\n")
    child.stdin.flush()
    return child


def child_main() -> None:
    """A spawned child: build the scorer, then serve (what libraries print goes to stderr, so it cannot
    break a reply on the original stdout)."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    job = json.loads(sys.stdin.readline())
    score: Score | str
    try:
        import torch

        torch.set_num_threads(job["threads"])
        if job["device"].startswith("cuda:"):  # its own GPU, also for anything that asks for the current one
            torch.cuda.set_device(torch.device(job["device"]))
        score = Scorer(job["build"], job["params"]).make(job["device"], job["rank"])
    except BaseException:
        score = traceback.format_exc()
    _serve(score, job["rank"], sys.stdin, replies)


def _serve(score: "Score | str", rank: int, days, replies) -> None:
    """One part per day asked for on `days` (a line each), one reply line each on `replies`; `score`:
    the Score, or the traceback of its failed build (every day then fails with it)."""
    for line in days:
        day = json.loads(line)
        try:
            if isinstance(score, str):
                raise PartsError(score)
            parts = Parts.existing(day["parts"], day["key"], day["chunks"])
            record = parts.write(lambda chunks: score(day["cutoff"], chunks), parts.taken())
            reply = {"rank": rank, "rows": record["rows"], "chunks": len(record["chunks"])}
        except BaseException:
            reply = {"rank": rank, "error": score if isinstance(score, str) else traceback.format_exc()}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


class _Forked:
    """A forked child, driven like the spawned ones (subprocess.Popen's stdin, stdout, poll, wait, kill)."""

    def __init__(self, pid: int, stdin, stdout):
        self.pid, self.stdin, self.stdout, self.returncode = pid, stdin, stdout, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"scoring process {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, 9)


def _fork(score: Score, rank: int, siblings: list) -> _Forked:
    """A child forked from this process, serving with its `score` (the model already loaded)."""
    to_child, from_parent = os.pipe()[::-1]
    from_child, to_parent = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:  # the child: none of the parent's ends, nor its siblings' (their EOF is how they leave)
            os.close(to_child)
            os.close(from_child)
            for sibling in siblings:
                sibling.stdin.close()
                sibling.stdout.close()
            os.dup2(2, 1)  # what libraries print goes to stderr
            _serve(score, rank, os.fdopen(from_parent), os.fdopen(to_parent, "w"))
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(0)  # never the parent's teardown (atexit, buffered output, Dagster's handlers)
    os.close(from_parent)
    os.close(to_parent)
    return _Forked(pid, os.fdopen(to_child, "w"), os.fdopen(from_child))


if __name__ == "__main__":
    child_main()
