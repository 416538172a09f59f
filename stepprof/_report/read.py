"""Reading a log into runs: where runs begin and end, and the parallel read of a large log.

A log may hold several runs (one ``Profiler`` after another on the same path, or several
processes appending to it at once) and sweeps.  :class:`RunGrouper` says which run each
record belongs to, by its ``run_id``; ``stepprof report`` (here), ``stepprof plot`` and
``stepprof export`` all group by it.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from .._aggregate import RunAggregate
from .._log import ScanStats, scan
from .._rules import RUN_KINDS as _RUN_KINDS

if TYPE_CHECKING:
    from multiprocessing.pool import Pool

__all__ = ["MISSING_KEPT", "OPEN_RUNS_KEPT", "PARALLEL_BYTES", "RUNS_KEPT", "SWEEP_RECORDS_KEPT", "RunGrouper",
           "Segment", "logs_pool", "read_log"]

#: Logs larger than this are read as several byte ranges in parallel (Linux, fork).
PARALLEL_BYTES = 64 * 2**20
#: Runs with a ``run_id`` held open at once; past this, the least recently written is closed.
OPEN_RUNS_KEPT = 1024
#: Runs kept per log, the last ones: each costs about 13 KB in the report, so a log of very
#: many tiny runs would otherwise need far more memory than its size.  The rest are counted.
RUNS_KEPT = 1000
#: Sweep records kept per log, the first ones (a sweep writes one per trial, tens): each costs
#: a few KB as a dict.  ``stepprof plot`` keeps as many.
SWEEP_RECORDS_KEPT = 20_000
#: The most step indices a run may have skipped and still take when they arrive late (a step
#: is late by the steps other threads still had open: a few; and at 1,024 open ids the sets
#: stay within a few MB on a hostile log).
MISSING_KEPT = 256

R = TypeVar("R")


class _Open(Generic[R]):
    """One writer's stream of records (one ``run_id``'s) and its current run.

    ``missing``: the step indices its run skipped (steps of other threads still open when a
    later one was written): such a step arriving late belongs to the run, where an index seen
    already starts a new one.
    """

    __slots__ = ("run", "last_step", "missing")

    def __init__(self) -> None:
        self.run: R | None = None
        self.last_step: int | None = None
        self.missing: set[int] = set()


_SWITCH = object()  # no stream is current: the next record looks its own up


class RunGrouper(Generic[R]):
    """Which run each run record belongs to, for records read in order.

    A record belongs to the open run of its ``run_id``, wherever it lies between other
    writers' records.  A step whose index is neither above the run's last one nor one the
    run skipped starts a new run of that id (a profiler that crashed, then a new one that
    reused the id; a log copied onto itself).  A run goes on after its summary: a profiler
    that wrote one when SIGTERM arrived and went on writes its later steps and a later
    summary, which replaces it.  Records without a str ``run_id`` (hand-written logs) are one
    more writer, under the same rules.  Runs are made by ``new_run(run_id)`` in the order of
    their first record.  At most :data:`OPEN_RUNS_KEPT` ids are held: past that the one
    written least recently is dropped (a later record of it starts a new run).

    Args:
        new_run: makes (and keeps) a new run, given its id (None for records without one).
        track_heads: keep :attr:`heads`, for stitching a byte range to the one before it.
    """

    def __init__(self, new_run: Callable[[str | None], R], *, track_heads: bool = False) -> None:
        self._new_run = new_run
        self.open: OrderedDict[str | None, _Open[R]] = OrderedDict()  # least recently written first
        #: Each id's first run here (it may continue a run of the previous byte range).
        self.heads: dict[str | None, R] | None = {} if track_heads else None
        self._rid: Any = _SWITCH
        self._cur: _Open[R] = _Open()

    def run_of(self, kind: Any, record: dict[str, Any]) -> R:
        """The run of ``record``, a run record of ``kind`` (a new one if it starts one)."""
        rid = record.get("run_id")
        if type(rid) is not str:
            rid = None
        if rid != self._rid:
            self._switch(rid)
        cur = self._cur
        run = cur.run
        if kind == "step":
            idx = record.get("step")
            if type(idx) is int:
                last = cur.last_step
                if last is None or idx > last:
                    if last is not None:
                        _skipped(cur.missing, last + 1, idx)
                    cur.last_step = idx
                elif idx in cur.missing:  # one the run skipped: another thread's, written late
                    cur.missing.discard(idx)
                else:  # the index restarts: a new run
                    run = None
                    cur.last_step, cur.missing = idx, set()
        if run is None:
            run = cur.run = self._start(rid)
        return run

    def _switch(self, rid: str | None) -> None:
        self._rid = rid
        table = self.open
        cur = table.get(rid)
        if cur is None:
            if len(table) >= OPEN_RUNS_KEPT:
                table.popitem(last=False)
            cur = table[rid] = _Open()
        else:
            table.move_to_end(rid)
        self._cur = cur

    def _start(self, rid: str | None) -> R:
        run = self._new_run(rid)
        if self.heads is not None and rid not in self.heads:
            self.heads[rid] = run
        return run


def _skipped(missing: set[int], start: int, stop: int) -> None:
    """Note the indices from ``start`` to ``stop`` (excluded) as skipped, while few are."""
    if 0 < stop - start and stop - start + len(missing) <= MISSING_KEPT:
        missing.update(range(start, stop))


def _continues(last: RunAggregate, first: RunAggregate) -> bool:
    """Whether ``first`` (a byte range's first run of an id) continues ``last`` (the id's run
    open at the end of the range before): its index did not restart.  A run restarts only at
    or before its first index: another thread's step written late comes after that."""
    if first.first_step is None or not last.steps or last.first_step is None:
        return True
    return bool(first.first_step > last.first_step)


