"""From a log's aggregates to the report's records: tables, the roofline, diagnoses, the ranks view."""

from __future__ import annotations

import itertools
import math
import os
from typing import Any

import attrs

from .._aggregate import RunAggregate, finite_number
from .._dist import find_straggler
from .._schema import SCHEMA_VERSION
from .._roofline import load_calibration, roofline
from .diagnose import SPIKE_FACTOR, diagnose, spike_period
from .model import (
    REPORT_VERSION,
    AllocatorCounts,
    CompileFigures,
    DistributedView,
    LogReport,
    MemoryFigures,
    PhaseRow,
    RankExchanges,
    RankRow,
    Report,
    RunReport,
    Spike,
    Spikes,
    StragglerCheck,
    SweepReport,
    SyncSite,
    SyncTable,
)
from .read import logs_pool, read_log
from .sweeps import LoggedSweep, logged_sweeps

__all__ = ["build_report", "read_calibration", "report_log"]

#: Missing ranks named one by one in the cross-rank note; beyond these, a count.
MISSING_RANKS_NAMED = 8

#: The aggregate's reason keys that the report names after its own lines.
_REPORT_REASON_KEYS = {
    "samples_per_s_median": "samples_per_s",
    "syncs_per_step_median": "syncs_per_step",
    "peak_allocated_bytes_max": "peak_allocated_bytes",
}


def build_report(paths: list[str]) -> Report:
    """The report of the logs at ``paths`` (``--json`` prints ``report.to_dict()``)."""
    logs = _report_logs(paths)
    return Report(stepprof_report=REPORT_VERSION, logs=logs, distributed=_cross_rank(logs))


def _report_logs(paths: list[str]) -> tuple[LogReport, ...]:
    """Each log's report, in order; several rank logs side by side (:func:`~.read.logs_pool`)."""
    try:
        sizes = [os.path.getsize(p) for p in paths]
    except OSError:  # (report_log says which, as it reads them in turn)
        sizes = []
    pool = logs_pool(sizes)
    if pool is None:
        return tuple(report_log(p) for p in paths)
    with pool:
        return tuple(pool.map(report_log, paths, chunksize=1))


def report_log(path: str, workers: int | None = None) -> LogReport:
    """Stream one log into its report.

    Args:
        path: the log.
        workers: processes to read it with (see :func:`~stepprof._report.read.read_log`).
    """
    segment = read_log(path, workers)
    sweeps = logged_sweeps(segment.sweep_records)
    last_result = next((s.result_record for s in reversed(sweeps) if s.result_record is not None), None)
    versions = segment.versions
    newer = sorted(v for v in versions if type(v) is int and v > SCHEMA_VERSION)
    runs = tuple(
        report
        for run in segment.runs
        if run.steps or run.memory_records or run.flops or run.ranks_records
        for report in _run_reports(run, last_result)
    )
    return LogReport(
        path=os.fspath(path),
        lines=segment.stats.lines,
        skipped_lines=segment.stats.skipped,
        schema_versions=tuple(sorted(v for v in versions if type(v) is int)),
        newer_schema=newer[-1] if newer else None,
        other_kinds=segment.kinds,
        runs=runs,
        sweeps=tuple(_sweep_report(s) for s in sweeps),
        runs_dropped=segment.runs_dropped,
        runs_kept=segment.runs_kept,
        not_stepprof=segment.stats.foreign(),
    )


def _sweep_report(sweep: LoggedSweep) -> SweepReport:
    return SweepReport(
        points=tuple(attrs.asdict(p) for p in sweep.points), result=sweep.result_record, table=sweep.table
    )


def _run_reports(agg: RunAggregate, sweep: dict[str, Any] | None) -> list[RunReport]:
    """The run's report; one per step name when its steps have several names.

    Each name's report has that name's step figures; the run's other records (memory,
    the summary, ranks) are the run's, and its FLOPs go to the name whose step was counted.
    """
    groups = agg.name_groups()
    if not groups:
        return [run_report(agg, sweep)]
    return [attrs.evolve(run_report(group, sweep), step_name=name) for name, group in groups.items()]


