"""The recorder: steps, phases, lazy harvesting of device timings, the summary.

This module is pure Python.  It reaches the device only through a backend
(:mod:`stepprof._device`) and reads time only through an injected clock, so the
tests drive all of it on a CPU with a fake device.

How one step is measured (``B`` = a boundary, where stepprof does its work)::

    B step entry : reset the allocator's peak counter, record the start event
    B phase entry: a top-level phase starts at the previous top-level boundary's
                   event; a nested phase reads the peak so far (folding it into
                   every open scope), resets, and records its own start event
    B phase exit : record the end event, read the peak (fold), reset
    B step exit  : record the end event, read the peak (fold) and reserved,
                   and queue the step for the collector thread

Every read is folded into every open scope, and every interval of the step is
covered by some read, so the step's peak is the exact high-water mark over the
whole step, phases and gaps included.  Each phase gets its own peak; a
top-level phase's peak also covers the (normally empty) gap since the previous
read, which saves one raw-stats read per phase.  Events are only *queried*, never
waited on: the collector thread writes a step's record once its end event (and
each of its phases' end events) has completed.  :meth:`Profiler.close`
waits once for the pending steps' events and writes whatever is still pending.

Memory records (:mod:`stepprof._memory`) cost one integer comparison per step
at step exit.  At the step that is due one (the first after warm-up, then
every ``memory_every`` steps) the training thread reads the allocator,
``cudaMemGetInfo`` and NVML (about 100 µs on the H200); the collector thread reconciles the
readings and writes the ``kind: "memory"`` record right after that step's.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from . import _dist, _memory
from ._device.backend import ALLOCATOR_COUNTERS, Backend, HostBackend
from ._device.cuda import memory_backend, select_backend
from ._device.facts import device_name
from ._errors import StepprofError, UsageError
from ._log import JsonlWriter
from ._memory import MemoryReport, Snapshot
from ._options import ProfilerOptions
from ._records import Percentiles, Summary
from ._registry import HOST_RSS, forget_open, pop_active, push_active, track_open
from ._roofline import FlopCount, ideal_ms, load_calibration
from ._schema import SCHEMA_VERSION
from ._scopes import StepScope, make_measure
from ._syncs import SyncTracker
from ._validate import MEMORY_EVERY, PHASE_PEAKS_EVERY, check_batch_size, check_budget, check_group, check_name

__all__ = ["Profiler"]

_Clock = Callable[[], int]


class _Phase:
    """An open phase: where it started."""

    __slots__ = ("key", "mark", "t0", "peak", "syncs")

    def __init__(self, key: str) -> None:
        self.key = key
        self.mark: Any = None
        self.t0 = 0
        self.peak = -1
        self.syncs = 0


class _PhaseTotal:
    """A phase name's totals within one step (it may run several times)."""

    __slots__ = ("wall_ns", "marks", "peak", "count", "syncs")

    def __init__(self) -> None:
        self.wall_ns = 0
        self.marks: list[tuple[Any, Any]] = []
        self.peak = -1
        self.count = 0
        self.syncs = 0


class _Step:
    __slots__ = (
        "index", "name", "warmup", "batch_size", "t0", "t1", "start_mark", "end_mark",
        "peak", "reserved", "rss", "phases", "overhead_ns", "error", "syncs", "syncs_reason",
        "counters", "phase_peaks", "backend",
    )

    def __init__(self, index: int, name: str, warmup: bool, batch_size: int | None) -> None:
        self.index = index
        self.name = name
        self.warmup = warmup
        self.batch_size = batch_size
        self.t0 = self.t1 = 0
        self.start_mark: Any = None
        self.end_mark: Any = None
        self.peak = -1
        self.reserved: int | None = None
        self.rss: int | None = None
        self.phases: dict[str, _PhaseTotal] = {}
        self.overhead_ns = 0
        self.error: dict[str, str] | None = None
        self.syncs: dict[str, Any] | None = None
        self.syncs_reason: str | None = None
        self.counters: tuple[int, ...] | None = None
        self.phase_peaks = True
        # The backend it was measured on: harvested with it even if the profiler has
        # moved from the host to CUDA since (device=None, CUDA initialised later).
        self.backend: Any = None


#: ``_memory_due`` when no further memory record is due (no step has index -1).
_NEVER = -1


#: The token of a step entered after recording stopped (see ``_unrecorded_step``).
_UNRECORDED = object()

_NO_EVENT = "no CUDA event was recorded at a boundary: the stream was capturing a CUDA graph"

#: How often the collector thread looks for completed steps to write.
COLLECT_EVERY_S = 0.02

# Why an inherited profiler records nothing in a forked child (see Profiler._forked).
_INHERITED_PREFIX = "this Profiler was inherited by the forked process"
_INHERITED = _INHERITED_PREFIX + (
    " {pid}: a profiler records only in the "
    "process that created it, so it records nothing here; open a new stepprof.Profiler in the "
    "child to profile it"
)


