"""The one aggregate of a run's records: every figure the summary and the report show.

:class:`RunAggregate` takes the record dicts of one run (``step``, ``memory``, ``flops``,
``peak``, ``ranks``, ``summary``), straight from the log writer or from a log read back,
and keeps them in bounded memory, in small accumulators (:mod:`stepprof._accumulators`):
the step records' in :class:`StepTotals` (a sketch per per-step figure, capped tables of
sync sites, phases and batch sizes, a heap of the slowest steps), the others' in
:class:`RunRecords`; a run whose steps have several names keeps a :class:`StepTotals` per
name too.  ``Profiler.close()`` and ``stepprof report`` both read the figures from here
(:meth:`RunAggregate.summary_fields`, :meth:`~RunAggregate.figures`,
:meth:`~RunAggregate.unavailable`), so that they agree to the last digit.

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

:meth:`StepTotals.add` is the report's hot loop (a million records a log; see
bench/report.py) and the collector thread's: numbers are tested with ``type``, and
sketched values appended to the sketch's buffer.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from operator import attrgetter
from typing import Any

import attrs

from . import _native
from ._accumulators import (TABLE_CAP, Counter, Fields, First, FirstByKey, FirstN, Largest, Last, Max,
                            Sketch, Sum, Table)
from ._records import Percentiles, PhaseFigures
from ._rules import COMPILED, COUNTED, ERROR, MALFORMED, WARMUP, left_out, span_ms

__all__ = ["NOT_REQUESTED_FLOPS", "NO_MEASURED_STEPS", "NO_STEP_AFTER_THE_COUNT", "RunAggregate", "RunFigures",
           "finite_number"]

#: Step names given their own figures per run; the steps of further names are grouped together.
NAMES_SPLIT = 16
#: The group of the steps without a name, and of the names past :data:`NAMES_SPLIT`.
NO_NAME, OTHER_NAMES = "(no name)", "(other names)"
#: Slowest steps kept per run (for the spikes diagnosis).
SPIKES_KEPT = 32
#: Steps between two folds of the sketches' buffers.
_SETTLE_EVERY = 4096
#: Recompile reasons kept per run (with their steps), and measured compile steps named.
COMPILE_REASONS_KEPT = 10
COMPILE_STEPS_NAMED = 32
#: The allocator counters a step record carries, summed over the timed steps.
ALLOCATOR_COUNTS = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free")

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
    "tokens_per_s_median": ("tokens_per_s", "no step counted tokens: pass tokens=N, or a batch with input_ids"),
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
    #: Host time before each step since the previous one's exit (input, logging, anything),
    #: and inside it between micro-batches.
    data_wait_ms: Percentiles | None
    #: The share of the loop's time (data wait + wall, less the waits inside steps) spent in the data wait.
    input_wait_fraction: float | None
    #: Mean time in the loader's ``__next__`` (``data_ms``, with ``stepprof.iterate``).
    data_ms_mean: float | None
    tflops_per_s_median: float | None
    mfu_median: float | None
    mfu_datasheet_median: float | None
    #: The median of ``tokens_per_s`` (the steps whose tokens were given or counted).
    tokens_per_s_median: float | None = None
    energy_j_per_step: float | None = None
    power_w_mean: float | None = None
    samples_per_j: float | None = None
    #: The mean of ``data_wait_ms`` (one-off stalls weigh in it; the median shows the steady state).
    data_wait_ms_mean: float | None = None
    #: The median of ``data_wait_in_step_ms``: the part of ``data_wait_ms`` inside the step
    #: (between micro-batches), which ``wall_ms`` holds too; None when no step recorded one.
    data_wait_in_step_ms_median: float | None = None


def _percentiles(sketch: Sketch) -> Percentiles | None:
    d = sketch.percentiles()
    return None if d is None else Percentiles(**d)


class SyncSites:
    """The sync sites of the timed steps: (where, kind) -> [count, code, steps with it].

    A capped table: the count of a site past :data:`TABLE_CAP` goes to ``dropped``.
    """

    __slots__ = ("value", "dropped")

    def __init__(self) -> None:
        self.value: dict[tuple[str, str], list[Any]] = {}
        self.dropped = 0

    def add(self, sites: list[Any]) -> None:
        """One step's ``syncs.sites``."""
        table = self.value
        for site in sites:
            if type(site) is not dict:
                continue
            n = site.get("count")
            if type(n) is not int:
                continue
            key: tuple[Any, Any] = (site.get("where"), site.get("kind"))
            entry = table.get(key) if type(key[0]) is str and type(key[1]) is str else None
            if entry is None:
                key = (str(key[0]), str(key[1]))
                entry = table.get(key)
            if entry is None:
                code = site.get("code")
                entry = self._entry(key, code if type(code) is str else None, n)
            if entry is not None:
                entry[0] += n
                entry[2] += 1

    def _entry(self, key: tuple[str, str], code: str | None, n: int) -> list[Any] | None:
        """A new site's entry, or None (its ``n`` dropped) when the table is full."""
        if len(self.value) >= TABLE_CAP:
            self.dropped += n
            return None
        entry = self.value[key] = [0, code, 0]
        return entry

    def merge(self, other: SyncSites) -> None:
        self.dropped += other.dropped
        for key, (n, code, steps) in other.value.items():
            entry = self.value.get(key) or self._entry(key, code, n)
            if entry is not None:
                entry[0] += n
                entry[2] += steps
                if entry[1] is None:
                    entry[1] = code