class Segment:
    """The aggregates of one stretch of a log: its runs, in order, and what else it held.

    A whole log is one segment.  A large log is read as several byte ranges in
    parallel, one segment each, and the segments are stitched in file order
    (:meth:`stitch`): a run that the previous range left open continues into the
    next one, as it would have in one pass.
    """

    def __init__(self) -> None:
        self.stats = ScanStats()
        self.runs: list[RunAggregate] = []  # the last RUNS_KEPT, in order
        self.runs_dropped = 0  # runs before those, not kept
        self.runs_kept = RUNS_KEPT  # the cap this read applied
        self.sweep_records: list[dict[str, Any]] = []  # sweep_point/sweep_result, in order
        self.versions: dict[Any, int] = {}
        self.kinds: dict[str, int] = {}
        # For stitching (see RunGrouper): the runs open at the end, by id (least recently
        # written first), and each id's first run here, which may continue one of those of
        # the range before.
        self.open: OrderedDict[str | None, RunAggregate] = OrderedDict()
        self.heads: dict[str | None, RunAggregate] = {}

    def read(self, path: str, start: int = 0, end: int | None = None) -> Segment:
        versions, kinds, sweep_records = self.versions, self.kinds, self.sweep_records
        grouper: RunGrouper[RunAggregate] = RunGrouper(self._new_run, track_heads=start > 0)
        run_of = grouper.run_of
        kind: Any
        for r in scan(path, self.stats, start, end):
            kind = r.get("kind")  # a str, and the version an int or None (stepprof._sanitise)
            v = r.get("schema_version")
            if v not in versions and len(versions) < 16:
                versions[v] = 0
            if v in versions:
                versions[v] += 1
            if kind == "step":
                run_of(kind, r).add_step(r)
            elif kind in _RUN_KINDS:
                run_of(kind, r).add(r)
            elif kind == "sweep_point" or kind == "sweep_result":
                if len(sweep_records) < SWEEP_RECORDS_KEPT:
                    sweep_records.append(r)
            else:
                key = kind[:40]
                if key in kinds or len(kinds) < 32:
                    kinds[key] = kinds.get(key, 0) + 1
        self.open = OrderedDict((rid, o.run) for rid, o in grouper.open.items() if o.run is not None)
        self.heads = grouper.heads or {}
        return self

    def _new_run(self, run_id: str | None) -> RunAggregate:
        run = RunAggregate(self.runs_dropped + len(self.runs))
        run.run_id = run_id
        self.runs.append(run)
        self._keep_last()
        return run

    def _keep_last(self) -> None:
        """Drop the oldest runs past :data:`RUNS_KEPT` (a writer's open run lives on in the
        grouper until it is written to no more, so memory stays bounded either way)."""
        excess = len(self.runs) - self.runs_kept
        if excess > 0:
            del self.runs[:excess]
            self.runs_dropped += excess

    def stitch(self, later: Segment) -> None:
        """Append the segment that follows this one in the file."""
        self.stats.lines += later.stats.lines
        self.stats.skipped += later.stats.skipped
        for v, n in later.versions.items():
            if v in self.versions or len(self.versions) < 16:
                self.versions[v] = self.versions.get(v, 0) + n
        for k, n in later.kinds.items():
            if k in self.kinds or len(self.kinds) < 32:
                self.kinds[k] = self.kinds.get(k, 0) + n
        room = max(0, SWEEP_RECORDS_KEPT - len(self.sweep_records))
        self.sweep_records.extend(later.sweep_records[:room])
        merged: dict[int, RunAggregate] = {}  # id() of a later run -> the run it continued
        opened = self.open
        for rid, head in later.heads.items():
            last = opened.pop(rid, None)  # seen later: its state is the later range's
            if last is not None and _continues(last, head):
                last.merge(head)
                merged[id(head)] = last
        for rid, run in later.open.items():
            opened[rid] = merged.get(id(run), run)
        while len(opened) > OPEN_RUNS_KEPT:
            opened.popitem(last=False)
        kept = {id(run) for run in later.runs}
        # Runs the later range dropped, but for a dropped head that continued one of ours.
        self.runs_dropped += later.runs_dropped - sum(1 for key in merged if key not in kept)
        for run in later.runs:
            if id(run) not in merged:
                run.index = self.runs_dropped + len(self.runs)
                self.runs.append(run)
        self._keep_last()


