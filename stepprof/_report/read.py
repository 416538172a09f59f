"""Reading a log into runs: where runs begin and end, and the parallel read of a large log.

A log may hold several runs (one ``Profiler`` after another on the same path: each
ends with a summary, and step indices restart) and sweeps.  :class:`RunBoundaries`
says where one run ends and the next begins; ``stepprof report`` (here) and
``stepprof plot`` (stepprof/_plot.py) both split by it.
"""

from __future__ import annotations

import os
from typing import Any

from .._aggregate import RunAggregate
from .._log import ScanStats, scan

__all__ = ["PARALLEL_BYTES", "RunBoundaries", "Segment", "read_log"]

#: Logs larger than this are read as several byte ranges in parallel (Linux, fork).
PARALLEL_BYTES = 64 * 2**20
#: Sweep records kept per log.
_SWEEP_RECORDS_KEPT = 200_000
_RUN_KINDS = frozenset(("step", "memory", "summary", "ranks", "flops"))


class RunBoundaries:
    """Where one run of a log ends and the next begins, for records read in order.

    A run ends at its ``summary``; a step whose index is not above the run's last
    one starts a new run (a run that crashed without a summary, then a new one).
    Only run records (``step``, ``memory``, ``summary``, ``ranks``, ``flops``) count.
    """

    __slots__ = ("open", "closed", "last_step")

    def __init__(self) -> None:
        self.open = False  # a run has begun
        self.closed = False  # ... and its summary was read
        self.last_step: int | None = None

    def starts_run(self, kind: Any, record: dict[str, Any]) -> bool:
        """Whether ``record`` (a run record of ``kind``) begins a new run; then tracks it."""
        new = not self.open or (self.closed and kind != "summary")
        if kind == "step":
            idx = record.get("step")
            if type(idx) is int:
                if not new and self.last_step is not None and idx <= self.last_step:
                    new = True
            else:
                idx = None
            if new:
                self.last_step = None
            if idx is not None:
                self.last_step = idx
        elif new:
            self.last_step = None
        if new:
            self.open, self.closed = True, False
        if kind == "summary":
            self.closed = True
        return new


class Segment:
    """The aggregates of one stretch of a log: its runs, in order, and what else it held.

    A whole log is one segment.  A large log is read as several byte ranges in
    parallel, one segment each, and the segments are stitched in file order
    (:meth:`stitch`): a run that the previous range left open continues into the
    next one, as it would have in one pass.
    """

    def __init__(self) -> None:
        self.stats = ScanStats()
        self.runs: list[RunAggregate] = []
        self.sweep_records: list[dict[str, Any]] = []  # sweep_point/sweep_result, in order
        self.versions: dict[Any, int] = {}
        self.kinds: dict[str, int] = {}
        # The first run was opened only because the range began (not by a summary or an
        # index restart), so it may continue the previous range's last run.
        self.first_continues = False

    def read(self, path: str, start: int = 0, end: int | None = None) -> Segment:
        versions, kinds, sweep_records = self.versions, self.kinds, self.sweep_records
        boundaries = RunBoundaries()
        run: RunAggregate | None = None
        for r in scan(path, self.stats, start, end):
            kind = r.get("kind")
            v = r.get("schema_version")
            if type(v) is not int:  # a foreign line's may be anything, unhashable too
                v = None if v is None else str(v)[:40]
            if v not in versions and len(versions) < 16:
                versions[v] = 0
            if v in versions:
                versions[v] += 1
            if kind == "step":
                if boundaries.starts_run(kind, r) or run is None:
                    run = self._new_run()
                run.add_step(r)
            elif kind in _RUN_KINDS:
                if boundaries.starts_run(kind, r) or run is None:
                    run = self._new_run()
                run.add(r)
            elif kind == "sweep_point" or kind == "sweep_result":
                if len(sweep_records) < _SWEEP_RECORDS_KEPT:
                    sweep_records.append(r)
            else:
                key = str(kind)[:40]
                if key in kinds or len(kinds) < 32:
                    kinds[key] = kinds.get(key, 0) + 1
        return self

    def _new_run(self) -> RunAggregate:
        if not self.runs:
            self.first_continues = True
        run = RunAggregate(len(self.runs))
        self.runs.append(run)
        return run

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
        room = max(0, _SWEEP_RECORDS_KEPT - len(self.sweep_records))
        self.sweep_records.extend(later.sweep_records[:room])
        runs = later.runs
        if runs and self.runs and later.first_continues:
            last, first = self.runs[-1], runs[0]
            restarted = (
                first.first_step is not None and last.steps and first.first_step <= last.last_step
            )
            if last.summary is None and not restarted:
                last.merge(first)
                runs = runs[1:]
        for run in runs:
            run.index = len(self.runs)
            self.runs.append(run)
        if not self.runs:
            self.first_continues = later.first_continues


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
        workers = min(16, os.cpu_count() or 1) if size >= PARALLEL_BYTES else 1
    if workers <= 1 or size == 0:
        return Segment().read(path)
    import multiprocessing  # only for a large log

    try:
        ctx = multiprocessing.get_context("fork")  # workers inherit the imports: no start-up
    except ValueError:
        return Segment().read(path)
    cuts = [size * k // workers for k in range(workers + 1)]
    with ctx.Pool(workers) as pool:
        parts = pool.map(_read_range, [(path, a, b) for a, b in zip(cuts, cuts[1:], strict=False)])
    whole = parts[0]
    for part in parts[1:]:
        whole.stitch(part)
    return whole