class PhaseTotals(Fields):
    """One phase name's accumulators over a run's timed steps."""

    FIELDS = (("wall", Sketch), ("gpu", Sketch), ("peak", Max),
              ("syncs", Sum), ("sync_steps", Sum),  # its syncs, and the steps that counted them
              ("count", Sum), ("steps", Sum))  # how many times it ran, and in how many steps
    __slots__ = tuple(name for name, _ in FIELDS)
    wall: Sketch
    gpu: Sketch
    peak: Max
    syncs: Sum
    sync_steps: Sum
    count: Sum
    steps: Sum

    def add(self, ph: dict[str, Any], syncs_counted: bool) -> None:
        """The phase's entry in a timed step's ``phases``; its syncs count if the step counted its own."""
        self.steps.value += 1
        get: Callable[[str], Any] = ph.get
        x = get("wall_ms")
        t = type(x)
        if t is float or t is int:
            self.wall.buf.append(x)
        x = get("gpu_ms")
        t = type(x)
        if t is float or t is int:
            self.gpu.buf.append(x)
        x = get("peak_allocated_bytes")
        t = type(x)
        if (t is int or t is float) and (self.peak.value is None or x > self.peak.value):
            self.peak.value = x
        x = get("syncs")
        if type(x) is int and syncs_counted:
            self.syncs.value += x
            self.sync_steps.value += 1
        x = get("count")
        self.count.value += x if type(x) is int else 1

    def figures(self) -> PhaseFigures:
        """Its figures (the sketches settled)."""
        steps, sync_steps = self.steps.value, self.sync_steps.value
        return PhaseFigures(
            steps=steps,
            runs_per_step=self.count.value / steps if steps else None,
            wall_ms_median=self.wall.quantile(0.5),
            wall_ms_p90=self.wall.quantile(0.9),
            gpu_ms_median=self.gpu.quantile(0.5),
            gpu_ms_p90=self.gpu.quantile(0.9),
            peak_allocated_bytes_max=self.peak.value,
            syncs_per_step=self.syncs.value / sync_steps if sync_steps else None,
        )


#: The sketches of :class:`StepTotals`, one per per-step figure of the timed steps.
_SKETCHES = ("wall", "gpu", "span", "busy", "sps", "tps", "syncs", "tflops", "mfu", "mfu_datasheet", "overhead",
             "data_wait", "wait_in")

#: A timed step's numeric fields that go into a sketch as they are: (field, sketch's buffer).
_SKETCHED = tuple((field, attrgetter(f"{name}.buf")) for field, name in (
    ("gpu_ms", "gpu"), ("gpu_busy", "busy"), ("overhead_us", "overhead")))
#: The same, for a step of a run that asked for FLOPs (one with ``tflops_per_s``, null or not).
_SKETCHED_FLOPS = tuple((field, attrgetter(f"{name}.buf")) for field, name in (
    ("tflops_per_s", "tflops"), ("mfu", "mfu"), ("mfu_datasheet", "mfu_datasheet")))

#: What a step left out of the figures counts in, when it is not measured either.
_NOT_MEASURED = {WARMUP: "warmup", ERROR: "errors", MALFORMED: "malformed"}