def cores() -> int:
    """How many processes a large read uses: one per core, up to 16."""
    return min(16, os.cpu_count() or 1)


def forked_pool(workers: int) -> Pool | None:
    """A pool of ``workers`` forked processes (they inherit the imports: no start-up), or None
    for one worker or where fork is not available (then the caller reads in this process)."""
    if workers <= 1:
        return None
    import multiprocessing  # only for a large read

    try:
        return multiprocessing.get_context("fork").Pool(workers)
    except ValueError:
        return None


def logs_pool(sizes: list[int]) -> Pool | None:
    """A pool to read several logs side by side (a log a process, one a core), where there are
    several, none large enough to be read in parallel itself, and :data:`PARALLEL_BYTES` or
    more between them; else None (read them in turn)."""
    if len(sizes) > 1 and max(sizes) < PARALLEL_BYTES <= sum(sizes):
        return forked_pool(min(cores(), len(sizes)))
    return None


def _read_range(args: tuple[str, int, int]) -> Segment:
    path, start, end = args
    return Segment().read(path, start, end)


def read_log(path: str, workers: int | None = None) -> Segment:
    """Stream one log into its runs and sweep records.

    Args:
        path: the log.
        workers: processes to read it with; None reads a log of at least
            :data:`PARALLEL_BYTES` with one process per core (up to 16), else in this one.
    """
    size = os.path.getsize(path)
    if workers is None:
        workers = cores() if size >= PARALLEL_BYTES else 1
    pool = forked_pool(workers) if size else None
    if pool is None:
        return Segment().read(path)
    cuts = [size * k // workers for k in range(workers + 1)]
    with pool:
        parts = pool.map(_read_range, [(path, a, b) for a, b in zip(cuts, cuts[1:], strict=False)])
    whole = parts[0]
    for part in parts[1:]:
        whole.stitch(part)
    return whole
