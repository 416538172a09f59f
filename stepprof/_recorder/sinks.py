"""Where finished records go: the JSON-lines log, and the running summary.

:class:`LogSink` writes every record (with ``schema_version`` and, in a distributed run,
the rank fields); :class:`SummarySink` keeps the figures of measured steps for the
:class:`~stepprof.Summary` written at close.  The collector hands each step record to
both; other records (memory, flops, ranks, the summary itself) go to the log only.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from .._log import JsonlWriter
from .._schema import SCHEMA_VERSION
from .._records import Percentiles, Summary

#: How a record reaches the log: ``write(record)``.
Write = Callable[[dict[str, Any]], None]


class LogSink:
    """The log (or none): records are written one by one, or as one batch per harvest."""

    def __init__(self, path: str | os.PathLike[str] | None, rank_fields: dict[str, int] | None) -> None:
        self.writer = JsonlWriter(path) if path is not None else None
        self.path = self.writer.path if self.writer else None
        self._rank_fields = rank_fields
        self._batch: list[dict[str, Any]] | None = None  # records of the harvest in progress

    @property
    def failed(self) -> str | None:
        """Why writing stopped (the disk filled up, say), or None."""
        return self.writer.failed if self.writer is not None else None

    def write(self, record: dict[str, Any]) -> None:
        if self.writer is not None:
            if "schema_version" not in record:
                record = {"schema_version": SCHEMA_VERSION, **record}
            if self._rank_fields is not None:
                # A ranks record keeps its own world_size: its group's (the same by default).
                record.update({k: v for k, v in self._rank_fields.items() if k not in record})
            if self._batch is not None:  # inside a harvest: written with the others
                self._batch.append(record)
            else:
                self.writer.write(record)

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


#: Why a summary figure is null when no step was measured.
_NOTHING_MEASURED = "no measured steps (all were warm-up, failed, or none ran)"


class SummarySink:
    """The figures of the step records that the summary describes.

    Warm-up and failed steps are counted only; the other steps' figures are kept for
    the percentiles, and the first reason a figure was missing is kept for a null one.
    """

    def __init__(self) -> None:
        self._n_steps = self._n_warm = self._n_err = 0
        self._wall: list[float] = []
        self._gpu: list[float] = []
        self._busy: list[float] = []
        self._sps: list[float] = []
        self._ovh: list[float] = []
        self._sync_counts: list[float] = []
        self._tflops: list[float] = []
        self._mfu: list[float] = []
        self._peak_max: int | None = None
        self._reasons: dict[str, str] = {}

    def add(self, record: dict[str, Any]) -> None:
        """Count a step record; keep its figures if it is a measured step."""
        self._n_steps += 1
        if record["warmup"]:
            self._n_warm += 1
            return
        if record["error"] is not None:
            self._n_err += 1
            return
        unavailable = record["unavailable"]
        reasons = self._reasons
        self._wall.append(record["wall_ms"])
        self._ovh.append(record["overhead_us"])
        if record["gpu_ms"] is not None:
            self._gpu.append(record["gpu_ms"])
        else:
            reasons.setdefault("gpu_ms", unavailable["gpu_ms"])
        if record["gpu_busy"] is not None:
            self._busy.append(record["gpu_busy"])
        else:
            reasons.setdefault("gpu_busy_median", unavailable["gpu_busy"])
        if record["samples_per_s"] is not None:
            self._sps.append(record["samples_per_s"])
        else:
            reasons.setdefault("samples_per_s", unavailable["samples_per_s"])
        peak = record["peak_allocated_bytes"]
        if peak is not None:
            self._peak_max = peak if self._peak_max is None else max(self._peak_max, peak)
        else:
            reasons.setdefault("peak_allocated_bytes", unavailable["peak_allocated_bytes"])
        if record["syncs"] is not None:
            self._sync_counts.append(record["syncs"]["count"])
        else:
            reasons.setdefault("syncs_per_step_median", unavailable["syncs"])
        if not record.get("flops_counted"):  # the counted step's times include the counter's
            if record.get("tflops_per_s") is not None:
                self._tflops.append(record["tflops_per_s"])
            if record.get("mfu") is not None:
                self._mfu.append(record["mfu"])

    def summary(
        self,
        *,
        device: str,
        sync_mechanism: str | None,
        log: str | None,
        stopped: str | None,
        log_failed: str | None,
        flops_reasons: tuple[str, str | None],
    ) -> Summary:
        """The summary of the steps added so far.

        Args:
            device: the device the steps ran on (``"none"`` if no step ran).
            sync_mechanism: how syncs were counted, if they were.
            log: the log's path, or None.
            stopped: why recording stopped early, or None.
            log_failed: why writing the log stopped, or None.
            flops_reasons: why ``tflops_per_s_median`` is null if no step has the figure,
                and why ``mfu_median`` is null if steps have TFLOP/s but none has MFU
                (None: "not computed").
        """
        reasons = dict(self._reasons)
        measured = self._n_steps - self._n_warm - self._n_err
        if measured == 0:
            for f in ("wall_ms", "gpu_ms", "gpu_busy_median", "peak_allocated_bytes_max",
                      "samples_per_s_median", "overhead_us_median", "syncs_per_step_median"):
                reasons.setdefault(f, _NOTHING_MEASURED)
        if stopped is not None:
            reasons["stepprof"] = stopped
        if "gpu_ms" in reasons:
            reasons.setdefault("gpu_busy_median", reasons["gpu_ms"])
        if "samples_per_s" in reasons:
            reasons.setdefault("samples_per_s_median", reasons.pop("samples_per_s"))
        if "peak_allocated_bytes" in reasons:
            reasons.setdefault("peak_allocated_bytes_max", reasons.pop("peak_allocated_bytes"))
        if log_failed:
            reasons["log"] = log_failed
        busy = Percentiles.of(self._busy)
        sps = Percentiles.of(self._sps)
        ovh = Percentiles.of(self._ovh)
        syncs = Percentiles.of(self._sync_counts)
        tflops, mfu = Percentiles.of(self._tflops), Percentiles.of(self._mfu)
        if not tflops:
            reasons["tflops_per_s_median"] = flops_reasons[0]
        if not mfu:
            reasons["mfu_median"] = (
                reasons["tflops_per_s_median"] if not tflops else flops_reasons[1] or "not computed"
            )
        if not self._sync_counts and "syncs_per_step_median" in reasons:
            reasons["sync_mechanism"] = reasons["syncs_per_step_median"]
        figures = {
            "wall_ms": self._wall, "gpu_ms": self._gpu, "gpu_busy_median": self._busy,
            "samples_per_s_median": self._sps, "overhead_us_median": self._ovh,
            "peak_allocated_bytes_max": self._peak_max,
            "syncs_per_step_median": self._sync_counts,
            "sync_mechanism": self._sync_counts,
            "tflops_per_s_median": self._tflops, "mfu_median": self._mfu,
        }
        # A reason is kept only for a figure that is null: some steps may lack a
        # figure (no batch_size once) while the others still give the median.
        reasons = {k: v for k, v in reasons.items() if k not in figures or not figures[k]}
        return Summary(
            steps=self._n_steps,
            warmup_steps=self._n_warm,
            error_steps=self._n_err,
            measured_steps=measured,
            device=device,
            wall_ms=Percentiles.of(self._wall),
            gpu_ms=Percentiles.of(self._gpu),
            gpu_busy_median=busy.median if busy else None,
            peak_allocated_bytes_max=self._peak_max,
            samples_per_s_median=sps.median if sps else None,
            overhead_us_median=ovh.median if ovh else None,
            log=log,
            syncs_per_step_median=syncs.median if syncs else None,
            sync_mechanism=sync_mechanism if self._sync_counts else None,
            tflops_per_s_median=tflops.median if tflops else None,
            mfu_median=mfu.median if mfu else None,
            unavailable=reasons,
        )