class _StepAccumulators(Fields):
    """The type of each accumulator that :attr:`StepTotals.FIELDS` declares (for a type checker)."""

    __slots__ = ()
    steps: Sum
    warmup: Sum
    errors: Sum
    malformed: Sum
    measured: Sum
    first_step: First
    last_step: Last
    first_measured: First
    devices: Counter
    names: Counter
    wall: Sketch
    gpu: Sketch
    span: Sketch
    busy: Sketch
    sps: Sketch
    tps: Sketch
    syncs: Sketch
    tflops: Sketch
    mfu: Sketch
    mfu_datasheet: Sketch
    overhead: Sketch
    data_wait: Sketch
    wait_in: Sketch
    overhead_sum_ns: Sum
    data_wait_sum_ns: Sum
    loop_sum_ns: Sum
    data_sum_ns: Sum
    data_steps: Sum
    batch_sizes: Counter
    peak: Max
    reserved: Max
    reserved_last: Last
    rss: Last
    alloc: Counter
    alloc_steps: Sum
    steps_with_device_alloc: Sum
    sync_steps: Sum
    sync_mechanism: Last
    other_threads: Sum
    sites: SyncSites
    phases: Table
    spikes: Largest
    step_reasons: FirstByKey
    flops_requested: Max
    flops_reason: Last
    mfu_reason: Last
    mfu_datasheet_reason: Last
    flops_counted_step: Last
    peak_record: Last
    energy_steps: Sum
    energy_uj: Sum
    energy_span_us: Sum
    energy_samples: Sum
    energy_batched_uj: Sum
    energy_reason: Last
    compile_seen: Max
    compile_steps: Sum
    compile_step_list: FirstN
    compiles: Sum
    compile_us: Sum
    graph_breaks: Sum
    recompile_reasons: FirstN


class _Fold:
    """The C fold's ``fold_step`` while it is loaded (:func:`use_native`), else None."""

    step: Callable[[StepTotals, dict[str, Any]], Any] | None = None


_FOLD = _Fold()


def use_native(on: bool = True) -> str | None:
    """Fold step records in C from now on, if ``_fold.c`` is built (``on=False``: in Python);
    returns why not, or None."""
    mod = _native.module() if on else None
    if mod is not None:
        mod.configure(SPIKES_KEPT, _SETTLE_EVERY, TABLE_CAP, StepTotals, PhaseTotals, Sum, Max, First, Last,
                      Counter, Table, Sketch, FirstByKey, Largest)
    _FOLD.step = mod.fold_step if mod is not None else None
    return None if mod is not None or not on else _native.reason()


def _loop_ms(wait_in: Sketch, wait: float, wall: float, inside: Any) -> float:
    """A step's time in the loop: the wait before it, then its wall time.  A wait inside it
    (``data_wait_in_step_ms``, between micro-batches) is in both figures: counted once, and
    sketched."""
    if type(inside) is float or type(inside) is int:
        wait_in.buf.append(inside)
        return wait + wall - inside
    return wait + wall