def run_report(agg: RunAggregate, sweep: dict[str, Any] | None) -> RunReport:
    """One run's report: the aggregate's figures, its tables, the roofline and the diagnoses.

    Args:
        agg: the run.
        sweep: the result record of the log's last finished sweep, if any.
    """
    figures = agg.figures()
    unavailable = {_REPORT_REASON_KEYS.get(k, k): v for k, v in agg.unavailable().items()}
    identity = agg.identity or {}
    roof, roofline_reason = _roofline(agg.flops, figures.step_ms.median if figures.step_ms else None,
                                      compiled=agg.compile_seen)
    run = RunReport(
        run=agg.index,
        run_id=agg.run_id,
        device=agg.device,
        names=tuple(sorted(agg.names)),
        steps=agg.steps,
        warmup_steps=agg.warmup,
        error_steps=agg.errors,
        measured_steps=agg.measured,
        malformed_steps=agg.malformed,
        first_step=agg.first_step,
        last_step=agg.last_step if agg.first_step is not None else None,
        batch_size=max(agg.batch_sizes, key=lambda k: agg.batch_sizes[k]) if agg.batch_sizes else None,
        batch_sizes=len(agg.batch_sizes),
        batch_size_steps=tuple(sorted(agg.batch_sizes.items(), key=lambda kv: (-kv[1], kv[0]))),
        timed_steps=agg.timed_steps,
        figures=figures,
        approximate_quantiles=agg.approximate,
        memory=_memory(agg),
        allocator=AllocatorCounts(**agg.alloc, steps=agg.alloc_steps,
                                  steps_with_device_alloc=agg.steps_with_device_alloc)
        if agg.alloc_steps else None,
        syncs=_sync_table(agg),
        phases=_phase_rows(agg),
        flops=agg.flops,
        flops_counted_step=agg.flops_counted_step,
        peak=agg.peak_record,
        roofline=roof,
        spikes=_spikes(agg, figures.step_ms.median if figures.step_ms else None),
        summary_found=agg.summary is not None,
        boundary=agg.boundary(),
        gpu_steps=agg.gpu.count,
        gpu_missing_reason=agg.step_reasons.get("gpu_ms") if 0 < agg.gpu.count < agg.timed_steps else None,
        unavailable=unavailable,
        rank=identity.get("rank"),
        local_rank=identity.get("local_rank"),
        world_size=identity.get("world_size"),
        ranks=RankExchanges(
            exchanges=agg.ranks_records,
            straggler_counts={str(k): v for k, v in sorted(agg.ranks_named.items())},
            latest=agg.ranks_last,
            latest_named=agg.ranks_last_named,
        ) if agg.ranks_records else None,
        diagnoses=(),
        not_diagnosed={},
        compile=CompileFigures(
            steps=agg.compile_steps, step_list=tuple(agg.compile_step_list), compiles=agg.compiles,
            compile_ms=agg.compile_us / 1e3, graph_breaks=agg.graph_breaks,
            recompile_reasons=tuple(agg.recompile_reasons),
        ) if agg.compile_seen else None,
    )
    found, missing = diagnose(run, sweep, roofline_reason)
    return attrs.evolve(run, diagnoses=found, not_diagnosed=missing)


def _memory(agg: RunAggregate) -> MemoryFigures:
    last = agg.memory_last or {}
    first = agg.memory_first or {}
    notes = last.get("notes")
    return MemoryFigures(
        peak_allocated_bytes_max=agg.peak,
        reserved_bytes_max=agg.reserved,
        reserved_bytes_last=agg.reserved_last,
        host_rss_bytes_last=agg.rss,
        memory_records=agg.memory_records,
        nvml_process_bytes=finite_number(last.get("nvml_process_bytes")),
        residual_bytes=finite_number(last.get("residual_bytes")),
        residual_bytes_first=finite_number(first.get("residual_bytes")),
        allocated_bytes=finite_number(last.get("allocated_bytes")),
        total_bytes=finite_number(last.get("total_bytes")),
        device_used_bytes=finite_number(last.get("mem_get_info_used_bytes")),
        inactive_split_bytes=finite_number(last.get("inactive_split_bytes")),
        num_alloc_retries=finite_number(last.get("num_alloc_retries")),
        num_ooms=finite_number(last.get("num_ooms")),
        basis=last.get("basis") if type(last.get("basis")) is str else None,
        explanation=last.get("explanation") if type(last.get("explanation")) is str else None,
        notes=tuple(n for n in notes if type(n) is str) if type(notes) is list else (),
    )


