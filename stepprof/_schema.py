"""The log's record schema: its version, its kinds, and the builders of the step and summary records.

Every line of a stepprof log is one record, a JSON object with ``schema_version`` and
``kind``.  docs/schema.md describes each field.  One function builds each kind:

- ``step``: :func:`step_record` (the collector's ``build_step_record`` calls it).
- ``summary``: :func:`summary_record` (through ``stepprof.Summary.to_record``).
- ``memory``: ``stepprof.MemoryReport.to_record`` (stepprof/_memory.py).
- ``flops``: ``FlopsHook._set_flops`` (stepprof/_recorder/flops.py).
- ``ranks``: ``ranks_record`` and ``unjoined_record`` (stepprof/_dist.py).
- ``sweep_point``: ``stepprof.SweepPoint.to_record``.
- ``sweep_result``: ``stepprof.SweepResult.to_record``.

The writer adds ``schema_version`` to a record that lacks it, ``run_id`` (the profiler's)
after its fields, and in a distributed run the rank fields ``rank``, ``local_rank`` and
``world_size`` at its end.

Version 2 renamed the summary's ``wall_ms`` and ``gpu_ms`` (percentile objects) to
``wall_ms_percentiles`` and ``gpu_ms_percentiles``, so that no column holds a float in
one kind and an object in another.  :func:`upgrade_record` gives a version-1 record
the version-2 names; :func:`stepprof.read` and ``_log.scan`` apply it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

import attrs

if TYPE_CHECKING:  # pragma: no cover
    from ._records import Percentiles, PhaseFigures, Summary

__all__ = [
    "RECORD_KINDS",
    "SCHEMA_VERSION",
    "SUMMARY_RENAMED",
    "step_record",
    "summary_record",
    "upgrade_record",
]

#: Version of the record schema; every line carries it as ``schema_version``.
SCHEMA_VERSION: Final = 2

#: The record kinds stepprof writes (docs/schema.md).
RECORD_KINDS: Final = frozenset(
    {"step", "summary", "memory", "flops", "peak", "ranks", "sweep_point", "sweep_result"}
)

#: The summary's keys that version 2 renamed: version-1 name -> version-2 name.
SUMMARY_RENAMED: Final = {"wall_ms": "wall_ms_percentiles", "gpu_ms": "gpu_ms_percentiles"}


class _Absent:
    """Marks an optional field that the record leaves out (None is a value: a null figure)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "ABSENT"


#: Default of :func:`step_record`'s optional fields: the key is not written.
ABSENT: Final = _Absent()


def step_record(
    *,
    step: int,
    name: str,
    warmup: bool,
    device: str,
    start_unix_s: float,
    wall_ms: float,
    gpu_ms: float | None,
    gpu_busy: float | None,
    peak_allocated_bytes: int | None,
    reserved_bytes: int | None,
    batch_size: int | None,
    samples_per_s: float | None,
    phases: dict[str, dict[str, Any]],
    overhead_us: float,
    error: dict[str, str] | None,
    syncs: dict[str, Any] | None,
    allocator: dict[str, int] | None,
    unavailable: dict[str, str],
    host_rss_bytes: int | None | _Absent = ABSENT,
    thread: str | _Absent = ABSENT,
    sampled: bool | _Absent = ABSENT,
    data_wait_ms: float | None = None,
    data_ms: float | _Absent = ABSENT,
    flops: float | None | _Absent = ABSENT,
    tflops_per_s: float | None | _Absent = ABSENT,
    mfu: float | None | _Absent = ABSENT,
    flops_counted: bool = False,
    energy_j: float | None | _Absent = ABSENT,
    energy_span_ms: float | None | _Absent = ABSENT,
    compiles: int | _Absent = ABSENT,
    recompiles: int | _Absent = ABSENT,
    compile_ms: float | _Absent = ABSENT,
    graph_breaks: int | None | _Absent = ABSENT,
    recompile_reasons: list[str] | _Absent = ABSENT,
    compiled: bool | _Absent = ABSENT,
    run_id: str | None = None,
    rank: int | None = None,
    local_rank: int | None = None,
    world_size: int | None = None,
) -> dict[str, Any]:
    """A ``kind: "step"`` record, its keys in the order docs/schema.md gives.

    The optional fields are left out at their default: ``host_rss_bytes`` (CPU steps
    only), ``thread`` (steps of a thread other than the training thread), ``sampled``
    (under ``overhead_budget``: whether the step got its GPU figures), ``data_ms`` (a batch
    fetched through ``stepprof.iterate``), ``flops``,
    ``tflops_per_s`` and ``mfu`` (with FLOPs requested), ``flops_counted`` (written only
    as True), ``energy_j`` and ``energy_span_ms`` (CUDA steps with energy sampling on; the
    ``EnergyHook`` adds them), the compile fields ``compiles`` to ``compiled`` (once the process
    has compiled: ``_recorder/compiles.CompileHook``), and ``run_id`` and the rank fields (a
    distributed run's), which the log
    writer adds.
    ``unavailable`` is kept by reference, so a caller may still add reasons to it.
    """
    record: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "kind": "step",
        "step": step,
        "name": name,
        "warmup": warmup,
        "device": device,
        "start_unix_s": start_unix_s,
        "wall_ms": wall_ms,
        "gpu_ms": gpu_ms,
        "gpu_busy": gpu_busy,
        "peak_allocated_bytes": peak_allocated_bytes,
        "reserved_bytes": reserved_bytes,
        "batch_size": batch_size,
        "samples_per_s": samples_per_s,
        "data_wait_ms": data_wait_ms,
        "phases": phases,
        "overhead_us": overhead_us,
        "error": error,
        "syncs": syncs,
        "allocator": allocator,
        "unavailable": unavailable,
    }
    # Written out rather than looped: the collector builds every step record here.
    if host_rss_bytes is not ABSENT:
        record["host_rss_bytes"] = host_rss_bytes
    if thread is not ABSENT:
        record["thread"] = thread
    if sampled is not ABSENT:
        record["sampled"] = sampled
    if data_ms is not ABSENT:
        record["data_ms"] = data_ms
    if flops is not ABSENT:
        record["flops"] = flops
    if tflops_per_s is not ABSENT:
        record["tflops_per_s"] = tflops_per_s
    if mfu is not ABSENT:
        record["mfu"] = mfu
    if flops_counted:
        record["flops_counted"] = True
    if energy_j is not ABSENT:
        record["energy_j"] = energy_j
    if energy_span_ms is not ABSENT:
        record["energy_span_ms"] = energy_span_ms
    if compiles is not ABSENT:
        record["compiles"] = compiles
        record["recompiles"] = recompiles
        record["compile_ms"] = compile_ms
        record["graph_breaks"] = graph_breaks
        record["recompile_reasons"] = recompile_reasons
        record["compiled"] = compiled
    if run_id is not None:
        record["run_id"] = run_id
    if rank is not None:
        record["rank"] = rank
    if local_rank is not None:
        record["local_rank"] = local_rank
    if world_size is not None:
        record["world_size"] = world_size
    return record


