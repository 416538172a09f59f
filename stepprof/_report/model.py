"""What ``stepprof report`` found: frozen records, serialised as is by ``--json``.

``attrs.asdict(report)`` is the JSON layout (:data:`REPORT_VERSION`); docs/reference/cli.md
describes its keys.  The text rendering (:mod:`.render`) reads only these records.
"""

from __future__ import annotations

from typing import Any

import attrs

from .._aggregate import RunFigures

__all__ = [
    "REPORT_VERSION",
    "AllocatorCounts",
    "CompileFigures",
    "Diagnosis",
    "DistributedView",
    "LogReport",
    "MemoryFigures",
    "PhaseRow",
    "RankExchanges",
    "RankRow",
    "Report",
    "RunReport",
    "Spike",
    "Spikes",
    "StragglerCheck",
    "SweepReport",
    "SyncSite",
    "SyncTable",
]

#: Version of the ``--json`` layout.
REPORT_VERSION = 1


@attrs.frozen
class Diagnosis:
    """One thing that stands out in a run, with the evidence for it and what to do."""

    kind: str
    title: str
    evidence: tuple[str, ...]
    remedy: tuple[str, ...]


@attrs.frozen
class MemoryFigures:
    """Peaks from the step records; the rest from the run's last ``memory`` record."""

    peak_allocated_bytes_max: float | None
    reserved_bytes_max: float | None
    reserved_bytes_last: float | None
    host_rss_bytes_last: float | None
    memory_records: int
    nvml_process_bytes: float | None
    residual_bytes: float | None
    residual_bytes_first: float | None  # from the first steady (after warm-up or periodic) record
    allocated_bytes: float | None
    total_bytes: float | None
    device_used_bytes: float | None
    inactive_split_bytes: float | None
    num_alloc_retries: float | None
    num_ooms: float | None
    basis: str | None
    explanation: str | None
    notes: tuple[str, ...]


@attrs.frozen
class AllocatorCounts:
    """The caching allocator's counters, summed over the timed steps."""

    num_alloc_retries: int
    num_sync_all_streams: int
    num_device_alloc: int
    num_device_free: int
    steps: int
    steps_with_device_alloc: int


@attrs.frozen
class SyncSite:
    """One line of code that made the host wait for the GPU."""

    where: str
    kind: str
    code: str | None
    count: int
    per_step: float
    steps_with_it: int


@attrs.frozen
class SyncTable:
    """Syncs over the steps that counted them; the ten busiest sites."""

    steps_counted: int
    mechanism: str | None
    other_threads: int
    total: int
    sites: tuple[SyncSite, ...]


@attrs.frozen
class PhaseRow:
    """One phase (``measure`` name) over the timed steps: its ``stepprof.PhaseFigures``, named."""

    name: str
    steps: int
    runs_per_step: float | None
    wall_ms_median: float | None
    wall_ms_p90: float | None
    gpu_ms_median: float | None
    gpu_ms_p90: float | None
    peak_allocated_bytes_max: float | None
    syncs_per_step: float | None


@attrs.frozen
class Spike:
    """A step at least :data:`~stepprof._report.diagnose.SPIKE_FACTOR` times the median.

    ``syncs`` and ``data_wait_ms`` are None when its record has none.
    """

    step: int
    ms: float
    device_allocs: int
    alloc_retries: int
    syncs: int | None = None
    data_wait_ms: float | None = None


@attrs.frozen
class CompileFigures:
    """torch.compile in a run whose step records carry the compile fields.

    ``steps``: measured steps that compiled (left out of the figures), the first of them
    in ``step_list``; ``compiles``, ``compile_ms`` and ``graph_breaks`` over every step,
    warm-up included; ``recompile_reasons``: the first ones, as (step, reason).
    """

    steps: int
    step_list: tuple[int, ...]
    compiles: int
    compile_ms: float
    graph_breaks: int
    recompile_reasons: tuple[tuple[int, str], ...]


@attrs.frozen
class Spikes:
    """The slowest steps: those right after warm-up, the later ones, and their period."""

    threshold_ms: float
    median_ms: float
    count: int
    early: tuple[Spike, ...]
    late: tuple[Spike, ...]
    period_steps: int | None
    max_ms: float | None