class StepTotals(_StepAccumulators):
    """The accumulators of a run's step records (or of one step name's), one per figure.

    Integer sums (ns, µs, µJ) are the same however a log is split.
    """

    FIELDS = (
        # every step: how many, what became of them (stepprof._rules.left_out), their indices
        ("steps", Sum), ("warmup", Sum), ("errors", Sum), ("malformed", Sum), ("measured", Sum),
        ("first_step", First), ("last_step", Last), ("first_measured", First),
        ("devices", Counter), ("names", Counter),
        # the timed steps' figures
        *((name, Sketch) for name in _SKETCHES),
        # sums in ns: of overhead_us (for the mean), and of data_wait_ms, it + wall_ms, data_ms
        ("overhead_sum_ns", Sum), ("data_wait_sum_ns", Sum), ("loop_sum_ns", Sum), ("data_sum_ns", Sum),
        ("data_steps", Sum),  # the steps with data_ms (and data_wait_ms)
        ("batch_sizes", Counter),
        ("peak", Max), ("reserved", Max), ("reserved_last", Last), ("rss", Last),
        ("alloc", lambda: Counter(ALLOCATOR_COUNTS)), ("alloc_steps", Sum), ("steps_with_device_alloc", Sum),
        ("sync_steps", Sum), ("sync_mechanism", Last), ("other_threads", Sum), ("sites", SyncSites),
        ("phases", lambda: Table(PhaseTotals)),
        # heap of (span, step, device allocs, retries, syncs, data wait ms); -1: not recorded
        ("spikes", lambda: Largest(SPIKES_KEPT)),
        ("step_reasons", FirstByKey),  # the first reason per field of the timed steps
        # FLOPs: whether a step carries tflops_per_s (null or not), the latest reasons for null ones
        ("flops_requested", lambda: Max(False)), ("flops_reason", Last), ("mfu_reason", Last),
        ("mfu_datasheet_reason", Last),
        ("flops_counted_step", Last),
        ("peak_record", Last),  # the latest kind: "peak" record (explain_peak) after one of these steps
        # energy over the timed steps with energy_j: µJ, µs of their spans, their batch sizes and µJ
        ("energy_steps", Sum), ("energy_uj", Sum), ("energy_span_us", Sum), ("energy_samples", Sum),
        ("energy_batched_uj", Sum), ("energy_reason", Last),
        # torch.compile: whether a step carries its fields; the measured steps that compiled; over
        # every step (warm-up too) the compiles, their µs, graph breaks and reasons
        ("compile_seen", lambda: Max(False)), ("compile_steps", Sum),
        ("compile_step_list", lambda: FirstN(COMPILE_STEPS_NAMED)),
        ("compiles", Sum), ("compile_us", Sum), ("graph_breaks", Sum),
        ("recompile_reasons", lambda: FirstN(COMPILE_REASONS_KEPT)),
    )
    __slots__ = (*(name for name, _ in FIELDS), "since_settle")

    def __init__(self) -> None:
        super().__init__()
        self.since_settle = 0

    @property
    def sketches(self) -> tuple[Sketch, ...]:
        return tuple(getattr(self, name) for name in _SKETCHES)

    def add(self, r: dict[str, Any]) -> bool:
        """A ``kind: "step"`` record: counted, and its figures taken if it is a timed step
        (then True).  In C when the fold is built (:mod:`stepprof._native`), else :meth:`fold`."""
        fold = _FOLD.step
        if fold is not None:
            timed = fold(self, r)
            if timed is not NotImplemented:
                return timed  # type: ignore[no-any-return]
        return self.fold(r)

    def fold(self, r: dict[str, Any]) -> bool:
        """:meth:`add` in Python (``_fold.c`` mirrors it, and leaves it the rarer records)."""
        # Numbers are taken as orjson gives them: int or float (JSON has no NaN or
        # infinity); anything else (a str, a bool, null) is treated as missing.
        get = r.get
        self.steps.value += 1
        idx = get("step")
        if type(idx) is int:
            if self.first_step.value is None:
                self.first_step.value = idx
            self.last_step.value = idx
        else:
            idx = -1
        x = get("device")
        if type(x) is str:
            table = self.devices.value
            if x in table:
                table[x] += 1
            else:
                self.devices.add(x)
        x = get("name")
        if type(x) is str:
            table = self.names.value
            if x in table:
                table[x] += 1
            else:
                self.names.add(x)
        if "tflops_per_s" in r and (get("mfu") is None or get("mfu_datasheet") is None
                                    or not self.flops_requested.value):
            self._take_flops_state(r)  # only a step with a null MFU (or the first) has news
        if "compiles" in r:
            self._take_compiles(r, idx)
        why = left_out(r)  # the timed-step rule (stepprof._rules), which every view applies
        if why is not None and why in _NOT_MEASURED:
            getattr(self, _NOT_MEASURED[why]).value += 1
            return False
        self.measured.value += 1
        if idx >= 0 and self.first_measured.value is None:
            self.first_measured.value = idx
        if why is None:
            self._add_timed(r, idx)
            return True
        if why is COUNTED:
            self.flops_counted_step.add(idx if idx >= 0 else None)
        elif why is COMPILED:
            self.compile_steps.add()
            self.compile_step_list.add(idx)
        return False

    def _add_timed(self, r: dict[str, Any], idx: int) -> None:
        """A timed step's figures."""
        get: Callable[[str], Any] = r.get
        wall = r["wall_ms"]
        self.wall.buf.append(wall)
        span = span_ms(wall, get("gpu_ms"))
        self.span.buf.append(span)
        for field, buf in _SKETCHED:
            x = get(field)
            t = type(x)
            if t is float or t is int:
                buf(self).append(x)
        x = get("overhead_us")
        if type(x) is float or type(x) is int:
            self.overhead_sum_ns.value += round(x * 1e3)
        _add_memory(self, get)
        batch = get("batch_size")
        if type(batch) is int:
            self.batch_sizes.add(batch)
            x = get("samples_per_s")
            t = type(x)
            if t is float or t is int:
                self.sps.buf.append(x)
        x = get("tokens_per_s")
        t = type(x)
        if t is float or t is int:
            self.tps.buf.append(x)
        wait = get("data_wait_ms")
        t = type(wait)
        if t is float or t is int:
            self.data_wait.buf.append(wait)
            self.data_wait_sum_ns.value += round(wait * 1e6)
            self.loop_sum_ns.value += round(_loop_ms(self.wait_in, wait, wall, get("data_wait_in_step_ms")) * 1e6)
            x = get("data_ms")  # (stepprof.iterate) counts only with a data wait
            t = type(x)
            if t is float or t is int:
                self.data_sum_ns.value += round(x * 1e6)
                self.data_steps.value += 1
        else:
            wait = -1.0
        allocs, retries = self._add_allocator(get("allocator"))
        syncs = get("syncs")
        n_syncs = self._add_syncs(syncs) if type(syncs) is dict else None
        phases = get("phases")
        if phases and type(phases) is dict:
            # A phase's syncs count only in a step that counted its own (a log may hold 0s there).
            self._add_phases(phases, n_syncs is not None)
        if "energy_j" in r:
            self._add_energy(r, batch)
        if "tflops_per_s" in r:
            for field, buf in _SKETCHED_FLOPS:
                x = get(field)
                t = type(x)
                if t is float or t is int:
                    buf(self).append(x)
        spikes = self.spikes.value
        if len(spikes) < SPIKES_KEPT or span > spikes[0][0]:
            self.spikes.add((span, idx, allocs, retries, -1 if n_syncs is None else n_syncs, float(wait)))
        x = get("unavailable")
        if x and type(x) is dict:
            self._take_reasons(x)
        self.since_settle += 1
        if self.since_settle >= _SETTLE_EVERY:
            self.settle()

    def _take_flops_state(self, r: dict[str, Any]) -> None:
        """A step of a run that asked for FLOPs: keep the latest reasons for null ones."""
        self.flops_requested.add(True)
        unavailable = r.get("unavailable")
        if type(unavailable) is dict:
            why = unavailable.get("tflops_per_s")
            if type(why) is str and r.get("tflops_per_s") is None:
                self.flops_reason.add(why)
            if r.get("tflops_per_s") is not None:
                why = unavailable.get("mfu")
                if type(why) is str and r.get("mfu") is None:
                    self.mfu_reason.add(why)
                why = unavailable.get("mfu_datasheet")
                if type(why) is str and r.get("mfu_datasheet") is None:
                    self.mfu_datasheet_reason.add(why)

    def _take_compiles(self, r: dict[str, Any], idx: int) -> None:
        """A step record with the compile fields (warm-up or not): the run's compile totals."""
        self.compile_seen.add(True)
        get = r.get
        x = get("compiles")
        if type(x) is int and x > 0:
            self.compiles.add(x)
        x = get("compile_ms")
        if (type(x) is float or type(x) is int) and x > 0:
            self.compile_us.add(round(x * 1e3))
        x = get("graph_breaks")
        if type(x) is int and x > 0:
            self.graph_breaks.add(x)
        reasons = get("recompile_reasons")
        if reasons and type(reasons) is list:
            kept = self.recompile_reasons
            for why in reasons:
                if len(kept.value) >= kept.cap:
                    break
                if type(why) is str:
                    kept.add((idx, why[:500]))

    def add_late(self, r: dict[str, Any], batch: Any) -> None:
        """A timed step's late fields (:meth:`RunAggregate.add_late`)."""
        if "energy_j" in r:
            self._add_energy(r, batch)
        reasons = r.get("unavailable")
        if reasons:
            self._take_reasons(reasons)

    def _add_energy(self, r: dict[str, Any], batch: Any) -> None:
        x: Any
        span: Any
        x, span = r.get("energy_j"), r.get("energy_span_ms")
        tx, ts = type(x), type(span)
        if (tx is float or tx is int) and (ts is float or ts is int) and x >= 0 and span > 0:
            uj = round(x * 1e6)
            self.energy_steps.value += 1
            self.energy_uj.value += uj
            self.energy_span_us.value += round(span * 1e3)
            if type(batch) is int and batch > 0:
                self.energy_samples.value += batch
                self.energy_batched_uj.value += uj
            return
        reasons = r.get("unavailable")
        why = reasons.get("energy_j") if type(reasons) is dict else None
        if type(why) is str:
            self.energy_reason.add(why)

    def _add_allocator(self, alloc: Any) -> tuple[int, int]:
        """Sum a step's allocator counters; return its device allocations and retries."""
        if type(alloc) is not dict:
            return 0, 0
        self.alloc_steps.value += 1
        totals = self.alloc.value
        for key, n in alloc.items():
            if type(n) is int and key in totals:
                totals[key] += n
        allocs = alloc.get("num_device_alloc")
        retries = alloc.get("num_alloc_retries")
        if type(allocs) is not int:
            allocs = 0
        elif allocs > 0:
            self.steps_with_device_alloc.value += 1
        if type(retries) is not int:
            retries = 0
        return allocs, retries

    def _add_syncs(self, syncs: dict[str, Any]) -> int | None:
        """A timed step's ``syncs``; return its count, or None when it did not count them."""
        count = syncs.get("count")
        if type(count) is not int:
            return None
        self.sync_steps.value += 1
        self.syncs.buf.append(count)
        x = syncs.get("mechanism")
        if type(x) is str:
            self.sync_mechanism.value = x
        x = syncs.get("other_threads")
        if x and type(x) is int:
            self.other_threads.add(x)
        x = syncs.get("sites")
        if x and type(x) is list:
            self.sites.add(x)
        return count

    def _add_phases(self, phases: dict[str, Any], syncs_counted: bool) -> None:
        table = self.phases.value
        for name, entry in phases.items():
            ph = table.get(name)
            if ph is None:
                ph = self.phases.at(name)  # made even for an entry that is not a dict
            if ph is not None and type(entry) is dict:
                ph.add(entry, syncs_counted)

    def _take_reasons(self, unavailable: dict[str, Any]) -> None:
        reasons = self.step_reasons
        if len(reasons.value) >= TABLE_CAP or unavailable.keys() <= reasons.value.keys():
            return  # (the common case: every step repeats the same reasons)
        for key, why in unavailable.items():
            if type(why) is str:
                reasons.add(key, why)

    def settle(self) -> None:
        """Fold the sketches' buffers (done every few thousand steps, and before reading)."""
        self.since_settle = 0
        for name in _SKETCHES:
            getattr(self, name).settle()
        for ph in self.phases.value.values():
            ph.wall.settle()
            ph.gpu.settle()


