"""Where finished records go: the JSON-lines log, and the running summary.

:class:`LogSink` writes every record (with ``schema_version``, the profiler's ``run_id``
and, in a distributed run, the rank fields); :class:`SummarySink` aggregates them for the :class:`~stepprof.Summary`
written at close.  Every record the collector and its hooks write (step, flops, memory,
ranks) goes to both; the summary record itself goes to the log only.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._aggregate import RunAggregate
from .._log import JsonlWriter, encode_line
from .._records import Summary
from .._schema import SCHEMA_VERSION

if TYPE_CHECKING:
    from .budget import Budget

#: How a record reaches the log: ``write(record)``.
Write = Callable[[dict[str, Any]], None]


class LogSink:
    """The log (or none): records are written one by one, or as one batch per harvest.

    Every record gets ``run_id`` (the writer's identity: one per profiler) after its own
    fields, then the rank fields.
    """

    def __init__(
        self, path: str | os.PathLike[str] | None, rank_fields: dict[str, int] | None, run_id: str
    ) -> None:
        self.writer = JsonlWriter(path) if path is not None else None
        self.path = self.writer.path if self.writer else None
        self._rank_fields = rank_fields
        self._run_id = run_id
        #: Records of the harvest in progress (and lines :meth:`encode` made).
        self._batch: list[dict[str, Any] | bytes] | None = None
        #: Records handed to the log so far.
        self.count = 0

    @property
    def plain(self) -> bool:
        """Whether a built step record needs only ``run_id`` to be as the log holds it (no rank fields)."""
        return self._rank_fields is None

    @property
    def run_id(self) -> str | None:
        """The ``run_id`` each record gets; None without a log (nothing is written)."""
        return self._run_id if self.writer is not None else None

    @property
    def batch(self) -> list[dict[str, Any] | bytes] | None:
        """The records of the harvest in progress (None outside one, or without a log)."""
        return self._batch if self.writer is not None else None

    @property
    def failed(self) -> str | None:
        """Why writing stopped (the disk filled up, say), or None."""
        return self.writer.failed if self.writer is not None else None

    def _stamp(self, record: dict[str, Any]) -> dict[str, Any]:
        """The record as the log holds it: ``schema_version`` first, ``run_id``, the rank fields."""
        if "schema_version" not in record:
            record = {"schema_version": SCHEMA_VERSION, **record}
        record["run_id"] = self._run_id
        rank_fields = self._rank_fields
        if rank_fields is not None:
            if "world_size" in record or "rank" in record or "local_rank" in record:
                # A ranks record keeps its own world_size: its group's (the same by default).
                record.update({k: v for k, v in rank_fields.items() if k not in record})
            else:
                record.update(rank_fields)
        return record

    def write(self, record: dict[str, Any]) -> None:
        if self.writer is not None:
            record = self._stamp(record)
            self.count += 1
            if self._batch is not None:  # inside a harvest: written with the others
                self._batch.append(record)
            else:
                self.writer.write(record)

    def encode(self, record: dict[str, Any]) -> bytes:
        """The record's line, to :meth:`write_lines` later (b"" without a log)."""
        return encode_line(self._stamp(record)) if self.writer is not None else b""

    def write_lines(self, lines: bytes, n: int) -> None:
        """Write ``n`` records' lines that :meth:`encode` made (with the batch, inside a harvest)."""
        if self.writer is not None and lines:
            self.count += n
            if self._batch is not None:
                self._batch.append(lines)
            else:
                self.writer.write_many((lines,))

    def write_now(self, record: dict[str, Any]) -> None:
        """Write ``record`` at once, even inside a harvest (a signal's summary: the process
        may end right after)."""
        batch, self._batch = self._batch, None
        try:
            self.write(record)
        finally:
            self._batch = batch

    def begin_batch(self) -> None:
        """Hold the records written from now on until :meth:`end_batch`."""
        self._batch = []

    def end_batch(self) -> None:
        """Write the held records together, in one system call."""
        batch, self._batch = self._batch, None
        if batch and self.writer is not None:
            self.writer.write_many(batch)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def forget(self) -> None:
        """After a fork: close the child's copy of the descriptor (the parent's stays open)."""
        writer, self.writer, self._batch = self.writer, None, None
        if writer is not None:
            writer.close()


class SummarySink:
    """The run's records, folded into one :class:`~stepprof._aggregate.RunAggregate`.

    ``stepprof report`` aggregates a log the same way, so the :class:`~stepprof.Summary`
    built here at close and the report show the same figures, to the last digit.  Memory
    stays bounded at any step count (the aggregate keeps sketches, not lists).
    """

    def __init__(self, run_id: str | None = None) -> None:
        self.aggregate = agg = RunAggregate()
        agg.run_id = run_id
        #: Fold in any record of the run (step, flops, memory, ranks).
        self.add: Write = agg.add
        #: Fold in a step record (the collector's hot path: no dispatch on ``kind``); True if timed.
        self.add_step: Callable[[dict[str, Any]], bool] = agg.add_step
        #: Fold in the late fields of a step record added before them.
        self.add_late = agg.add_late

    def fold_plan(self) -> tuple[Any, Any] | None:
        """The aggregate's name groups and totals, for C to fold the common step (the harvest,
        ``_fold.c``'s ``add_step``) and its late energy (``fill_energy``) into without
        :attr:`add_step`'s and :attr:`add_late`'s frames; None where either is not the
        aggregate's own."""
        agg = self.aggregate
        own = self.add_step == agg.add_step and self.add_late == agg.add_late
        return (agg.groups, agg.totals) if own else None

    def summary(
        self,
        *,
        log: str | None,
        ended_by: str,
        device: str,
        stopped: str | None,
        log_failed: str | None,
        flops_reason: str | None,
        boundary: str | None = None,
        budget: Budget | None = None,
        syncs_outside: tuple[int | None, str | None] | None = None,
        energy_reason: str | None = None,
        boundary_reason: str | None = None,
    ) -> Summary:
        """The summary of the records added so far.

        Args:
            log: the log's path, or None.
            ended_by: how the run ended (the summary's ``ended_by``).
            device: the profiler's device at close (``"none"`` if no step ran): the
                summary's when no step record says one.
            stopped: why recording stopped early, or None.
            log_failed: why writing the log stopped, or None.
            flops_reason: with FLOPs requested, why the profiler has no TFLOP/s yet; the
                summary's reason when no step record carries the FLOPs fields.  None: FLOPs
                were not requested.
            boundary: which boundary did the device work (None: no CUDA device).
            budget: the ``overhead_budget``'s state, or None: the summary says when the run
                cost more (``unavailable["overhead_budget"]``).
            syncs_outside: (``syncs_outside_steps``, None), or (None, why): the backend's
                count, which no step record carries.  None: no backend gave one.
            energy_reason: why no step has energy, when no step record says (energy
                sampling off).
            boundary_reason: with ``boundary="python"``, why the compiled one (the step core, and
                on CUDA the compiled device boundary) was not used.
        """
        agg = self.aggregate
        extra: dict[str, str] = {}
        if flops_reason is not None and not agg.flops_requested:
            extra["tflops_per_s_median"] = extra["mfu_median"] = extra["mfu_datasheet_median"] = flops_reason
        if stopped is not None:
            extra["stepprof"] = stopped
        if log_failed:
            extra["log"] = log_failed
        if boundary == "python" and boundary_reason:
            extra["boundary"] = boundary_reason
        if energy_reason is not None and not agg.energy_steps and agg.energy_reason is None and agg.timed_steps:
            extra["energy_j_per_step"] = extra["power_w_mean"] = extra["samples_per_j"] = energy_reason
        fields = agg.summary_fields(extra_unavailable=extra)
        if budget is not None:
            wall = fields["wall_ms"]
            why = budget.verdict(fields["overhead_us_mean"], wall.median if wall is not None else None)
            if why is not None:
                fields["unavailable"]["overhead_budget"] = why
        if agg.device is None:
            fields["device"] = device
        fields["ended_by"] = ended_by
        fields["boundary"] = boundary
        if syncs_outside is not None:
            fields["syncs_outside_steps"], why = syncs_outside
            if why is None:
                fields["unavailable"].pop("syncs_outside_steps", None)
            else:
                fields["unavailable"]["syncs_outside_steps"] = why
        return Summary(log=log, **fields)