def _percentiles(p: Percentiles | None) -> dict[str, float] | None:
    return None if p is None else attrs.asdict(p)


def _phases(phases: dict[str, PhaseFigures]) -> dict[str, dict[str, Any]]:
    return {name: attrs.asdict(figures) for name, figures in phases.items()}


def summary_record(summary: Summary) -> dict[str, Any]:
    """The ``kind: "summary"`` record of ``summary`` (without ``schema_version``, which the
    writer adds).

    The percentile figures go under ``wall_ms_percentiles`` and ``gpu_ms_percentiles``,
    and so do their reasons in ``unavailable``; the attributes of ``stepprof.Summary``
    keep the names ``wall_ms`` and ``gpu_ms``.  ``phases`` holds each phase's
    ``stepprof.PhaseFigures`` as an object of the same fields.  ``compile_steps`` is
    written only when the run saw compilation (not None).
    """
    s = summary
    record = {
        "kind": "summary",
        "steps": s.steps,
        "warmup_steps": s.warmup_steps,
        "error_steps": s.error_steps,
        "measured_steps": s.measured_steps,
        "device": s.device,
        "wall_ms_percentiles": _percentiles(s.wall_ms),
        "gpu_ms_percentiles": _percentiles(s.gpu_ms),
        "gpu_busy_median": s.gpu_busy_median,
        "peak_allocated_bytes_max": s.peak_allocated_bytes_max,
        "samples_per_s_median": s.samples_per_s_median,
        "overhead_us_median": s.overhead_us_median,
        "log": s.log,
        "syncs_per_step_median": s.syncs_per_step_median,
        "sync_mechanism": s.sync_mechanism,
        "syncs_outside_steps": s.syncs_outside_steps,
        "tflops_per_s_median": s.tflops_per_s_median,
        "mfu_median": s.mfu_median,
        "phases": _phases(s.phases),
        "ended_by": s.ended_by,
        "overhead_us_mean": s.overhead_us_mean,
        "gpu_steps": s.gpu_steps,
        "boundary": s.boundary,
        "data_wait_ms_median": s.data_wait_ms_median,
        "input_wait_fraction": s.input_wait_fraction,
        "energy_j_per_step": s.energy_j_per_step,
        "power_w_mean": s.power_w_mean,
        "samples_per_j": s.samples_per_j,
        "unavailable": {SUMMARY_RENAMED.get(k, k): v for k, v in s.unavailable.items()},
        "run_id": s.run_id,
    }
    if s.compile_steps is not None:
        record["compile_steps"] = s.compile_steps
    return record


def upgrade_record(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with the version-2 names if it is a version-1 summary.

    A summary without ``schema_version`` counts as version 1, and keeps the version it
    was written with.  Keys keep their order.  Every other record is returned as it is
    (the same object): versions 1 and 2 differ only in the summary.
    """
    version = record.get("schema_version")
    if record.get("kind") != "summary" or (type(version) is int and version >= 2):
        return record
    upgraded = {}
    for key, value in record.items():
        new = SUMMARY_RENAMED.get(key)
        if new is not None and new not in record:
            key = new
        elif key == "unavailable" and type(value) is dict:
            value = {SUMMARY_RENAMED.get(k, k): v for k, v in value.items()}
        upgraded[key] = value
    return upgraded