def _add_memory(totals: StepTotals, get: Any) -> None:
    """A timed step's memory figures (``get``: the record's)."""
    x = get("peak_allocated_bytes")
    t = type(x)
    if (t is int or t is float) and (totals.peak.value is None or x > totals.peak.value):
        totals.peak.value = x
    x = get("reserved_bytes")
    t = type(x)
    if t is int or t is float:
        totals.reserved_last.value = x
        if totals.reserved.value is None or x > totals.reserved.value:
            totals.reserved.value = x
    x = get("host_rss_bytes")
    if type(x) is int:
        totals.rss.value = x


class RunRecords(Fields):
    """The accumulators of a run's records other than its steps (and the identity its steps name)."""

    FIELDS = (
        ("memory_records", Sum), ("memory_first", First), ("memory_last", Last),  # first: a steady one
        ("flops", Last), ("summary", Last),
        ("identity", First),  # this log's rank, from the first record that names one
        ("ranks_records", Sum), ("ranks_named", lambda: Counter(cap=math.inf)),  # rank 0's log
        ("ranks_last", Last), ("ranks_last_named", Last),
    )
    __slots__ = tuple(name for name, _ in FIELDS)
    memory_records: Sum
    memory_first: First
    memory_last: Last
    flops: Last
    summary: Last
    identity: First
    ranks_records: Sum
    ranks_named: Counter
    ranks_last: Last
    ranks_last_named: Last

    def add(self, kind: Any, r: dict[str, Any]) -> None:
        """A record of ``kind`` memory, flops, ranks or summary (others are not kept)."""
        if kind == "memory":
            self.memory_records.add()
            if r.get("trigger") in ("after_warmup", "periodic"):
                self.memory_first.add(r)
            self.memory_last.add(r)
        elif kind == "flops":
            self.flops.add(r)
        elif kind == "ranks":
            self.ranks_records.add()
            who = r.get("straggler_rank")
            if type(who) is int:
                self.ranks_named.add(who)
                self.ranks_last_named.add(r)
            self.ranks_last.add(r)
        elif kind == "summary":
            self.summary.add(r)
            self.take_identity(r)

    def take_identity(self, r: dict[str, Any]) -> None:
        """The run's rank, local rank and world size, from the first record that names a rank."""
        if self.identity.value is None and type(r.get("rank")) is int:
            self.identity.add({
                k: r.get(k) if type(r.get(k)) is int else None for k in ("rank", "local_rank", "world_size")
            })