@attrs.frozen
class RankExchanges:
    """Rank 0's ``ranks`` records: how many, who was named, the latest."""

    exchanges: int
    straggler_counts: dict[str, int]
    latest: dict[str, Any] | None
    latest_named: dict[str, Any] | None


@attrs.frozen
class RunReport:
    """One profiling run of a log: counts, figures, tables and diagnoses.

    ``run_id`` is the id its records carry (one per ``Profiler``), or None in a log
    written without ids.
    """

    run: int
    run_id: str | None
    device: str | None
    names: tuple[str, ...]
    steps: int
    warmup_steps: int
    error_steps: int
    measured_steps: int
    malformed_steps: int
    first_step: int | None
    last_step: int | None
    batch_size: int | None
    batch_sizes: int
    figures: RunFigures
    approximate_quantiles: bool
    memory: MemoryFigures
    allocator: AllocatorCounts | None
    syncs: SyncTable | None
    phases: tuple[PhaseRow, ...]
    flops: dict[str, Any] | None
    flops_counted_step: int | None
    #: The ``kind: "peak"`` record of the run (``explain_peak``), as written.
    peak: dict[str, Any] | None
    roofline: dict[str, Any] | None
    spikes: Spikes | None
    summary_found: bool
    #: Which boundary did the device work: "compiled" or "python" (from the summary record).
    boundary: str | None
    #: Timed steps with GPU figures (fewer than timed under ``overhead_budget``, or where the
    #: CUDA events missed a step: ``gpu_missing_reason``).
    gpu_steps: int
    unavailable: dict[str, str]
    rank: int | None
    local_rank: int | None
    world_size: int | None
    ranks: RankExchanges | None
    diagnoses: tuple[Diagnosis, ...]
    not_diagnosed: dict[str, str]
    #: torch.compile figures; None when no step record of the run carries them.
    compile: CompileFigures | None = None
    #: Each batch size of the timed steps, with how many steps had it (largest count first).
    batch_size_steps: tuple[tuple[int, int], ...] = ()
    #: The steps every figure is taken over (measured, less those compiled or FLOP-counted).
    timed_steps: int = 0
    #: When the run's steps have several names, each name has its own entry (the same
    #: ``run`` and ``run_id``) with only its steps' figures: this is its name.  None when
    #: the run has one name.
    step_name: str | None = None
    #: Why a timed step has no GPU figures (the first such step's reason), when some have them.
    gpu_missing_reason: str | None = None


@attrs.frozen
class SweepReport:
    """One sweep of a log: its points, its result record, and the table it prints as."""

    points: tuple[dict[str, Any], ...]
    result: dict[str, Any] | None
    table: str | None


@attrs.frozen
class LogReport:
    """One log: what was read, its runs and its sweeps."""

    path: str
    lines: int
    skipped_lines: int
    schema_versions: tuple[int, ...]
    newer_schema: int | None
    other_kinds: dict[str, int]
    runs: tuple[RunReport, ...]
    sweeps: tuple[SweepReport, ...]
    #: Runs before ``runs`` that were not kept: the report keeps a log's last ``runs_kept``.
    runs_dropped: int = 0
    runs_kept: int = 0
    #: When no line is a stepprof record (``ScanStats.foreign``): what the report says of the log.
    not_stepprof: str | None = None


@attrs.frozen
class RankRow:
    """One rank's log (its last run) in the cross-rank view."""

    rank: int
    local_rank: int | None
    world_size: int | None
    log: str
    steps: int
    measured_steps: int
    wall_ms_median: float | None
    gpu_ms_median: float | None
    peak_allocated_bytes_max: float | None
    syncs_per_step_median: float | None
    phases: dict[str, float | None]


@attrs.frozen
class StragglerCheck:
    """The straggler rule of stepprof._dist applied to the per-rank medians."""

    straggler_rank: int | None
    basis: str | None
    excess_ms: float | None
    step_ratio: float | None
    step_figure: str
    reason: str | None


@attrs.frozen
class DistributedView:
    """Per-rank logs side by side."""

    ranks: tuple[RankRow, ...]
    from_medians: StragglerCheck
    exchanges: RankExchanges | None
    notes: tuple[str, ...]


@attrs.frozen
class Report:
    """What ``stepprof report`` prints: each log, then the ranks seen together."""

    stepprof_report: int
    logs: tuple[LogReport, ...]
    distributed: DistributedView | None

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able form (what ``--json`` prints)."""
        return attrs.asdict(self)