def _sync_table(agg: RunAggregate) -> SyncTable | None:
    if not agg.sync_steps:
        return None
    sites = agg.totals.sites
    busiest = sorted(sites.value.items(), key=lambda kv: -kv[1][0])[:10]
    return SyncTable(
        steps_counted=agg.sync_steps,
        mechanism=agg.sync_mechanism,
        other_threads=agg.other_threads,
        total=int(sum(v[0] for v in sites.value.values()) + sites.dropped),
        sites=tuple(
            SyncSite(where=where, kind=kind, code=code, count=n, per_step=n / agg.sync_steps, steps_with_it=steps)
            for (where, kind), (n, code, steps) in busiest
        ),
    )


def _phase_rows(agg: RunAggregate) -> tuple[PhaseRow, ...]:
    """The aggregate's phase figures (the summary's ``phases``), one row per phase."""
    return tuple(PhaseRow(name=name, **attrs.asdict(f)) for name, f in agg.phase_figures().items())


def _spikes(agg: RunAggregate, median: float | None) -> Spikes | None:
    if median is None:
        return None
    threshold = SPIKE_FACTOR * median
    top = sorted((s for s in agg.spikes if s[0] >= threshold), key=lambda s: s[1])
    n = agg.span.count_above(threshold) if top else 0
    early_until = (agg.first_measured or 0) + max(10, agg.measured // 20)
    early = [s for s in top if 0 <= s[1] < early_until]
    late = [s for s in top if s not in early]
    return Spikes(
        threshold_ms=threshold,
        median_ms=median,
        count=n,
        early=tuple(_spike(s) for s in early),
        late=tuple(_spike(s) for s in late),
        period_steps=spike_period([s[1] for s in late]),
        max_ms=agg.span.max(),
    )


def _spike(s: tuple[Any, ...]) -> Spike:
    """A spike from the aggregate's heap entry (-1: not recorded)."""
    return Spike(step=s[1], ms=s[0], device_allocs=s[2], alloc_retries=s[3],
                 syncs=s[4] if s[4] >= 0 else None, data_wait_ms=s[5] if s[5] >= 0 else None)


def _roofline(
    flops: dict[str, Any] | None, step_ms: float | None, *, compiled: bool = False
) -> tuple[dict[str, Any] | None, str]:
    """The roofline of the median step, and why there is none (or no class).

    ``compiled``: the run compiled (torch.compile), so the per-operation bounds are upper
    bounds for its fused kernels (see :func:`stepprof._roofline.roofline`).
    """
    if flops is None:
        return None, (
            "FLOPs are not in this log: run with Profiler(flops='auto') (or flops_per_step=N) "
            "and `stepprof calibrate` once"
        )
    by_dtype = flops.get("flops_by_dtype")
    if step_ms is None:
        return None, "no measured step to compare the FLOPs with"
    if type(by_dtype) is not dict:
        return None, (
            "the FLOPs' dtypes are unknown (flops_per_step was given): run with "
            "Profiler(flops='auto') for the roofline"
        )
    calibration = flops.get("calibration")
    source = "log"
    if type(calibration) is not dict:
        name = flops.get("device_name")
        calibration, why = load_calibration(name) if type(name) is str else (None, None)
        if calibration is None:
            return None, (
                why or "the log has no calibration and names no GPU model"
            ) + " (MFU and the class use only measured peaks)"
        source = "this machine's cache"
    calibration, ignored = read_calibration(calibration)
    try:
        r = roofline(
            step_ms=step_ms,
            flops_by_dtype=by_dtype,
            op_bytes=finite_number(flops.get("op_bytes")),
            ops=flops.get("ops") if type(flops.get("ops")) is int else None,
            calibration=calibration,
            compiled=compiled,
        )
    except (TypeError, ValueError, ZeroDivisionError) as e:
        return None, f"the log's flops record is malformed ({e})"
    r["calibration_source"] = source
    r["calibration"] = calibration
    r["calibration_ignored"] = ignored
    return r, r.get("reason") or ""


def _positive(x: Any) -> float | None:
    """A finite number above 0, else None."""
    x = finite_number(x)
    return x if x is not None and x > 0 else None


def read_calibration(raw: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The fields of a calibration (from a log or the cache) that the roofline reads, checked.

    Returns the calibration, each figure a finite number above 0 or None (``matmul_tflops``:
    only such rates, by dtype), and the names of the fields skipped for their type or value
    (``matmul_tflops.fp8`` for one rate).  A field absent from ``raw`` is None and not named.
    """
    ignored: list[str] = []
    rates = raw.get("matmul_tflops")
    peaks: dict[str, float] = {}
    if type(rates) is dict:
        for dtype, rate in rates.items():
            peak = _positive(rate)
            if type(dtype) is str and peak is not None:
                peaks[dtype] = peak
            else:
                ignored.append(f"matmul_tflops.{dtype}")
    elif rates is not None:
        ignored.append("matmul_tflops")
    out: dict[str, Any] = {"device_name": raw.get("device_name"), "matmul_tflops": peaks}
    if type(out["device_name"]) is not str:
        if out["device_name"] is not None:
            ignored.append("device_name")
        out["device_name"] = None
    for key in ("copy_gbps", "launch_us"):
        value = raw.get(key)
        out[key] = _positive(value)
        if out[key] is None and value is not None:
            ignored.append(key)
    return out, ignored


def _cross_rank(logs: tuple[LogReport, ...]) -> DistributedView | None:
    """Per-rank logs together: a row per rank (each log's last run) and the straggler view."""
    last: dict[int, tuple[str, RunReport]] = {}
    for log in logs:
        for run in log.runs:
            if run.rank is not None:
                seen = last.get(run.rank)
                if (seen is not None and seen[1].run == run.run and seen[1].run_id == run.run_id
                        and seen[1].measured_steps >= run.measured_steps):
                    continue  # a run with several step names: its name with the most steps
                last[run.rank] = (log.path, run)
    if not last:
        return None
    rows = []
    for rank in sorted(last):
        path, run = last[rank]
        f = run.figures
        rows.append(RankRow(
            rank=rank, local_rank=run.local_rank, world_size=run.world_size, log=path, steps=run.steps,
            measured_steps=run.measured_steps,
            wall_ms_median=f.wall_ms.median if f.wall_ms else None,
            gpu_ms_median=f.gpu_ms.median if f.gpu_ms else None,
            peak_allocated_bytes_max=run.memory.peak_allocated_bytes_max,
            syncs_per_step_median=f.syncs_per_step.median if f.syncs_per_step else None,
            phases={ph.name: ph.gpu_ms_median if ph.gpu_ms_median is not None else ph.wall_ms_median
                    for ph in run.phases if "/" not in ph.name},
        ))
    notes = []
    world = max((r.world_size for r in rows if type(r.world_size) is int), default=None)
    if world is not None:
        missing = _missing_ranks(world, {r.rank for r in rows})
        if missing:
            notes.append(missing)
    # The report's own check, on the per-rank medians over the whole run (rows in rank order;
    # the rule's index is the position, mapped back to the rank).
    gpu = all(r.gpu_ms_median is not None for r in rows)
    step = [math.nan if x is None else x for x in (r.gpu_ms_median if gpu else r.wall_ms_median for r in rows)]
    names = list(rows[0].phases)
    same = all(list(r.phases) == names for r in rows)
    segments = [(n, [math.nan if x is None else x for x in (r.phases[n] for r in rows)])
                for n in names] if same else []
    if not same:
        notes.append("the ranks' phase names differ, so phases are not compared")
    found = find_straggler(step, segments)
    check = StragglerCheck(
        straggler_rank=rows[found.rank].rank if found.rank is not None else None,
        basis=found.basis, excess_ms=found.excess_ms, step_ratio=found.ratio,
        step_figure="gpu_ms" if gpu else "wall_ms", reason=found.reason,
    )
    exchanges = None
    for _, run in last.values():
        if run.ranks is not None:
            exchanges = run.ranks
    return DistributedView(ranks=tuple(rows), from_medians=check, exchanges=exchanges, notes=tuple(notes))


def _missing_ranks(world: int, have: set[int]) -> str | None:
    """The note on the ranks below ``world`` whose logs were not given, or None.

    ``world`` comes from the log, so it never sizes the work: the note counts the
    missing ranks and names the first :data:`MISSING_RANKS_NAMED`, in
    O(len(have) + MISSING_RANKS_NAMED) steps whatever ``world`` is.
    """
    count = world - sum(1 for r in have if 0 <= r < world)
    if count <= 0:
        return None
    first = list(itertools.islice((r for r in range(world) if r not in have), MISSING_RANKS_NAMED))
    named = ", ".join(str(r) for r in first)
    if count <= len(first):
        return f"logs of rank(s) {named} were not given"
    return f"logs of {count:,} rank(s) were not given (the first: {named}, ...)"