class NameGroups:
    """The step totals of each step name, once a run's steps have a second name.

    Until then only the first step's name group (``key``) is kept: the run's own totals
    are that group's.  A run's name groups take its steps before its totals do.
    """

    __slots__ = ("key", "by_name", "last_key", "lead_peak")

    def __init__(self) -> None:
        self.key: str | None = None
        self.by_name: dict[str, StepTotals] | None = None  # None while the run has one name
        self.last_key: str | None = None  # the latest step's name group (its peak record goes there)
        #: A peak record read before this stretch's first step: its step is in an earlier stretch.
        self.lead_peak: dict[str, Any] | None = None

    def add_step(self, key: str, r: dict[str, Any], run: StepTotals) -> None:
        """A step record of name group ``key`` when it differs from the first step's, or
        the run is split; before it counts in ``run``, the run's totals."""
        if self.key is None:  # the run's first step
            self.key = key
            return
        groups = self.by_name
        if groups is None:  # the second name: the steps so far are all of the first one
            groups = self.by_name = {self.key: self._copy(run)}
        if key not in groups and len(groups) >= NAMES_SPLIT:
            key = OTHER_NAMES
        group = groups.get(key)
        if group is None:
            group = groups[key] = StepTotals()
        group.add(r)

    def add_late(self, key: str, r: dict[str, Any], batch: Any) -> None:
        """A timed step's late fields, to its name group (none while the run has one name)."""
        if self.by_name is not None:
            group = self.by_name.get(key) or self.by_name.get(OTHER_NAMES)
            if group is not None:
                group.add_late(r, batch)

    def add_peak(self, record: dict[str, Any]) -> None:
        """A peak record follows its step's record: it goes to that step's name group."""
        if self.key is None:
            self.lead_peak = record
        elif self.by_name is not None:
            group = self.by_name.get(self.last_key) if self.last_key is not None else None
            group = group if group is not None else self.by_name.get(OTHER_NAMES)
            if group is not None:
                group.peak_record.add(record)

    def _copy(self, run: StepTotals) -> StepTotals:
        """A copy of the run's totals, as its one name group so far."""
        group = copy.deepcopy(run)
        if self.lead_peak is not None and run.peak_record.value is self.lead_peak:
            group.peak_record = Last()  # an earlier stretch's step's
        return group

    def merge(self, later: NameGroups, run: StepTotals, later_run: StepTotals) -> None:
        """Fold in a later stretch's groups (``run``, ``later_run``: the two stretches' totals, unmerged)."""
        split = self.by_name is not None or later.by_name is not None or (
            self.key is not None and later.key is not None and self.key != later.key
        )
        if split:
            groups = self._groups(run)
            for key, group in later._groups(later_run).items():
                if key in groups:
                    groups[key].merge(group)
                elif len(groups) < NAMES_SPLIT:
                    groups[key] = group
                elif OTHER_NAMES in groups:
                    groups[OTHER_NAMES].merge(group)
                else:
                    groups[OTHER_NAMES] = group
            self.by_name = groups
        lead = later.lead_peak  # its step is self's last (none: an earlier stretch's)
        if self.key is None:
            self.lead_peak = self.lead_peak or lead
        elif lead is not None and split:
            self.add_peak(lead)
        self.key = self.key if self.key is not None else later.key
        self.last_key = later.last_key if later.last_key is not None else self.last_key

    def _groups(self, run: StepTotals) -> dict[str, StepTotals]:
        """The name groups (the run's totals copied as one group while it has one name)."""
        if self.by_name is not None:
            return self.by_name
        return {self.key: self._copy(run)} if self.key is not None else {}