class Profiler:
    """A profiling session: records steps and their phases to a JSON-lines log.

    Use it as a context manager (closing flushes the log and writes a summary)
    or call :meth:`close`.  While it is the innermost active ``with Profiler``,
    :func:`stepprof.profile_step` and :func:`stepprof.measure` record into it.

    Args:
        log: path of the JSON-lines log (appended to), or None to keep no log.
            It is opened here, so an unwritable path fails before training.
        warmup: how many first steps to flag ``warmup`` and leave out of the summary.
        device: ``"cuda:N"``, ``"cpu"`` or None. None picks CUDA at the first step
            if the training code has initialised it, else the host.
        nvtx: push an NVTX range per step and phase (visible in Nsight Systems).
        syncs: how to count the step's host-device syncs: ``"warn"`` (torch's
            sync-debug warnings, free until a sync happens), ``"trace"`` (torch's
            GPU-trace callbacks: sees every wait, costs on every allocation) or
            ``"off"``.  See docs/syncs.md.
        max_syncs: the default sync budget of a step (None: no budget).
        on_sync: what a step over budget does: ``"count"`` (record it),
            ``"warn"`` (one warning per offending line) or ``"raise"``
            (:class:`stepprof.SyncBudgetExceeded` at the offending line).
            The budget applies after the warm-up steps.
        memory_every: write a ``kind: "memory"`` record (see :func:`stepprof.memory_report`)
            every this many steps after the one that follows warm-up; 0 writes only
            that one and the one at close.  CUDA only.
        phase_peaks_every: how often phases get their own ``peak_allocated_bytes``.
            The step's peak is exact on every step; a phase's peak costs one more
            allocator-stats read at its exit.  They are read on every warm-up step,
            on every step while the step's peak is still changing, and on one step
            in this many once it holds steady (other steps: null, with the reason).
            1 reads them on every step, 0 never.  CUDA only.
        flops: ``"auto"`` counts the FLOPs of one step, the first past warm-up, with
            ``torch.utils.flop_counter.FlopCounterMode`` (that step runs eagerly and
            slower; see docs/report.md), and writes a ``kind: "flops"`` record.  None
            (the default) counts nothing and costs nothing.
        flops_per_step: the FLOPs of one step, if you know them (instead of ``"auto"``).
            Either way the step records then carry ``flops``, ``tflops_per_s`` and
            ``mfu`` (the latter from ``stepprof calibrate``'s figures, else None).
        ranks_every: in a distributed run (torch.distributed initialised, or torchrun's
            ``RANK``/``WORLD_SIZE``), every this many steps the ranks gather their recent
            figures in one ``all_gather``, and rank 0 writes a ``kind: "ranks"`` record
            naming any straggler; 0 turns it off.  Every rank must then call
            ``profile_step`` the same number of times (docs/distributed.md).
        log_ranks: in a distributed run, ``"all"`` (each rank writes
            ``<stem>.rank<R><suffix>`` next to ``log``) or ``"zero"`` (only rank 0 writes).
        group: the process group of the exchange (default: the default group).

    Example:
        >>> import stepprof, torch
        >>> with stepprof.Profiler(None, warmup=0) as prof:
        ...     with prof.step(batch_size=32):
        ...         with prof.measure("forward"):
        ...             y = torch.ones(32, 8).sum()
        >>> prof.summary.measured_steps
        1
    """

    def __init__(
        self,
        log: str | os.PathLike[str] | None,
        *,
        warmup: int = 0,
        device: str | int | torch.device | None = None,
        nvtx: bool = True,
        syncs: str = "warn",
        max_syncs: int | None = None,
        on_sync: str = "count",
        memory_every: int = MEMORY_EVERY,
        phase_peaks_every: int = PHASE_PEAKS_EVERY,
        flops: str | None = None,
        flops_per_step: float | None = None,
        ranks_every: int = _dist.RANKS_EVERY,
        log_ranks: str = "all",
        group: Any = None,
        _backend: Backend | None = None,
        _clock: _Clock | None = None,
        _collect_every_s: float | None = COLLECT_EVERY_S,
        _gather: Any = None,
        _close_wait_s: float = _dist.CLOSE_WAIT_S,
    ) -> None:
        options = ProfilerOptions(  # every argument is checked before the log is opened
            log, warmup=warmup, device=device, nvtx=nvtx, syncs=syncs, max_syncs=max_syncs,
            on_sync=on_sync, memory_every=memory_every, phase_peaks_every=phase_peaks_every,
            flops=flops, flops_per_step=flops_per_step, ranks_every=ranks_every,
            log_ranks=log_ranks, group=group,
        )
        log, device, nvtx, syncs = options.log, options.device, options.nvtx, options.syncs
        flops_mode, given = options.flops, options.flops_per_step
        ranks_every, log_ranks, group = options.ranks_every, options.log_ranks, options.group
        self.warmup = options.warmup
        self._sync_mode = syncs
        self.max_syncs = options.max_syncs
        self.on_sync = options.on_sync
        self._tracker = SyncTracker(syncs)
        self._watching = False
        self._counters: tuple[int, ...] | None = None
        self.memory_every = options.memory_every
        self.phase_peaks_every = n = options.phase_peaks_every
        self._phase_peaks_why = (  # why a step's phases have no peak (built once, not per record)
            "phase peaks are off (phase_peaks_every=0); the step's peak is exact" if n == 0 else
            f"not read on this step: while the step's peak holds steady, phase peaks are read "
            f"on one step in {n} (phase_peaks_every={n}; phase_peaks_every=1 reads them on every "
            f"step). The step's peak_allocated_bytes is exact"
        )
        self._last_peak = -1      # the previous step's peak ...
        self._steady = 0          # ... and how many steps in a row have repeated it
        self._phase_peaks_at = -1  # the last step that read its phases' peaks
        # Distributed: rank fields on every record, a log per rank, the exchange.
        ident = _dist.identify()
        group = check_group(group, ident, ranks_every)
        self._rank_fields = ident.fields() if ident is not None else None
        if ident is not None and log is not None:
            log = None if log_ranks == "zero" and ident.rank else _dist.rank_log_path(os.fspath(log), ident.rank)
        self._exchange = (
            _dist.Exchange(ranks_every, ident, group=group, gather=_gather, close_wait_s=_close_wait_s)
            if ident is not None and ranks_every else None
        )
        self._gap_from: tuple[Any, int] | None = None  # the last step's end, for the next gap
        self._writer = JsonlWriter(log) if log is not None else None
        self.log = self._writer.path if self._writer else None
        self._device_arg = device
        self._nvtx = nvtx
        self._backend: Backend | None = _backend
        self._backend_pinned = _backend is not None or device is not None
        self._clock: _Clock = _clock or time.perf_counter_ns
        self._clock0 = self._clock()
        self._unix0 = time.time()
        self._next_index = 0
        self._step: _Step | None = None
        self._stack: list[_Phase] = []
        self._pending: deque[_Step] = deque()
        self._owner: int | None = None
        self._broken: str | None = None
        self._summary: Summary | None = None
        self._n_steps = self._n_warm = self._n_err = 0
        self._wall: list[float] = []
        self._gpu: list[float] = []
        self._busy: list[float] = []
        self._sps: list[float] = []
        self._ovh: list[float] = []
        self._sync_counts: list[float] = []
        self._batch: list[dict[str, Any]] | None = None  # records of the harvest in progress
        self._peak_max: int | None = None
        self._reasons: dict[str, str] = {}
        self._last_top_mark: Any = None
        self._warned: set[str] = set()
        # The collector thread harvests, builds and writes records off the training
        # thread; None (tests) harvests inline at each step's exit instead.
        self._collect_every_s = _collect_every_s
        self._collector: threading.Thread | None = None
        self._collector_error: str | None = None
        self._stop = threading.Event()
        self._harvest_lock = threading.Lock()
        self._close_lock = threading.RLock()  # one close(): a concurrent one waits for it
        # Memory records: the step index due one, readings awaiting the collector,
        # and the highest step peak written so far (kept by the collector thread).
        self._memory_due = self.warmup
        self._memory_snaps: dict[int, tuple[str, Snapshot | str]] = {}
        self._peak_seen = -1
        if _backend is not None and _backend.memory_reason is None:
            _memory.observe(_backend)
        # FLOPs: off (None), counted once ("auto") or given.  Counting swaps the two
        # step boundaries for counting ones on this instance only, until the count is
        # done, so a profiler without flops runs exactly the code it ran before.
        self._flops_mode = flops_mode
        if given is not None:
            self._flops_mode = "given"
        self._flops: dict[str, Any] | None = None  # set once known: see _set_flops
        self._flops_reason = "not counted yet: FLOPs are counted in the first step past warm-up"
        self._flops_record: dict[str, Any] | None = None
        self._flop_count: FlopCount | None = None
        self._flop_attempts = 0
        self._flop_index = -1
        self._under_counter: set[int] = set()  # steps that ran under FlopCounterMode
        self._ideal_ms: float | None = None
        self._mfu_reason: str | None = None
        self._tflops: list[float] = []
        self._mfu: list[float] = []
        if given is not None:
            self._set_flops({"source": "given", "flops_per_step": given, "flops_by_dtype": None,
                             "ops": None, "op_bytes": None, "step": None, "notes": []}, None)
        elif self._flops_mode == "auto":
            self._begin_step = self._begin_counting_step  # type: ignore[method-assign]
            self._end_step = self._end_counting_step  # type: ignore[method-assign]
        track_open(self)

    # -- public -------------------------------------------------------------

    def step(
        self,
        name: str | None = None,
        *,
        batch_size: int | None = None,
        max_syncs: int | None = None,
        on_sync: str | None = None,
    ) -> StepScope:
        """A context manager around one training step.

        Args:
            name: the step's name in the log (default ``"step"``).
            batch_size: samples in the step; enables ``samples_per_s``.
            max_syncs, on_sync: this step's sync budget and policy (default: the
                profiler's).
        """
        return StepScope(self, check_name(name), check_batch_size(batch_size),
                         *check_budget(max_syncs, on_sync))

    def measure(self, name: Any = None) -> Any:
        """Like :func:`stepprof.measure`, but recording into this profiler."""
        return make_measure(name, self)

    @property
    def summary(self) -> Summary | None:
        """The summary once :meth:`close` has run, else None."""
        return self._summary

    @property
    def closed(self) -> bool:
        return self._summary is not None

    def close(self) -> Summary:
        """Wait for the pending steps' events, write every record and the summary, close the log.

        Calling it again returns the same summary.
        """
        if self._summary is not None:
            return self._summary
        with self._close_lock:
            if self._summary is not None:  # another thread closed it meanwhile
                return self._summary
            return self._close()

    def _close(self) -> Summary:
        try:
            if self._step is not None and self._owner == threading.get_ident():
                self._end_step(self._step, RuntimeError("profiler closed while the step was open"))
        except Exception as e:  # noqa: BLE001 - close must always produce a summary
            self._fail(e)
        self._stop.set()
        collector = self._collector
        if collector is not None and collector is not threading.current_thread():
            collector.join()
        with self._harvest_lock:
            try:
                if self._pending:
                    # Steps that finished before any internal error are still written.  Wait on
                    # their own events, not the whole device: a collective that another rank
                    # never joins (an exchange, or the user's own) would hold a device-wide
                    # synchronize forever, and sync-debug mode "error" would refuse it.
                    waits: dict[int, tuple[Backend, list[Any]]] = {}
                    for s in self._pending:
                        marks = waits.setdefault(id(s.backend), (s.backend, []))[1]
                        marks.append(s.end_mark)
                        for total in s.phases.values():
                            marks.extend(end for _, end in total.marks)
                    for b, marks in waits.values():
                        b.wait(marks)
                    self._harvest()
            except Exception as e:  # noqa: BLE001 - close must always produce a summary
                self._fail(e)
            self._pending.clear()
            self._memory_snaps.clear()
            self._write_close_memory()
            if self._exchange is not None:  # finishes enqueued exchanges; starts none
                self._exchange.close(self._write)
                if self._gap_from is not None and self._backend is not None:
                    self._backend.release(self._gap_from[0])
        self._summary = self._build_summary()
        self._write(self._summary.to_record())
        if self._writer is not None:
            self._writer.close()
        self._warn_async()
        forget_open(self)
        return self._summary

    def __enter__(self) -> Profiler:
        push_active(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        pop_active(self)
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self._next_index} steps"
        return f"<stepprof.Profiler log={self.log!r} warmup={self.warmup} {state}>"

    # -- entry and exit, shared by steps, phases and measured functions -------

    def _enter(
        self,
        name: str | None,
        batch_size: int | None,
        *,
        step: bool,
        budget: tuple[int | None, str | None] = (None, None),
    ) -> Any:
        """Open a step (``step=True``, or no step is open) or a phase; return a token."""
        if self._summary is not None:
            raise UsageError(
                "this Profiler is closed; open a new stepprof.Profiler(...) for more steps"
            )
        if self._broken is not None:
            if self._broken.startswith(_INHERITED_PREFIX) and self._broken not in self._warned:
                self._warned.add(self._broken)
                warnings.warn(f"stepprof: {self._broken}", RuntimeWarning, stacklevel=4)
            return self._unrecorded_step() if self._exchange is not None else None
        tid = threading.get_ident()
        if self._owner != tid:
            if self._owner is not None and self._step is not None:
                return None  # another thread's call while a step is open: not recorded
            self._owner = tid
        open_step = self._step
        if open_step is not None and step:
            raise UsageError(
                f"profile_step() was entered inside step {open_step.index} "
                f"({open_step.name!r}); steps do not nest. Use stepprof.measure({name or 'name'!r}) "
                f"for a phase inside a step, or leave the outer step first"
            )
        try:
            if open_step is None:
                return self._begin_step(name or "step", batch_size, budget)
            return self._begin_phase(open_step, name or "phase")
        except StepprofError:
            raise
        except Exception as e:  # noqa: BLE001 - stepprof never breaks training
            self._fail(e)
            if open_step is None and self._exchange is not None:
                # The step that failed to open still counts: its exit takes part in the exchange.
                self._exchange.unrecorded_open = False
                return self._unrecorded_step()
            return None

    def _exit(self, token: Any, exc: BaseException | None) -> None:
        if token is None or self._broken is not None:
            if token is not None and self._exchange is not None:
                self._exchange_anyway(token)
            return
        try:
            if isinstance(token, _Step):
                if token is self._step:
                    self._end_step(token, exc)
                if self._broken is not None and self._exchange is not None:
                    self._exchange.unrecorded_open = False  # recording stopped inside the step
            elif self._step is not None:
                self._end_phase(self._step, token, exc)
        except Exception as e:  # noqa: BLE001 - stepprof never breaks training
            self._fail(e)
            if self._exchange is not None:
                self._exchange_anyway(token)
        if exc is None and isinstance(token, _Step) and self._tracker.deferred is not None:
            # A step over its budget on the "trace" route, where the callback that found it
            # could not raise (torch calls it from C++): raised at the step's exit instead.
            deferred, self._tracker.deferred = self._tracker.deferred, None
            raise deferred

    # -- the boundaries ----------------------------------------------------

    def _ensure_backend(self) -> Backend:
        b = self._backend
        if b is None or (
            not self._backend_pinned
            and isinstance(b, HostBackend)
            and torch.cuda.is_available()
            and torch.cuda.is_initialized()
        ):
            b = self._backend = select_backend(
                self._device_arg, nvtx=self._nvtx, syncs=self._sync_mode
            )
            if b.memory_reason is None:  # CUDA, seen for the first time: the context baseline
                _memory.observe(b)
        return b

    def _begin_step(
        self, name: str, batch_size: int | None, budget: tuple[int | None, str | None]
    ) -> _Step:
        t_in = self._clock()
        b = self._ensure_backend()
        index = self._next_index
        self._next_index += 1
        step = _Step(index, name, index < self.warmup, batch_size)
        step.backend = b
        n = self.phase_peaks_every
        if n != 1:
            step.phase_peaks = n > 0 and (
                step.warmup or self._steady < 2 or index - self._phase_peaks_at >= n
            )
        if step.phase_peaks:
            self._phase_peaks_at = index
        self._step = step
        b.range_push(f"{name} {index}")
        if self._counters is None and b.memory_reason is None:
            mem = b.read_memory()  # once: the baseline of the allocator's counters
            self._counters = mem[2] if mem is not None else None
        max_syncs = self.max_syncs if budget[0] is None else budget[0]
        self._tracker.begin(self._stack, max_syncs, budget[1] or self.on_sync, not step.warmup)
        step.syncs_reason = b.watch_syncs(self._tracker)
        self._watching = step.syncs_reason is None
        b.reset_peak()
        step.start_mark = self._last_top_mark = b.mark()
        step.t0 = self._clock()
        step.overhead_ns = step.t0 - t_in
        return step

    def _fold_peak(self, step: _Step, b: Backend) -> tuple[int, int, Any] | None:
        """Read the peak since the last reset into every open scope; return the read."""
        mem = b.read_memory()
        if mem is None:
            return None
        peak = mem[0]
        if peak > step.peak:
            step.peak = peak
        for ph in self._stack:
            if peak > ph.peak:
                ph.peak = peak
        return mem

    def _unwatch(self) -> None:
        if self._watching:
            self._watching = False
            try:
                self._backend.unwatch_syncs()  # type: ignore[union-attr]
            except Exception as e:  # noqa: BLE001 - stepprof never breaks training
                self._fail(e)

    def _begin_phase(self, step: _Step, name: str) -> _Phase:
        t_in = self._clock()
        b = self._backend
        assert b is not None
        if self._stack:
            # Nested: read the enclosing phase's peak so far before the reset, and
            # give the phase its own start event.
            ph = _Phase(f"{self._stack[-1].key}/{name}")
            if step.phase_peaks:
                self._fold_peak(step, b)
                b.reset_peak()
            b.range_push(name)
            self._stack.append(ph)
            ph.mark = b.mark()
        else:
            # Top level: top-level phases tile the step.  The peak counter already
            # runs from the last read, and the last top-level boundary's event (the
            # step's start or the previous phase's end) serves as this phase's start,
            # which saves a 10-36 µs read and a 5-8 µs event record per phase.  Any
            # device work or allocation between two phases counts toward the next.
            ph = _Phase(name)
            b.range_push(name)
            self._stack.append(ph)
            ph.mark = self._last_top_mark
        ph.t0 = self._clock()
        step.overhead_ns += ph.t0 - t_in
        return ph

    def _end_phase(self, step: _Step, ph: _Phase, exc: BaseException | None) -> None:
        t_in = self._clock()
        b = self._backend
        assert b is not None
        if ph not in self._stack:
            return  # already closed (e.g. by its step's exit)
        end = b.mark()
        if step.phase_peaks:
            self._fold_peak(step, b)
            b.reset_peak()
        if self._stack[0] is ph:
            self._last_top_mark = end
        # Close ph and anything opened inside it that was left open.
        while self._stack:
            top = self._stack.pop()
            b.range_pop()
            total = step.phases.get(top.key)
            if total is None:
                total = step.phases[top.key] = _PhaseTotal()
            total.wall_ns += t_in - top.t0
            total.marks.append((top.mark, end))
            if top.peak > total.peak:
                total.peak = top.peak
            total.count += 1
            total.syncs += top.syncs
            if top is ph:
                break
        step.overhead_ns += self._clock() - t_in

    def _end_step(self, step: _Step, exc: BaseException | None) -> None:
        step.t1 = self._clock()
        b = self._backend
        assert b is not None
        try:
            if self._stack:  # phases left open (a generator suspended mid-phase, say)
                self._end_phase(step, self._stack[0], exc)
            t_in = self._clock()
            step.end_mark = b.mark()
            mem = self._fold_peak(step, b)
            if self._watching:
                step.syncs = self._tracker.end()
                if exc is None and self._tracker.deferred is not None:
                    exc = self._tracker.deferred  # the "trace" route's: _exit raises it
        finally:
            self._unwatch()
        if mem is not None:
            if step.peak == self._last_peak:
                self._steady += 1
            else:
                self._steady, self._last_peak = 0, step.peak
            step.reserved = mem[1]
            counters, previous = mem[2], self._counters
            if counters is not None and previous is not None:
                step.counters = tuple(now - then for now, then in zip(counters, previous))
            self._counters = counters
        if isinstance(b, HostBackend):
            step.rss = HOST_RSS.read()
        b.range_pop()
        if step.index == self._memory_due:
            self._snapshot_memory(step, b)
        if self._exchange is not None:  # after the sync watch: enqueues, never waits
            if self._exchange.due() and self._harvest_lock.acquire(blocking=False):
                # Bring the window up to date first: the collector runs every 20 ms, so a
                # short window could otherwise still be empty.  This harvests only steps
                # whose events have completed (query(), never a wait).
                try:
                    self._harvest()
                finally:
                    self._harvest_lock.release()
            self._exchange.step_exit(step.index, getattr(b, "index", None))
        if exc is not None:
            step.error = {"type": type(exc).__name__, "message": _message(exc)}
        self._step = None
        self._last_top_mark = None
        if self._collect_every_s is None:  # inline mode: harvest older steps here
            self._harvest()
            step.overhead_ns += self._clock() - t_in
            self._pending.append(step)
            if isinstance(b, HostBackend):
                self._harvest()  # nothing to wait for on the host: write it now
            return
        if self._collector_error is not None or (
            self._writer is not None and self._writer.failed is not None
        ):
            self._warn_async()
        step.overhead_ns += self._clock() - t_in
        self._pending.append(step)
        if self._collector is None:
            self._collector = threading.Thread(
                target=self._collect_loop, name="stepprof-collector", daemon=True
            )
            self._collector.start()

    # -- counting FLOPs (flops="auto"): these replace _begin_step/_end_step on the
    # instance until the count is done, then the class's own run again.

    def _begin_counting_step(
        self, name: str, batch_size: int | None, budget: tuple[int | None, str | None]
    ) -> _Step:
        index = self._next_index
        if index >= self.warmup and self._flop_count is None:
            fc = FlopCount()
            try:
                fc.start()
            except Exception as e:  # noqa: BLE001 - no count, never a broken step
                self._give_up_counting(f"FlopCounterMode could not start: {type(e).__name__}: {e}")
            else:
                self._flop_count = fc
                self._flop_index = index
                self._under_counter.add(index)
        return Profiler._begin_step(self, name, batch_size, budget)

    def _end_counting_step(self, step: _Step, exc: BaseException | None) -> None:
        # Stop counting before the step's end is taken, so that its record (built on the
        # collector thread) already has the count.  The counted step's times include the
        # counter's cost either way; its record says flops_counted.
        if self._flop_count is not None and step.index == self._flop_index:
            try:
                self._finish_count(step, exc)
            except Exception as e:  # noqa: BLE001 - no count, never a broken step
                self._give_up_counting(f"{type(e).__name__}: {e}")
        Profiler._end_step(self, step, exc)

    def _finish_count(self, step: _Step, exc: BaseException | None) -> None:
        fc, self._flop_count = self._flop_count, None
        assert fc is not None
        try:
            fc.stop()
        except Exception as e:  # noqa: BLE001 - a user's mode left on top of ours, say
            self._give_up_counting(f"FlopCounterMode could not be left cleanly: {type(e).__name__}: {e}")
            return
        if exc is not None:
            self._flop_attempts += 1
            if self._flop_attempts >= 3:
                self._give_up_counting("the step raised in each of 3 attempts to count its FLOPs")
            return  # count again at the next step
        if fc.error is not None:
            self._give_up_counting(f"the counter failed in step {step.index}: {fc.error}")
            return
        del self._begin_step, self._end_step  # back to the class's boundaries
        notes = list(fc.notes)
        if fc.flops == 0:
            notes.append("the counted step did no operation that FlopCounterMode counts "
                         "(matmuls, convolutions, attention)")
        detail = {"source": "auto", "flops_per_step": fc.flops, "flops_by_dtype": dict(fc.flops_by_dtype),
                  "ops": fc.ops, "op_bytes": fc.op_bytes, "step": step.index, "notes": notes}
        self._set_flops(detail, step)

    def _give_up_counting(self, reason: str) -> None:
        self._flops_reason = f"FLOPs were not counted: {reason}"
        self.__dict__.pop("_begin_step", None)
        self.__dict__.pop("_end_step", None)
        self._flops_record = {"kind": "flops", "source": "auto", "step": None, "flops_per_step": None,
                              "unavailable": {"flops_per_step": self._flops_reason}}

    def _stop_counting(self, reason: str) -> None:
        fc, self._flop_count = self._flop_count, None
        try:
            if fc is not None:
                fc.stop()
        except Exception:  # noqa: BLE001 - recording already failed; the reason says so
            pass
        self._give_up_counting(reason)

    def _set_flops(self, detail: dict[str, Any], step: _Step | None) -> None:
        """The step's FLOPs are known: find the calibration and prepare the flops record."""
        b = self._backend
        index = getattr(b, "index", None)
        on_cuda = b is not None and b.memory_reason is None
        name = device_name(index) if isinstance(index, int) and on_cuda else None
        calibration = None
        if b is not None and b.memory_reason is None and name is None:
            why = "the GPU's model name could not be read, so its calibration cannot be found"
        elif name is None:
            why = ("no calibration for the CPU: stepprof calibrate measures CUDA GPUs"
                   if b is not None else "no step has run, so the device is unknown")
        else:
            calibration, why = load_calibration(name)
        ideal = None
        by_dtype = detail.get("flops_by_dtype")
        if calibration is not None:
            if by_dtype is None:
                why = ("MFU needs the FLOPs' dtypes: with flops_per_step they are unknown; "
                       "use flops='auto' to count them")
            else:
                ideal, why = ideal_ms(by_dtype, calibration)
        self._ideal_ms = ideal
        self._mfu_reason = why
        self._flops = detail
        self._flops_record = {
            "kind": "flops", **detail, "device": b.device if b is not None else "none",
            "device_name": name, "ideal_ms": ideal, "calibration": calibration,
            "unavailable": {} if ideal is not None else {"ideal_ms": why},
        }

    def _collect_loop(self) -> None:
        """The collector thread: every ``_collect_every_s``, write completed steps."""
        assert self._collect_every_s is not None
        while not self._stop.wait(self._collect_every_s):
            with self._harvest_lock:
                try:
                    self._harvest()
                except Exception as e:  # noqa: BLE001 - reported from the training thread
                    self._collector_error = (
                        f"stepprof stopped writing records after an internal error: "
                        f"{type(e).__name__}: {e}"
                    )
                    return

    def _drain(self) -> None:
        """Write every completed step now, from the calling thread (never waits on the device)."""
        with self._harvest_lock:
            self._harvest()

    def _warn_async(self) -> None:
        """Warn, from the training thread, about what went wrong on the collector thread."""
        for why in (self._collector_error, self._writer.failed if self._writer else None):
            if why is not None and why not in self._warned:
                self._warned.add(why)
                warnings.warn(f"stepprof: {why}; logging stopped", RuntimeWarning, stacklevel=4)

    # -- harvesting ----------------------------------------------------------

    def _harvest(self) -> None:
        """Write every pending step, oldest first, whose events have all completed.

        The records are written together at the end, in one system call.
        """
        if self._exchange is not None:
            self._exchange.poll(self._write)
        pending = self._pending
        if not pending:
            return
        self._batch = []
        try:
            while pending:
                s = pending[0]
                b = s.backend
                if not b.is_done(s.end_mark):
                    return
                for total in s.phases.values():
                    for _, end in total.marks:
                        if not b.is_done(end):  # a phase on another stream, still running
                            return
                pending.popleft()
                self._finalize(s, b)
        finally:
            batch, self._batch = self._batch, None
            if batch and self._writer is not None:
                self._writer.write_many(batch)

    def _elapsed(self, b: Backend, start: Any, end: Any) -> float | None:
        if start is None or end is None:
            return None
        try:
            return b.elapsed_ms(start, end)
        except RuntimeError:
            return None

    def _finalize(self, s: _Step, b: Backend) -> None:
        unavailable: dict[str, str] = {}
        wall_ms = (s.t1 - s.t0) / 1e6
        gpu_ms = self._elapsed(b, s.start_mark, s.end_mark)
        if gpu_ms is None:
            unavailable["gpu_ms"] = unavailable["gpu_busy"] = b.gpu_reason or _NO_EVENT
        phases: dict[str, dict[str, Any]] = {}
        for key, total in s.phases.items():
            pg: float | None = 0.0
            for start, end in total.marks:
                ms = self._elapsed(b, start, end)
                if ms is None:
                    pg = None
                elif pg is not None:
                    pg += ms
            phases[key] = {
                "wall_ms": total.wall_ns / 1e6,
                "gpu_ms": pg,
                "peak_allocated_bytes": total.peak if total.peak >= 0 else None,
                "count": total.count,
                "syncs": total.syncs if s.syncs is not None else None,
            }
            if pg is None:
                unavailable["phases.gpu_ms"] = b.gpu_reason or _NO_EVENT
            if total.peak < 0:
                unavailable["phases.peak_allocated_bytes"] = b.memory_reason or (
                    self._phase_peaks_why if not s.phase_peaks else "not read"
                )
        released: set[int] = set()  # top-level phases share boundary events
        if self._exchange is not None:
            self._window_add(s, b, gpu_ms, wall_ms, phases, released)
        for pair in [(s.start_mark, s.end_mark)] + [m for t in s.phases.values() for m in t.marks]:
            for m in pair:
                if m is not None and id(m) not in released:
                    released.add(id(m))
                    b.release(m)
        peak = s.peak if s.peak >= 0 else None
        if peak is None:
            unavailable["peak_allocated_bytes"] = b.memory_reason or "not read"
        if s.reserved is None:
            unavailable["reserved_bytes"] = b.memory_reason or "not read"
        gpu_busy = gpu_ms / wall_ms if gpu_ms is not None and wall_ms > 0 else None
        if gpu_busy is None and gpu_ms is not None:
            unavailable["gpu_busy"] = "wall time was zero"
        samples_per_s = None
        if s.batch_size is None:
            unavailable["samples_per_s"] = "no batch_size was given"
        else:
            span_ms = max(wall_ms, gpu_ms or 0.0)
            if span_ms > 0:
                samples_per_s = s.batch_size / (span_ms / 1e3)
            else:
                unavailable["samples_per_s"] = "step took no measurable time"
        overhead_us = s.overhead_ns / 1e3
        record: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "kind": "step",
            "step": s.index,
            "name": s.name,
            "warmup": s.warmup,
            "device": b.device,
            "start_unix_s": self._unix0 + (s.t0 - self._clock0) / 1e9,
            "wall_ms": wall_ms,
            "gpu_ms": gpu_ms,
            "gpu_busy": gpu_busy,
            "peak_allocated_bytes": peak,
            "reserved_bytes": s.reserved,
            "batch_size": s.batch_size,
            "samples_per_s": samples_per_s,
            "phases": phases,
            "overhead_us": overhead_us,
            "error": s.error,
            "syncs": s.syncs,
            "allocator": dict(zip(ALLOCATOR_COUNTERS, s.counters)) if s.counters else None,
            "unavailable": unavailable,
        }
        if s.syncs is None:
            unavailable["syncs"] = s.syncs_reason or "not counted"
            if phases:
                unavailable["phases.syncs"] = unavailable["syncs"]
        if s.counters is None:
            if b.memory_reason is not None:
                unavailable["allocator"] = (
                    f"{b.gpu_reason or b.memory_reason}: the counters are CUDA's caching allocator's"
                )
            else:
                unavailable["allocator"] = (
                    "this torch's allocator stats lack the counters" if s.peak >= 0 else "not read"
                )
        if isinstance(b, HostBackend):
            record["host_rss_bytes"] = s.rss
            if s.rss is None:
                unavailable["host_rss_bytes"] = "psutil could not read this process's RSS"
        if self._flops_mode is not None:
            self._add_flops(s, record, unavailable, max(wall_ms, gpu_ms or 0.0))
        self._write(record)
        f = self._flops
        if self._flops_record is not None and (f is None or s.index >= (f.get("step") or 0)):
            flops_record, self._flops_record = self._flops_record, None
            self._write(flops_record)
        self._peak_seen = max(self._peak_seen, s.peak)
        if self._memory_snaps:
            self._write_memory(s.index)

        self._n_steps += 1
        if s.warmup:
            self._n_warm += 1
            return
        if s.error is not None:
            self._n_err += 1
            return
        self._wall.append(wall_ms)
        self._ovh.append(overhead_us)
        if gpu_ms is not None:
            self._gpu.append(gpu_ms)
        else:
            self._reasons.setdefault("gpu_ms", unavailable["gpu_ms"])
        if gpu_busy is not None:
            self._busy.append(gpu_busy)
        else:
            self._reasons.setdefault("gpu_busy_median", unavailable["gpu_busy"])
        if samples_per_s is not None:
            self._sps.append(samples_per_s)
        else:
            self._reasons.setdefault("samples_per_s", unavailable["samples_per_s"])
        if peak is not None:
            self._peak_max = peak if self._peak_max is None else max(self._peak_max, peak)
        else:
            self._reasons.setdefault("peak_allocated_bytes", unavailable["peak_allocated_bytes"])
        if s.syncs is not None:
            self._sync_counts.append(s.syncs["count"])
        else:
            self._reasons.setdefault("syncs_per_step_median", unavailable["syncs"])

    def _add_flops(
        self, s: _Step, record: dict[str, Any], unavailable: dict[str, str], span_ms: float
    ) -> None:
        f = self._flops
        # Also a step whose count failed or raised: it ran eagerly under the counter.
        counted = s.index in self._under_counter
        if f is None or (f.get("step") is not None and s.index < f["step"]):
            why = (self._flops_reason if f is None
                   else f"FLOPs were counted at step {f['step']}, after this one")
            record["flops"] = record["tflops_per_s"] = record["mfu"] = None
            unavailable["flops"] = unavailable["tflops_per_s"] = unavailable["mfu"] = why
            if counted:
                record["flops_counted"] = True  # its times include FlopCounterMode's own cost
            return
        flops = f["flops_per_step"]
        record["flops"] = flops
        record["tflops_per_s"] = tflops = flops / (span_ms * 1e-3) / 1e12 if span_ms > 0 else None
        if tflops is None:
            unavailable["tflops_per_s"] = "step took no measurable time"
        ideal = self._ideal_ms
        record["mfu"] = mfu = ideal / span_ms if ideal is not None and span_ms > 0 else None
        if mfu is None:
            unavailable["mfu"] = self._mfu_reason or "step took no measurable time"
        if counted:
            record["flops_counted"] = True  # its times include FlopCounterMode's own cost
        elif not s.warmup and s.error is None:
            if tflops is not None:
                self._tflops.append(tflops)
            if mfu is not None:
                self._mfu.append(mfu)

    # -- memory records ----------------------------------------------------------

    def _snapshot_memory(self, step: _Step, b: Backend) -> None:
        """At the exit of a step due a memory record: read now; the collector reconciles."""
        self._memory_due = step.index + self.memory_every if self.memory_every else _NEVER
        if b.memory_reason is not None:
            return  # on the host there is no GPU memory to reconcile
        trigger = _memory.AFTER_WARMUP if step.index == self.warmup else _memory.PERIODIC
        try:
            _memory.observe(b)  # no-op once the baseline exists
            snap: Snapshot | str = _memory.take_snapshot(b)
        except Exception as e:  # noqa: BLE001 - a missing record, never a stopped recorder
            snap = f"reading memory failed: {type(e).__name__}: {e}"
        self._memory_snaps[step.index] = (trigger, snap)

    def _write_memory(self, index: int) -> None:
        """On the collector: the memory record of step ``index``, right after its step record."""
        item = self._memory_snaps.pop(index, None)
        if item is None:
            return
        trigger, snap = item
        device = self._backend.device if self._backend is not None else "none"
        try:
            if isinstance(snap, str):
                rep = _memory.unavailable_report(device, snap, trigger=trigger, step=index)
            else:
                rep = _memory.build(snap, trigger=trigger, step=index, peak_floor=self._peak_seen)
        except Exception as e:  # noqa: BLE001 - a missing record, never a stopped collector
            rep = _memory.unavailable_report(
                device, f"reconciling failed: {type(e).__name__}: {e}", trigger=trigger, step=index
            )
        self._write(rep.to_record())

    def _write_close_memory(self) -> None:
        b = self._backend
        if b is None or b.memory_reason is not None or self._broken is not None:
            return
        step = self._next_index - 1 if self._next_index else None
        rep = _memory.report(b, trigger=_memory.CLOSE, step=step, peak_floor=self._peak_seen)
        self._write(rep.to_record())

    def _known_peak(self) -> int:
        """The highest step peak so far: written steps, pending ones and the open one."""
        peaks = [self._peak_seen, *(s.peak for s in tuple(self._pending))]
        if self._step is not None:
            peaks.append(self._step.peak)
        return max(peaks)

    def _memory_report(self, device: torch.device | None) -> MemoryReport:
        """:func:`stepprof.memory_report` while this profiler is active: report, and log it."""
        own = self._backend
        if own is not None and own.memory_reason is None and (
            device is None or (device.type == "cuda" and (device.index is None or own.device == str(device)))
        ):
            b, floor = own, self._known_peak()
        else:
            b, floor = memory_backend(device), -1
        step = self._next_index - 1 if self._next_index else None
        rep = _memory.report(b, trigger=_memory.ON_DEMAND, step=step, peak_floor=floor)
        if self._summary is None:
            with self._harvest_lock:
                try:
                    self._harvest()  # completed steps first, so the log stays in order
                except Exception:  # noqa: BLE001, S110 - the collector meets and reports it too
                    pass
                self._write(rep.to_record())
        return rep

    # -- summary, logging, failure --------------------------------------------

    def _build_summary(self) -> Summary:
        reasons = dict(self._reasons)
        measured = self._n_steps - self._n_warm - self._n_err
        if measured == 0:
            why = "no measured steps (all were warm-up, failed, or none ran)"
            for f in ("wall_ms", "gpu_ms", "gpu_busy_median", "peak_allocated_bytes_max",
                      "samples_per_s_median", "overhead_us_median", "syncs_per_step_median"):
                reasons.setdefault(f, why)
        if self._broken is not None:
            reasons["stepprof"] = self._broken
        if self._collector_error is not None:
            reasons["stepprof"] = self._collector_error
        if "gpu_ms" in reasons:
            reasons.setdefault("gpu_busy_median", reasons["gpu_ms"])
        if "samples_per_s" in reasons:
            reasons.setdefault("samples_per_s_median", reasons.pop("samples_per_s"))
        if "peak_allocated_bytes" in reasons:
            reasons.setdefault("peak_allocated_bytes_max", reasons.pop("peak_allocated_bytes"))
        if self._writer is not None and self._writer.failed:
            reasons["log"] = self._writer.failed
        busy = Percentiles.of(self._busy)
        sps = Percentiles.of(self._sps)
        ovh = Percentiles.of(self._ovh)
        syncs = Percentiles.of(self._sync_counts)
        mechanism = getattr(self._backend, "sync_mechanism", None)
        tflops, mfu = Percentiles.of(self._tflops), Percentiles.of(self._mfu)
        if self._flops_mode is None:
            reasons["tflops_per_s_median"] = reasons["mfu_median"] = (
                "FLOPs were not requested: pass Profiler(flops='auto') or flops_per_step=N"
            )
        else:
            if not tflops:
                reasons["tflops_per_s_median"] = (
                    self._flops_reason if self._flops is None else "no measured step after the counted one"
                )
            if not mfu:
                reasons["mfu_median"] = (
                    reasons["tflops_per_s_median"] if not tflops else self._mfu_reason or "not computed"
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
            device=self._backend.device if self._backend is not None else "none",
            wall_ms=Percentiles.of(self._wall),
            gpu_ms=Percentiles.of(self._gpu),
            gpu_busy_median=busy.median if busy else None,
            peak_allocated_bytes_max=self._peak_max,
            samples_per_s_median=sps.median if sps else None,
            overhead_us_median=ovh.median if ovh else None,
            log=self.log,
            syncs_per_step_median=syncs.median if syncs else None,
            sync_mechanism=mechanism if self._sync_counts else None,
            tflops_per_s_median=tflops.median if tflops else None,
            mfu_median=mfu.median if mfu else None,
            unavailable=reasons,
        )

    def _write(self, record: dict[str, Any]) -> None:
        if self._writer is not None:
            if "schema_version" not in record:
                record = {"schema_version": SCHEMA_VERSION, **record}
            if self._rank_fields is not None:
                # A ranks record keeps its own world_size: its group's (the same by default).
                record.update({k: v for k, v in self._rank_fields.items() if k not in record})
            if self._batch is not None:  # inside _harvest: written with the others
                self._batch.append(record)
            else:
                self._writer.write(record)

    # -- distributed: the exchange's window and its step count -------------------

    def _window_add(self, s: _Step, b: Backend, gpu_ms: float | None, wall_ms: float,
                    phases: dict[str, dict[str, Any]], released: set[int]) -> None:
        """Add a finalised step to the exchange window; keep its end event for the next gap."""
        prev, self._gap_from = self._gap_from, (s.end_mark, s.t1)
        released.add(id(s.end_mark))  # released as the next step's gap start
        gap = None
        if prev is not None:
            if prev[0] is not None and s.start_mark is not None:
                gap = self._elapsed(b, prev[0], s.start_mark)
            elif isinstance(b, HostBackend):
                gap = (s.t0 - prev[1]) / 1e6
            b.release(prev[0])
        if s.warmup or s.error is not None:
            return
        key = "gpu_ms" if gpu_ms is not None else "wall_ms"
        top = {k: v[key] for k, v in phases.items() if "/" not in k}
        self._exchange.window.add(  # type: ignore[union-attr]
            gpu_ms, wall_ms, s.peak if s.peak >= 0 else None,
            s.syncs["count"] if s.syncs is not None else None, gap, top)

    def _unrecorded_step(self) -> Any:
        """After an internal error: still count steps, so that the exchanges stay matched."""
        ex = self._exchange
        if ex is None or ex.unrecorded_open:
            return None  # a phase of the unrecorded step
        ex.unrecorded_open = True
        return _UNRECORDED

    def _exchange_anyway(self, token: Any) -> None:
        """Exit of a step that recording dropped: take part in its exchange all the same."""
        ex = self._exchange
        assert ex is not None
        if token is _UNRECORDED:
            ex.unrecorded_open = False
        elif not isinstance(token, _Step):
            return  # a phase
        else:
            ex.unrecorded_open = False  # the step that was open when recording stopped
            if ex.exits != token.index:
                return  # its exchange already ran
        try:
            ex.step_exit(None if token is _UNRECORDED else token.index, getattr(self._backend, "index", None))
        except Exception:  # noqa: BLE001, S110 - Exchange warns about its own failures
            pass

    def _forked(self) -> None:
        """In a forked child: drop the parent's state and record nothing more (see above)."""
        self._broken = _INHERITED.format(pid=os.getpid())
        self._pending = deque()
        self._memory_snaps = {}
        self._batch = None
        self._step = None
        self._stack = []
        self._exchange = None
        self._collector = None
        self._stop = threading.Event()
        self._harvest_lock = threading.Lock()
        self._close_lock = threading.RLock()
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()  # the child's copy of the descriptor; the parent's stays open

    def _fail(self, exc: BaseException) -> None:
        """An internal failure: stop recording, keep training, say so once."""
        self._unwatch()
        if self._flop_count is not None:
            self._stop_counting(f"recording stopped during the counted step: {type(exc).__name__}: {exc}")
        if self._broken is None:
            self._broken = f"stepprof stopped recording after an internal error: {type(exc).__name__}: {exc}"
            warnings.warn(self._broken, RuntimeWarning, stacklevel=3)
        b = self._backend
        if b is not None:  # close the NVTX ranges this step had opened
            for _ in range(len(self._stack) + (self._step is not None)):
                try:
                    b.range_pop()
                except Exception:  # noqa: BLE001
                    break
        if self._step is not None and self._exchange is not None:
            # The step stays open for the exchange until its own exit: the phases entered
            # in it from now on are not steps of their own.
            self._exchange.unrecorded_open = True
        self._step = None
        self._stack.clear()


def _message(exc: BaseException) -> str:
    """The user's exception's message for a step's ``error``, truncated to 2000 characters."""
    try:
        return str(exc)[:2000]
    except Exception as e:  # noqa: BLE001 - its own __str__ failing is the user's, not ours
        return f"<unprintable {type(exc).__name__}: its __str__ raised {type(e).__name__}>"
