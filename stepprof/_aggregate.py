"""The one aggregate of a run's records: every figure the summary and the report show.

:class:`RunAggregate` takes the record dicts of one run (``step``, ``memory``,
``flops``, ``ranks``, ``summary``), straight from the log writer or from a log
read back, and keeps them in bounded memory: each per-step figure in a
:class:`~stepprof._stats.QuantileSketch`, sync sites, phases and batch sizes in
capped tables, the slowest steps in a small heap.  :meth:`RunAggregate.figures`
and :meth:`RunAggregate.unavailable` give the figures and, for each that is
missing, why; :meth:`RunAggregate.phase_figures` gives each phase's; and
:meth:`RunAggregate.summary_fields` gives them as the fields of :class:`stepprof.Summary`.
``Profiler.close()`` and ``stepprof report`` both read them from here, so that they agree
to the last digit.

What counts, in one place:

- a *measured* step is past warm-up, without an error, with a numeric ``wall_ms``;
- the step flagged ``flops_counted`` ran under ``FlopCounterMode`` (eagerly, with the
  counter's own cost): it counts as measured but is left out of every per-step figure;
- so is the step flagged ``explained`` (``explain_peak`` recorded its allocator history);
- so is a step flagged ``compiled`` (torch.compile compiled inside it): measured, left
  out of the figures like a warm-up step, and counted in ``compile_steps``;
- the one MFU is the median of the steps' ``mfu``;
- energy (``energy_j``, over the timed steps that have it) is summed, not sketched:
  J per step is the mean, average W the sum of ``energy_j`` over the sum of
  ``energy_span_ms``, samples per joule the batch sizes over their steps' joules.

``add`` is the report's hot loop (a million records a log; see bench/report.py), so
the step path is written out with type tests rather than generic helpers.
"""

from __future__ import annotations

import copy
import heapq
import math
from typing import Any

import attrs

from ._records import Percentiles, PhaseFigures
from ._rules import COMPILED, COUNTED, ERROR, MALFORMED, WARMUP, left_out, span_ms
from ._stats import QuantileSketch

__all__ = [
    "NO_MEASURED_STEPS",
    "NOT_REQUESTED_FLOPS",
    "NO_STEP_AFTER_THE_COUNT",
    "RunAggregate",
    "RunFigures",
    "finite_number",
]

#: Sync sites, phase names, batch sizes and reasons kept per run.
TABLE_CAP = 256
#: Step names given their own figures per run; the steps of further names are grouped together.
NAMES_SPLIT = 16
#: The group of the steps without a name, and of the names past :data:`NAMES_SPLIT`.
NO_NAME, OTHER_NAMES = "(no name)", "(other names)"
#: Slowest steps kept per run (for the spikes diagnosis).
SPIKES_KEPT = 32
#: Steps between two folds of the sketches' buffers.
_SETTLE_EVERY = 4096

NO_MEASURED_STEPS = "no measured steps (all were warm-up, failed, or none ran)"
ONLY_THE_COUNTED_STEP = (
    "no measured step besides the one whose FLOPs were counted (its times include FlopCounterMode's cost)"
)
NOT_REQUESTED_FLOPS = "FLOPs were not requested: pass Profiler(flops='auto') or flops_per_step=N"
NO_STEP_AFTER_THE_COUNT = "no measured step after the counted one"
NO_ENERGY = ("no step record has energy_j: energy is sampled on CUDA only "
             "(Profiler(energy_every_s=...)), and logs of stepprof 0.1.0 lack it")
ONLY_COMPILE_STEPS = (
    "no measured step besides those left out of the figures: the steps that compiled "
    "(their times include torch.compile's compilation)"
)
#: Recompile reasons kept per run (with their steps), and measured compile steps named.
COMPILE_REASONS_KEPT = 10
COMPILE_STEPS_NAMED = 32
#: Why a figure that only the summary record carries is missing.
NO_SUMMARY = "no summary record (the run did not close)"

#: Figures whose reason comes from the step records' ``unavailable`` (figure -> step field),
#: with the reason used when no step gave one.
_STEP_REASONS = {
    "gpu_ms": ("gpu_ms", "not recorded"),
    "data_wait_ms_median": ("data_wait_ms", "not in this log (written by an older stepprof)"),
    "input_wait_fraction": ("data_wait_ms", "not in this log (written by an older stepprof)"),
    "gpu_busy_median": ("gpu_busy", "not recorded"),
    "samples_per_s_median": ("samples_per_s", "not recorded"),
    "syncs_per_step_median": ("syncs", "not in this log (written by an older stepprof)"),
    "peak_allocated_bytes_max": ("peak_allocated_bytes", "not recorded"),
}

#: Phase figures whose reason comes from the step records' ``unavailable``: the
#: :class:`~stepprof.PhaseFigures` field -> (the reason's key in the summary, in the steps).
_PHASE_REASONS = {
    "gpu_ms_median": ("phases.gpu_ms", "phases.gpu_ms"),
    "peak_allocated_bytes_max": ("phases.peak_allocated_bytes_max", "phases.peak_allocated_bytes"),
    "syncs_per_step": ("phases.syncs_per_step", "phases.syncs"),
}