class RunAggregate:
    """One profiling run's records, aggregated in bounded memory.

    ``agg.<name>`` reads the value of the run's accumulator of that name in
    :class:`StepTotals` or :class:`RunRecords`: ``agg.measured``, ``agg.peak``, ``agg.wall``.

    Example:
        >>> agg = RunAggregate()
        >>> for i in range(3):
        ...     agg.add({"kind": "step", "step": i, "warmup": i == 0, "wall_ms": 2.0 + i})
        >>> agg.summary_fields()["wall_ms"]
        Percentiles(median=3.5, p10=3.1, p90=3.9)
    """

    __slots__ = ("index", "run_id", "totals", "records", "groups")

    def __init__(self, index: int = 0) -> None:
        self.index = index
        #: The writer's ``run_id`` (set by whoever groups the records; else the first record's).
        self.run_id: str | None = None
        self.totals = StepTotals()
        self.records = RunRecords()
        self.groups = NameGroups()

    def __getattr__(self, name: str) -> Any:
        part = _PARTS.get(name)
        if part is None:
            raise AttributeError(f"'RunAggregate' object has no attribute {name!r}")
        return getattr(getattr(self, part), name).value

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
        elif kind == "peak":
            self.totals.peak_record.add(record)
            self.groups.add_peak(record)
        else:
            self.records.add(kind, record)

    def add_step(self, r: dict[str, Any]) -> bool:
        """A ``kind: "step"`` record: counted, and its figures taken if it is a timed step
        (then True)."""
        groups = self.groups
        name = r.get("name")
        key = name if type(name) is str else NO_NAME
        if key != groups.key or groups.by_name is not None:
            groups.add_step(key, r, self.totals)  # before the step counts in the run's totals
        groups.last_key = key
        if "rank" in r and self.records.identity.value is None:
            self.records.take_identity(r)
        return self.totals.add(r)

    def add_late(self, r: dict[str, Any], name: Any, batch: Any, timed: bool) -> None:
        """The late fields ``r`` (with their ``unavailable``) of a step record of this ``name``
        that :meth:`add_step` took before them: energy, which waits for the sample after the
        step; ``timed``: whether the step is a timed one (``stepprof._rules.left_out``)."""
        if timed:
            self.totals.add_late(r, batch)
            self.groups.add_late(name if type(name) is str else NO_NAME, r, batch)

    def merge(self, later: RunAggregate) -> None:
        """Fold in ``later``: the same run, continued in a later stretch of the log."""
        self.groups.merge(later.groups, self.totals, later.totals)
        self.totals.merge(later.totals)
        self.records.merge(later.records)
        if self.run_id is None:
            self.run_id = later.run_id

    def name_groups(self) -> dict[str, RunAggregate]:
        """Each step name's aggregate, when the run's steps have several names; else empty.

        Each has that name's step totals and the run's other records, but for the FLOPs
        record: that goes to the name whose step was counted (or to the one name).
        """
        groups = self.groups.by_name or {}
        views = {}
        for name, totals in groups.items():
            view = views[name] = RunAggregate(self.index)
            view.run_id, view.totals, view.records = self.run_id, totals, self.records
            if totals.flops_counted_step.value is None and (self.flops_counted_step is not None or len(groups) > 1):
                view.records = copy.copy(self.records)
                view.records.flops = Last()
        return views

    # -- figures out --------------------------------------------------------------

    @property
    def timed_steps(self) -> int:
        """Measured steps whose times count (all but the FLOPs-counted one and those that compiled)."""
        return self.totals.wall.count

    @property
    def sketches(self) -> tuple[Sketch, ...]:
        """The sketches of the per-step figures."""
        return self.totals.sketches

    @property
    def approximate(self) -> bool:
        """True when a figure's quantiles come from the compacted sketch (over ``EXACT`` steps)."""
        return not all(sketch.exact for sketch in self.sketches)

    def figures(self) -> RunFigures:
        """The per-step figures (settles the sketches)."""
        self.totals.settle()
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
            data_wait_ms_mean=self.data_wait_sum_ns / self.data_wait.count / 1e6 if self.data_wait.count else None,
            data_wait_in_step_ms_median=self.wait_in.quantile(0.5),
            tflops_per_s_median=self.tflops.quantile(0.5),
            mfu_median=self.mfu.quantile(0.5),
            mfu_datasheet_median=self.mfu_datasheet.quantile(0.5),
            tokens_per_s_median=self.tps.quantile(0.5),
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
            "tokens_per_s_median": figures.tokens_per_s_median,
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
        if figures.mfu_datasheet_median is None:
            why["mfu_datasheet_median"] = (
                why["tflops_per_s_median"]
                if figures.tflops_per_s_median is None
                else self.mfu_datasheet_reason or self._flops_record_reason("datasheet_ms")
                or "not computed (a log from before mfu_datasheet)"
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
        self.totals.settle()
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
            "tokens_per_s_median": figures.tokens_per_s_median,
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
            "mfu_datasheet_median": figures.mfu_datasheet_median,
            "energy_j_per_step": figures.energy_j_per_step,
            "power_w_mean": figures.power_w_mean,
            "samples_per_j": figures.samples_per_j,
            "unavailable": unavailable,
            "phases": self._phase_figures(),
            "ended_by": self._ended_by(),
            "run_id": self.run_id,
            "compile_steps": self.compile_steps if self.compile_seen else None,
            "timed_steps": self.timed_steps,
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


#: Where ``RunAggregate.<name>`` reads its value: the accumulator's part.
_PARTS = {name: part for part, fields in (("totals", StepTotals.FIELDS), ("records", RunRecords.FIELDS))
          for name, _ in fields}


_native.use(use_native)