def finite_number(x: Any) -> float | None:
    """A finite number, else None (logs are read as found: a field may hold anything)."""
    if type(x) is float:
        return x if math.isfinite(x) else None
    if type(x) is int:
        return float(x)
    return None


def _larger(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


def _count(table: dict[Any, int], key: Any, n: int = 1) -> None:
    """Add ``n`` to ``table[key]``; a new key only while the table is below :data:`TABLE_CAP`."""
    if key in table:
        table[key] += n
    elif len(table) < TABLE_CAP:
        table[key] = n


def _add_counts(into: dict[Any, int], other: dict[Any, int]) -> None:
    for key, n in other.items():
        _count(into, key, n)


@attrs.frozen
class RunFigures:
    """A run's per-step figures over its timed steps (measured, less the FLOPs-counted one).

    ``step_ms`` is the step's span, ``max(wall_ms, gpu_ms)``: the time ``samples_per_s``
    and ``tflops_per_s`` divide by.
    """

    wall_ms: Percentiles | None
    gpu_ms: Percentiles | None
    step_ms: Percentiles | None
    samples_per_s: Percentiles | None
    gpu_busy_median: float | None
    syncs_per_step: Percentiles | None
    overhead_us_median: float | None
    overhead_us_mean: float | None
    #: Host time before each step since the previous one's exit (input, logging, anything).
    data_wait_ms: Percentiles | None
    #: The share of the loop's time (data wait + wall) spent in the data wait.
    input_wait_fraction: float | None
    #: Mean time in the loader's ``__next__`` (``data_ms``, with ``stepprof.iterate``).
    data_ms_mean: float | None
    tflops_per_s_median: float | None
    mfu_median: float | None
    energy_j_per_step: float | None = None
    power_w_mean: float | None = None
    samples_per_j: float | None = None


def _percentiles(sketch: QuantileSketch) -> Percentiles | None:
    d = sketch.percentiles()
    return None if d is None else Percentiles(**d)


class PhaseAggregate:
    """One phase name's figures over a run's timed steps."""

    __slots__ = ("wall", "gpu", "peak", "syncs", "sync_steps", "count", "steps")

    def __init__(self) -> None:
        self.wall, self.gpu = QuantileSketch(), QuantileSketch()
        self.peak: float | None = None
        self.syncs = 0
        self.sync_steps = 0  # steps that counted its syncs
        self.count = 0  # how many times it ran
        self.steps = 0  # in how many steps

    def merge(self, other: PhaseAggregate) -> None:
        self.wall.merge(other.wall)
        self.gpu.merge(other.gpu)
        self.peak = _larger(self.peak, other.peak)
        self.syncs += other.syncs
        self.sync_steps += other.sync_steps
        self.count += other.count
        self.steps += other.steps

    def figures(self) -> PhaseFigures:
        """Its figures (the sketches settled)."""
        steps = self.steps
        return PhaseFigures(
            steps=steps,
            runs_per_step=self.count / steps if steps else None,
            wall_ms_median=self.wall.quantile(0.5),
            wall_ms_p90=self.wall.quantile(0.9),
            gpu_ms_median=self.gpu.quantile(0.5),
            gpu_ms_p90=self.gpu.quantile(0.9),
            peak_allocated_bytes_max=self.peak,  # type: ignore[arg-type]  # an int, unless a log said otherwise
            syncs_per_step=self.syncs / self.sync_steps if self.sync_steps else None,
        )

    def __getstate__(self) -> tuple[Any, ...]:
        return (self.wall, self.gpu, self.peak, self.syncs, self.sync_steps, self.count, self.steps)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.wall, self.gpu, self.peak, self.syncs, self.sync_steps, self.count, self.steps = state


class RunAggregate:
    """One profiling run's records, aggregated in bounded memory.

    Example:
        >>> agg = RunAggregate()
        >>> for i in range(3):
        ...     agg.add({"kind": "step", "step": i, "warmup": i == 0, "wall_ms": 2.0 + i})
        >>> agg.summary_fields()["wall_ms"]
        Percentiles(median=3.5, p10=3.1, p90=3.9)
    """

    _COUNTERS = ("steps", "warmup", "errors", "measured", "alloc_steps", "steps_with_device_alloc",
                 "sync_steps", "other_threads", "memory_records", "malformed", "sites_dropped",
                 "ranks_records", "overhead_sum_ns", "data_wait_sum_ns", "loop_sum_ns",
                 "data_sum_ns", "data_steps", "energy_steps", "energy_uj", "energy_span_us",
                 "energy_samples", "energy_batched_uj", "compile_steps", "compiles", "compile_us",
                 "graph_breaks")

    def __init__(self, index: int = 0) -> None:
        self.index = index
        #: The writer's ``run_id`` (set by whoever groups the records; else the first record's).
        self.run_id: str | None = None
        self.steps = self.warmup = self.errors = self.measured = self.malformed = 0
        self.devices: dict[str, int] = {}
        self.names: dict[str, int] = {}
        #: The first step's name group; once a step of another name comes, ``by_name`` holds
        #: an aggregate of each name's steps (step records only), so that the report gives
        #: each name its own figures.  None while the run has one name.
        self.key: str | None = None
        self.by_name: dict[str, RunAggregate] | None = None
        self.last_key: str | None = None  # the latest step's name group (its peak record goes there)
        #: A peak record read before this stretch's first step: its step is in an earlier stretch.
        self.lead_peak: dict[str, Any] | None = None
        self.batch_sizes: dict[int, int] = {}
        self.first_step: int | None = None
        self.last_step = -1
        self.first_measured: int | None = None
        self.wall, self.gpu, self.span, self.busy = (QuantileSketch() for _ in range(4))
        self.sps, self.syncs, self.tflops, self.mfu, self.overhead = (QuantileSketch() for _ in range(5))
        self.data_wait = QuantileSketch()
        self.sketches = (self.wall, self.gpu, self.span, self.busy, self.sps, self.syncs,
                         self.tflops, self.mfu, self.overhead, self.data_wait)
        self.peak: float | None = None
        self.reserved: float | None = None
        self.reserved_last: float | None = None
        self.rss: float | None = None
        self.alloc = {"num_alloc_retries": 0, "num_sync_all_streams": 0, "num_device_alloc": 0,
                      "num_device_free": 0}
        self.alloc_steps = 0
        self.steps_with_device_alloc = 0
        self.sites: dict[tuple[str, str], list[Any]] = {}  # (where, kind) -> [count, code, steps]
        self.sites_dropped = 0
        self.sync_steps = 0
        self.sync_mechanism: str | None = None
        self.other_threads = 0
        self.phases: dict[str, PhaseAggregate] = {}
        # heap of (span, step, device allocs, retries, syncs, data wait ms); -1: not recorded
        self.spikes: list[tuple[float, int, int, int, int, float]] = []
        self.memory_first: dict[str, Any] | None = None
        self.memory_last: dict[str, Any] | None = None
        self.memory_records = 0
        self.flops: dict[str, Any] | None = None
        self.peak_record: dict[str, Any] | None = None  # the kind: "peak" record (explain_peak)
        self.flops_requested = False  # a step record carries tflops_per_s (null or not)
        self.flops_reason: str | None = None  # the latest step's reason for a null tflops_per_s
        self.mfu_reason: str | None = None  # the latest timed step's reason for a null mfu
        self.flops_counted_step: int | None = None
        self.summary: dict[str, Any] | None = None
        self.step_reasons: dict[str, str] = {}  # the first reason per field of the timed steps
        self.overhead_sum_ns = 0  # the timed steps' overhead_us, for the mean
        self.data_wait_sum_ns = 0  # the timed steps' data_wait_ms, and their data_wait_ms + wall_ms
        self.loop_sum_ns = 0
        self.data_sum_ns = self.data_steps = 0  # their data_ms (stepprof.iterate), and how many had it
        # Energy over the timed steps with energy_j, in integer units (sums alike however
        # a log is split): µJ, µs of their spans, and their batch sizes and µJ where given.
        self.energy_steps = self.energy_uj = self.energy_span_us = 0
        self.energy_samples = self.energy_batched_uj = 0
        self.energy_reason: str | None = None  # the latest timed step's reason for a null energy_j
        self.since_settle = 0
        # Distributed runs: this log's rank, and (rank 0's log) the ranks records.
        self.identity: dict[str, Any] | None = None
        self.ranks_records = 0
        self.ranks_named: dict[int, int] = {}
        self.ranks_last: dict[str, Any] | None = None
        self.ranks_last_named: dict[str, Any] | None = None
        # torch.compile: whether any step record carries the compile fields, the measured
        # steps that compiled, and over every step (warm-up included) the compiles, their
        # time (µs, an int: sums alike however a log is split), graph breaks and reasons.
        self.compile_seen = False
        self.compile_steps = 0
        self.compile_step_list: list[int] = []
        self.compiles = self.compile_us = self.graph_breaks = 0
        self.recompile_reasons: list[tuple[int, str]] = []

    # -- records in ---------------------------------------------------------------

    def add(self, record: dict[str, Any]) -> None:
        """Fold in one record of this run (as the writer writes it, or as read back)."""
        if self.run_id is None:
            rid = record.get("run_id")
            if type(rid) is str:
                self.run_id = rid
        kind = record.get("kind")
        if kind == "step":
            self.add_step(record)
        elif kind == "memory":
            self.add_memory(record)
        elif kind == "flops":
            self.flops = record
        elif kind == "peak":
            self.peak_record = record
            if self.key is None:
                self.lead_peak = record
            else:
                self._peak_to_group(record)
        elif kind == "ranks":
            self.add_ranks(record)
        elif kind == "summary":
            self.summary = record
            if self.identity is None:
                self.take_identity(record)

    def add_step(self, r: dict[str, Any]) -> None:
        """A ``kind: "step"`` record: counted, and its figures taken if it is a timed step."""
        # Numbers are taken as orjson gives them: int or float (JSON has no NaN or
        # infinity); anything else (a str, a bool, null) is treated as missing.
        get = r.get
        name = get("name")
        key = name if type(name) is str else NO_NAME
        if key != self.key or self.by_name is not None:
            self._by_name(key, r)  # before this step counts here: a copy of the run so far is a group
        self.last_key = key
        self.steps += 1
        idx = get("step")
        if type(idx) is int:
            if self.first_step is None:
                self.first_step = idx
            self.last_step = idx
        else:
            idx = -1
        if self.identity is None and "rank" in r:
            self.take_identity(r)
        device = get("device")
        if type(device) is str:
            table = self.devices
            if device in table:
                table[device] += 1
            else:
                _count(table, device)
        if type(name) is str:
            table = self.names
            if name in table:
                table[name] += 1
            else:
                _count(table, name)
        if "tflops_per_s" in r and (get("mfu") is None or not self.flops_requested):
            self._take_flops_state(r)  # only a step with a null mfu (or the first) has news
        if "compiles" in r:
            self._take_compiles(r, idx)
        why = left_out(r)  # the timed-step rule (stepprof._rules), which every view applies
        if why is WARMUP:
            self.warmup += 1
            return
        if why is ERROR:
            self.errors += 1
            return
        if why is MALFORMED:
            self.malformed += 1
            return
        self.measured += 1
        if self.first_measured is None and idx >= 0:
            self.first_measured = idx
        if why is COUNTED:
            self.flops_counted_step = idx if idx >= 0 else None
            return
        if why is COMPILED:
            self.compile_steps += 1
            if len(self.compile_step_list) < COMPILE_STEPS_NAMED:
                self.compile_step_list.append(idx)
            return
        if why is not None:  # explained
            return
        wall = r["wall_ms"]
        self.wall.buf.append(wall)
        gpu = get("gpu_ms")
        t = type(gpu)
        if t is float or t is int:
            self.gpu.buf.append(gpu)
        span = span_ms(wall, gpu)
        self.span.buf.append(span)
        x = get("gpu_busy")
        t = type(x)
        if t is float or t is int:
            self.busy.buf.append(x)
        batch = get("batch_size")
        if type(batch) is int:
            _count(self.batch_sizes, batch)
            x = get("samples_per_s")
            t = type(x)
            if t is float or t is int:
                self.sps.buf.append(x)
        x = get("data_wait_ms")
        t = type(x)
        if t is float or t is int:
            self.data_wait.buf.append(x)
            self.data_wait_sum_ns += round(x * 1e6)  # ints: sums alike however a log is split
            self.loop_sum_ns += round((x + wall) * 1e6)
            x = get("data_ms")
            t = type(x)
            if t is float or t is int:
                self.data_sum_ns += round(x * 1e6)
                self.data_steps += 1
        x = get("overhead_us")
        t = type(x)
        if t is float or t is int:
            self.overhead.buf.append(x)
            self.overhead_sum_ns += round(x * 1e3)  # an int: sums alike however a log is split
        self._add_memory_fields(r)
        allocs, retries = self._add_allocator(get("allocator"))
        syncs = get("syncs")
        if type(syncs) is dict:
            self._add_syncs(syncs)
        phases = get("phases")
        if phases and type(phases) is dict:
            # A phase's syncs count only in a step that counted its own (a log may hold 0s there).
            self._add_phases(phases, type(syncs) is dict and type(syncs.get("count")) is int)
        if "energy_j" in r:
            self._add_energy(r, batch)
        if "tflops_per_s" in r:
            x = get("tflops_per_s")
            t = type(x)
            if t is float or t is int:
                self.tflops.buf.append(x)
            x = get("mfu")
            t = type(x)
            if t is float or t is int:
                self.mfu.buf.append(x)
        spikes = self.spikes
        if len(spikes) < SPIKES_KEPT or span > spikes[0][0]:
            n_syncs = syncs.get("count") if type(syncs) is dict else None
            wait = get("data_wait_ms")
            spike = (span, idx, allocs, retries, n_syncs if type(n_syncs) is int else -1,
                     float(wait) if type(wait) is float or type(wait) is int else -1.0)
            if len(spikes) < SPIKES_KEPT:
                heapq.heappush(spikes, spike)
            else:
                heapq.heapreplace(spikes, spike)
        unavailable = get("unavailable")
        if unavailable and type(unavailable) is dict:
            self._take_reasons(unavailable)
        self.since_settle += 1
        if self.since_settle >= _SETTLE_EVERY:
            self.settle()

    def _by_name(self, key: str, r: dict[str, Any]) -> None:
        """A step record whose name differs from the first step's, or of a run already split."""
        if self.key is None:  # the run's first step
            self.key = key
            return
        if self.key == OTHER_NAMES:  # the group of the names past NAMES_SPLIT: not split again
            return
        groups = self.by_name
        if groups is None:  # the second name: the steps so far are all of the first one
            groups = self.by_name = {self.key: self._steps_copy()}
        if key not in groups and len(groups) >= NAMES_SPLIT:
            key = OTHER_NAMES
        group = groups.get(key)
        if group is None:
            group = groups[key] = RunAggregate(self.index)
            group.key = key
            group.run_id = self.run_id
        group.add_step(r)

    def _steps_copy(self) -> RunAggregate:
        """A copy of this run as one name group: its step figures, without the run's other records."""
        state = self.__getstate__()
        state.update(by_name=None, lead_peak=None, memory_first=None, memory_last=None, memory_records=0, flops=None,
                     summary=None, ranks_records=0, ranks_named={}, ranks_last=None, ranks_last_named=None)
        group = RunAggregate.__new__(RunAggregate)
        if self.lead_peak is not None and self.peak_record is self.lead_peak:
            state["peak_record"] = None  # an earlier stretch's step's
        group.__setstate__(copy.deepcopy(state))
        return group

    def _peak_to_group(self, record: dict[str, Any]) -> None:
        """A peak record follows its step's record: it goes to that step's name group too."""
        if self.by_name is not None:
            group = self.by_name.get(self.last_key) if self.last_key is not None else None
            group = group if group is not None else self.by_name.get(OTHER_NAMES)
            if group is not None:
                group.peak_record = record

    def name_groups(self) -> dict[str, RunAggregate]:
        """Each step name's aggregate, when the run's steps have several names; else empty."""
        return dict(self.by_name) if self.by_name is not None else {}

    def _take_compiles(self, r: dict[str, Any], idx: int) -> None:
        """A step record with the compile fields (warm-up or not): the run's compile totals."""
        self.compile_seen = True
        get = r.get
        x = get("compiles")
        if type(x) is int and x > 0:
            self.compiles += x
        x = get("compile_ms")
        if (type(x) is float or type(x) is int) and x > 0:
            self.compile_us += round(x * 1e3)
        x = get("graph_breaks")
        if type(x) is int and x > 0:
            self.graph_breaks += x
        reasons = get("recompile_reasons")
        if reasons and type(reasons) is list:
            kept = self.recompile_reasons
            for why in reasons:
                if len(kept) >= COMPILE_REASONS_KEPT:
                    break
                if type(why) is str:
                    kept.append((idx, why[:500]))

    def _take_flops_state(self, r: dict[str, Any]) -> None:
        """A step of a run that asked for FLOPs: keep the latest reasons for null ones."""
        self.flops_requested = True
        unavailable = r.get("unavailable")
        if type(unavailable) is dict:
            why = unavailable.get("tflops_per_s")
            if type(why) is str and r.get("tflops_per_s") is None:
                self.flops_reason = why
            why = unavailable.get("mfu")
            if type(why) is str and r.get("mfu") is None and r.get("tflops_per_s") is not None:
                self.mfu_reason = why

    def _add_energy(self, r: dict[str, Any], batch: Any) -> None:
        x, span = r.get("energy_j"), r.get("energy_span_ms")
        tx, ts = type(x), type(span)
        if (tx is float or tx is int) and (ts is float or ts is int) and x >= 0 and span > 0:
            uj = round(x * 1e6)
            self.energy_steps += 1
            self.energy_uj += uj
            self.energy_span_us += round(span * 1e3)
            if type(batch) is int and batch > 0:
                self.energy_samples += batch
                self.energy_batched_uj += uj
            return
        reasons = r.get("unavailable")
        why = reasons.get("energy_j") if type(reasons) is dict else None
        if type(why) is str:
            self.energy_reason = why

    def _add_memory_fields(self, r: dict[str, Any]) -> None:
        x = r.get("peak_allocated_bytes")
        t = type(x)
        if (t is int or t is float) and (self.peak is None or x > self.peak):
            self.peak = x
        x = r.get("reserved_bytes")
        t = type(x)
        if t is int or t is float:
            self.reserved_last = x
            if self.reserved is None or x > self.reserved:
                self.reserved = x
        x = r.get("host_rss_bytes")
        if type(x) is int:
            self.rss = x

    def _add_allocator(self, alloc: Any) -> tuple[int, int]:
        """Sum a step's allocator counters; return its device allocations and retries."""
        if type(alloc) is not dict:
            return 0, 0
        self.alloc_steps += 1
        totals = self.alloc
        for key, n in alloc.items():
            if type(n) is int and key in totals:
                totals[key] += n
        allocs = alloc.get("num_device_alloc")
        retries = alloc.get("num_alloc_retries")
        if type(allocs) is not int:
            allocs = 0
        elif allocs > 0:
            self.steps_with_device_alloc += 1
        if type(retries) is not int:
            retries = 0
        return allocs, retries

    def _take_reasons(self, unavailable: dict[str, Any]) -> None:
        reasons = self.step_reasons
        if len(reasons) >= TABLE_CAP or unavailable.keys() <= reasons.keys():
            return  # (the common case: every step repeats the same reasons)
        for key, why in unavailable.items():
            if key not in reasons and type(why) is str:
                reasons[key] = why

    def _add_syncs(self, syncs: dict[str, Any]) -> None:
        count = syncs.get("count")
        if type(count) is not int:
            return
        self.sync_steps += 1
        self.syncs.buf.append(count)
        mechanism = syncs.get("mechanism")
        if type(mechanism) is str:
            self.sync_mechanism = mechanism
        other = syncs.get("other_threads")
        if other and type(other) is int:
            self.other_threads += other
        sites = syncs.get("sites")
        if not sites or type(sites) is not list:
            return
        table = self.sites
        for site in sites:
            if type(site) is not dict:
                continue
            n = site.get("count")
            if type(n) is not int:
                continue
            key = (site.get("where"), site.get("kind"))
            entry = table.get(key) if type(key[0]) is str and type(key[1]) is str else None
            if entry is None:
                key = (str(key[0]), str(key[1]))
                entry = table.get(key)
            if entry is None:
                if len(table) >= TABLE_CAP:
                    self.sites_dropped += n
                    continue
                code = site.get("code")
                entry = table[key] = [0, code if type(code) is str else None, 0]
            entry[0] += n
            entry[2] += 1

    def _add_phases(self, phases: dict[str, Any], syncs_counted: bool) -> None:
        table = self.phases
        for name, ph in phases.items():
            agg = table.get(name)
            if agg is None:
                if len(table) >= TABLE_CAP:
                    continue
                agg = table[name] = PhaseAggregate()
            if type(ph) is not dict:
                continue
            agg.steps += 1
            get = ph.get
            x = get("wall_ms")
            t = type(x)
            if t is float or t is int:
                agg.wall.buf.append(x)
            x = get("gpu_ms")
            t = type(x)
            if t is float or t is int:
                agg.gpu.buf.append(x)
            x = get("peak_allocated_bytes")
            t = type(x)
            if (t is int or t is float) and (agg.peak is None or x > agg.peak):
                agg.peak = x
            x = get("syncs")
            if type(x) is int and syncs_counted:
                agg.syncs += x
                agg.sync_steps += 1
            x = get("count")
            agg.count += x if type(x) is int else 1

    def take_identity(self, r: dict[str, Any]) -> None:
        """The run's rank, local rank and world size, from the first record that names a rank."""
        if type(r.get("rank")) is int:
            self.identity = {
                k: r.get(k) if type(r.get(k)) is int else None for k in ("rank", "local_rank", "world_size")
            }

    def add_ranks(self, r: dict[str, Any]) -> None:
        """A ``kind: "ranks"`` record (rank 0's log): count who was named, keep the latest."""
        self.ranks_records += 1
        who = r.get("straggler_rank")
        if type(who) is int:
            self.ranks_named[who] = self.ranks_named.get(who, 0) + 1
            self.ranks_last_named = r
        self.ranks_last = r

    def add_memory(self, r: dict[str, Any]) -> None:
        """A ``kind: "memory"`` record: the first steady one and the last one are kept."""
        self.memory_records += 1
        if self.memory_first is None and r.get("trigger") in ("after_warmup", "periodic"):
            self.memory_first = r
        self.memory_last = r

    def settle(self) -> None:
        """Fold the sketches' buffers (done every few thousand steps, and before reading)."""
        self.since_settle = 0
        for sketch in self.sketches:
            sketch.settle()
        for ph in self.phases.values():
            ph.wall.settle()
            ph.gpu.settle()

    def merge(self, later: RunAggregate) -> None:
        """Fold in ``later``: the same run, continued in a later stretch of the log."""
        split = self.by_name is not None or later.by_name is not None or (
            self.key is not None and later.key is not None and self.key != later.key
        )
        if split:
            groups = self._groups()
            for key, group in later._groups().items():
                if key in groups:
                    groups[key].merge(group)
                elif len(groups) < NAMES_SPLIT:
                    groups[key] = group
                elif OTHER_NAMES in groups:
                    groups[OTHER_NAMES].merge(group)
                else:
                    group.key = OTHER_NAMES
                    groups[OTHER_NAMES] = group
        lead = later.lead_peak  # its step is self's last (none: an earlier stretch's)
        if self.key is None:
            self.lead_peak = self.lead_peak or lead
        elif lead is not None and split:
            self.by_name = groups
            self._peak_to_group(lead)
        self.key = self.key if self.key is not None else later.key
        self.last_key = later.last_key if later.last_key is not None else self.last_key
        for name in self._COUNTERS:
            setattr(self, name, getattr(self, name) + getattr(later, name))
        _add_counts(self.devices, later.devices)
        _add_counts(self.names, later.names)
        _add_counts(self.batch_sizes, later.batch_sizes)
        if later.steps:
            if self.first_step is None:
                self.first_step = later.first_step
            self.last_step = later.last_step
        if self.first_measured is None:
            self.first_measured = later.first_measured
        for mine, theirs in zip(self.sketches, later.sketches, strict=True):
            mine.merge(theirs)
        self.peak = _larger(self.peak, later.peak)
        self.reserved = _larger(self.reserved, later.reserved)
        if later.reserved_last is not None:
            self.reserved_last = later.reserved_last
        if later.rss is not None:
            self.rss = later.rss
        for key, n in later.alloc.items():
            self.alloc[key] += n
        for key, (n, code, steps) in later.sites.items():
            entry = self.sites.get(key)
            if entry is None:
                if len(self.sites) >= TABLE_CAP:
                    self.sites_dropped += n
                    continue
                entry = self.sites[key] = [0, code, 0]
            entry[0] += n
            entry[2] += steps
            if entry[1] is None:
                entry[1] = code
        if later.sync_mechanism is not None:
            self.sync_mechanism = later.sync_mechanism
        for name, ph in later.phases.items():
            mine = self.phases.get(name)
            if mine is None:
                if len(self.phases) < TABLE_CAP:
                    self.phases[name] = ph
                continue
            mine.merge(ph)
        self.spikes = heapq.nlargest(SPIKES_KEPT, self.spikes + later.spikes)
        heapq.heapify(self.spikes)
        if self.memory_first is None:
            self.memory_first = later.memory_first
        if later.memory_last is not None:
            self.memory_last = later.memory_last
        for name in ("flops", "peak_record", "flops_counted_step", "summary", "flops_reason", "mfu_reason", "energy_reason"):
            if getattr(later, name) is not None:
                setattr(self, name, getattr(later, name))
        self.flops_requested = self.flops_requested or later.flops_requested
        self.compile_seen = self.compile_seen or later.compile_seen
        self.compile_step_list = (self.compile_step_list + later.compile_step_list)[:COMPILE_STEPS_NAMED]
        self.recompile_reasons = (self.recompile_reasons + later.recompile_reasons)[:COMPILE_REASONS_KEPT]
        if self.identity is None:
            self.identity = later.identity
        if self.run_id is None:
            self.run_id = later.run_id
        _add_counts(self.ranks_named, later.ranks_named)
        self.ranks_last = later.ranks_last or self.ranks_last
        self.ranks_last_named = later.ranks_last_named or self.ranks_last_named
        for key, why in later.step_reasons.items():
            if key not in self.step_reasons and len(self.step_reasons) < TABLE_CAP:
                self.step_reasons[key] = why
        if split:
            self.by_name = groups

    def _groups(self) -> dict[str, RunAggregate]:
        """The run's name groups (itself copied as one group while it has one name)."""
        if self.by_name is not None:
            return self.by_name
        return {self.key: self._steps_copy()} if self.key is not None else {}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["sketches"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.sketches = (self.wall, self.gpu, self.span, self.busy, self.sps, self.syncs,
                         self.tflops, self.mfu, self.overhead, self.data_wait)

    # -- figures out --------------------------------------------------------------

    @property
    def timed_steps(self) -> int:
        """Measured steps whose times count (all but the FLOPs-counted one and those that compiled)."""
        return self.wall.count

    @property
    def approximate(self) -> bool:
        """True when a figure's quantiles come from the compacted sketch (over ``EXACT`` steps)."""
        return not all(sketch.exact for sketch in self.sketches)

    def figures(self) -> RunFigures:
        """The per-step figures (settles the sketches)."""
        self.settle()
        return RunFigures(
            wall_ms=_percentiles(self.wall),
            gpu_ms=_percentiles(self.gpu),
            step_ms=_percentiles(self.span),
            samples_per_s=_percentiles(self.sps),
            gpu_busy_median=self.busy.quantile(0.5),
            syncs_per_step=_percentiles(self.syncs),
            overhead_us_median=self.overhead.quantile(0.5),
            overhead_us_mean=self.overhead_sum_ns / self.overhead.count / 1e3 if self.overhead.count else None,
            data_wait_ms=_percentiles(self.data_wait),
            input_wait_fraction=self.data_wait_sum_ns / self.loop_sum_ns if self.loop_sum_ns > 0 else None,
            data_ms_mean=self.data_sum_ns / self.data_steps / 1e6 if self.data_steps else None,
            tflops_per_s_median=self.tflops.quantile(0.5),
            mfu_median=self.mfu.quantile(0.5),
            energy_j_per_step=self.energy_uj / self.energy_steps / 1e6 if self.energy_steps else None,
            power_w_mean=self.energy_uj / self.energy_span_us if self.energy_span_us else None,
            samples_per_j=(self.energy_samples / (self.energy_batched_uj / 1e6)
                           if self.energy_batched_uj else None),
        )

    @property
    def device(self) -> str | None:
        """The device most steps ran on."""
        return max(self.devices, key=lambda k: self.devices[k]) if self.devices else None

    def unavailable(self) -> dict[str, str]:
        """Why each missing figure is missing, keyed by :class:`stepprof.Summary`'s field names.

        Also ``step_ms`` (the report's), ``sync_mechanism`` when no step counted syncs, and
        ``phases.gpu_ms``, ``phases.peak_allocated_bytes_max`` and ``phases.syncs_per_step``
        when that figure is None for at least one phase.
        """
        figures = self.figures()
        present = {
            "wall_ms": figures.wall_ms, "gpu_ms": figures.gpu_ms, "step_ms": figures.step_ms,
            "gpu_busy_median": figures.gpu_busy_median,
            "peak_allocated_bytes_max": self.peak,
            "samples_per_s_median": figures.samples_per_s,
            "overhead_us_median": figures.overhead_us_median,
            "overhead_us_mean": figures.overhead_us_mean,
            "data_wait_ms_median": figures.data_wait_ms,
            "input_wait_fraction": figures.input_wait_fraction,
            "syncs_per_step_median": figures.syncs_per_step,
        }
        why: dict[str, str] = {}
        if self.timed_steps == 0:
            none = (NO_MEASURED_STEPS if self.measured == 0
                    else ONLY_COMPILE_STEPS if self.compile_steps else ONLY_THE_COUNTED_STEP)
            why.update((name, none) for name, value in present.items() if value is None)
        else:
            for name, (field, fallback) in _STEP_REASONS.items():
                if present[name] is None:
                    why[name] = self.step_reasons.get(field) or (
                        why.get("gpu_ms", fallback) if name == "gpu_busy_median" else fallback
                    )
        if figures.syncs_per_step is None:
            why["sync_mechanism"] = why["syncs_per_step_median"]
        if figures.tflops_per_s_median is None:
            why["tflops_per_s_median"] = self._flops_unavailable()
        if figures.mfu_median is None:
            why["mfu_median"] = (
                why["tflops_per_s_median"]
                if figures.tflops_per_s_median is None
                else self.mfu_reason or self._flops_record_reason("ideal_ms") or "not computed"
            )
        if figures.energy_j_per_step is None:
            why["energy_j_per_step"] = why["power_w_mean"] = why["samples_per_j"] = (
                (NO_MEASURED_STEPS if self.measured == 0 else ONLY_THE_COUNTED_STEP) if self.timed_steps == 0
                else self.energy_reason or NO_ENERGY
            )
        elif figures.samples_per_j is None:
            why["samples_per_j"] = "no batch_size was given"
        for field, (key, step_key) in _PHASE_REASONS.items():
            if any(getattr(ph, field) is None for ph in self._phase_figures().values()):
                why[key] = self.step_reasons.get(step_key) or "not recorded"
        return why

    def phase_figures(self) -> dict[str, PhaseFigures]:
        """Each phase's figures over the timed steps, by name, in the order first seen (settles)."""
        self.settle()
        return self._phase_figures()

    def _phase_figures(self) -> dict[str, PhaseFigures]:
        return {name: ph.figures() for name, ph in self.phases.items()}

    def _flops_unavailable(self) -> str:
        if not self.flops_requested:
            return NOT_REQUESTED_FLOPS
        if self.flops is not None:
            if finite_number(self.flops.get("flops_per_step")) is not None:
                return NO_STEP_AFTER_THE_COUNT
            return self._flops_record_reason("flops_per_step") or self.flops_reason or "not counted"
        return self.flops_reason or "not counted"

    def _flops_record_reason(self, field: str) -> str | None:
        reasons = (self.flops or {}).get("unavailable")
        why = reasons.get(field) if type(reasons) is dict else None
        return why if type(why) is str else None

    def summary_fields(self, extra_unavailable: dict[str, str] | None = None) -> dict[str, Any]:
        """The constructor arguments of :class:`stepprof.Summary`, all but ``log``.

        Args:
            extra_unavailable: reasons only the profiler knows (``stepprof`` when recording
                broke, ``log`` when the writer failed); they are added last and win.
        """
        figures = self.figures()
        unavailable = self.unavailable()
        unavailable.pop("step_ms", None)
        if extra_unavailable:
            unavailable.update(extra_unavailable)
        syncs = figures.syncs_per_step
        outside, why = self.syncs_outside_steps()
        if why is not None:
            unavailable["syncs_outside_steps"] = why
        return {
            "steps": self.steps,
            "warmup_steps": self.warmup,
            "error_steps": self.errors,
            "measured_steps": self.measured,
            "device": self.device or "none",
            "wall_ms": figures.wall_ms,
            "gpu_ms": figures.gpu_ms,
            "gpu_busy_median": figures.gpu_busy_median,
            "peak_allocated_bytes_max": self.peak,
            "samples_per_s_median": None if figures.samples_per_s is None else figures.samples_per_s.median,
            "overhead_us_median": figures.overhead_us_median,
            "overhead_us_mean": figures.overhead_us_mean,
            "data_wait_ms_median": None if figures.data_wait_ms is None else figures.data_wait_ms.median,
            "input_wait_fraction": figures.input_wait_fraction,
            "gpu_steps": self.gpu.count,
            "boundary": self.boundary(),
            "syncs_per_step_median": None if syncs is None else syncs.median,
            "sync_mechanism": self.sync_mechanism if syncs is not None else None,
            "syncs_outside_steps": outside,
            "tflops_per_s_median": figures.tflops_per_s_median,
            "mfu_median": figures.mfu_median,
            "energy_j_per_step": figures.energy_j_per_step,
            "power_w_mean": figures.power_w_mean,
            "samples_per_j": figures.samples_per_j,
            "unavailable": unavailable,
            "phases": self._phase_figures(),
            "ended_by": self._ended_by(),
            "run_id": self.run_id,
            "compile_steps": self.compile_steps if self.compile_seen else None,
        }

    def boundary(self) -> str | None:
        """The run's summary's ``boundary`` (untrusted: one of the known names, else None)."""
        b = self.summary.get("boundary") if self.summary is not None else None
        return b if b in ("compiled", "python") else None

    def syncs_outside_steps(self) -> tuple[int | None, str | None]:
        """The run's summary's ``syncs_outside_steps`` (only the profiler counts them), or
        (None, why)."""
        s = self.summary
        if s is None:
            return None, NO_SUMMARY
        n = s.get("syncs_outside_steps")
        if type(n) is int and n >= 0:
            return n, None
        reasons = s.get("unavailable")
        why = reasons.get("syncs_outside_steps") if type(reasons) is dict else None
        if type(why) is str:
            return None, why
        return None, "not in this log's summary (written by an older stepprof)"

    def _ended_by(self) -> str | None:
        """The run's summary's ``ended_by`` (untrusted: a str of a sane length, else None)."""
        ended = self.summary.get("ended_by") if self.summary is not None else None
        return ended if type(ended) is str and len(ended) <= 40 else None
