"""The profiler: :class:`Profiler`, a facade over the recorder (:mod:`stepprof._recorder`).

Data flows one way: the boundaries (``_recorder.boundaries``) measure each step on the
training thread and queue it; the collector (``_recorder.collector``) turns completed
steps into records off that thread and hands them to the sinks (``_recorder.sinks``: the
log and the summary).  FLOP counting, memory records, the cross-rank exchange and the
compile counts are hooks (``_recorder.hooks``).  This module holds only the facade that wires them together;
the settings are checked in :mod:`stepprof._options`, the scopes are in :mod:`stepprof._scopes`.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from typing import Any

import torch

from .. import _dist, _memory
from .._device.select import check_compiled, memory_backend
from .._memory import MemoryReport
from .._options import ENERGY_EVERY_S, FLUSH_EVERY_S, ProfilerOptions
from .._records import Summary
from .._registry import HOST_RSS, forget_open, pop_active, push_active, track_open
from .._batch import NO_BATCH, infer_batch_size, total_batch_size
from .._scopes import Iterated, StepScope, iterate_over, make_measure
from .._syncs import NOT_WATCHED
from .._errors import UsageError, raised_by_user
from .._validate import (
    MEMORY_EVERY, PHASE_PEAKS_EVERY, check_batch_size, check_budget, check_callable, check_group, check_name,
    check_seconds,
)
from .boundaries import Boundaries
from .collector import Collector
from .energy import ENERGY_OFF, EnergyHook
from .compiles import CompileHook
from .exchange import ExchangeHook
from .flops import FlopsHook
from .hooks import Closing, Hook
from .memory_records import MemoryHook
from .peak import PeakHook
from .seams import REAL, Seams
from .sinks import LogSink, SummarySink
from .watch import Watcher, WatchHook

__all__ = ["Profiler"]


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
        flush_every_s: the most the log may lag behind the training thread: a step whose
            device events have completed is written within this many seconds of its exit,
            which bounds what a ``kill -9`` loses (docs/reliability.md).
        boundary: where each boundary's device work (event record, allocator read, peak
            reset, NVTX) is done: ``"auto"`` (one compiled C++ call if ``stepprof build`` has
            built it for this torch and CUDA, else Python), ``"compiled"`` (raises
            :class:`stepprof.ConfigError` if it is not built) or ``"python"``.
        overhead_budget: keep stepprof's measured cost (``overhead_us``) within this fraction
            of the median step time, e.g. ``0.01``: every step still gets its wall time and
            sync count, and GPU time, peaks and phases are taken on one step in an interval
            chosen from the measured costs (those records say ``sampled``).  None (the
            default): every step in full.
        energy_every_s: on CUDA, how often a background thread reads the GPU's energy counter
            (NVML), in seconds; the step records then carry ``energy_j``, the energy of their
            span (interpolated between samples: exact over a run of steps, an estimate for
            one; docs/measurement.md).  A step's record waits for the sample after it, so the
            log may lag by this much more.  None turns it off.
        explain_peak: explain where one step's peak memory comes from (docs/memory.md):
            True explains the first step after warm-up (the one after it with
            ``flops="auto"``, whose counted step that is), an int the step of that index.
            For that step only, torch's allocator records its history; a ``kind: "peak"``
            record follows the step's with the live bytes at the peak by category
            (parameters, gradients, optimizer state, activations, temporaries, other),
            by module, the phase and the op.  CUDA only (elsewhere the record says why).
        model, optimizer: the model and optimizer ``explain_peak`` names parameters,
            gradients, optimizer state and modules from.  Without them those bytes count
            as other or temporaries, and no module is named.

    Example:
        >>> import stepprof, torch
        >>> with stepprof.Profiler(None, warmup=0) as prof:
        ...     with prof.step(batch_size=32):
        ...         with prof.measure("forward"):
        ...             y = torch.ones(32, 8).sum()
        >>> prof.summary.measured_steps
        1
    """

    #: The replaceable parts: the private ``_seams`` argument (tests and benchmarks pass
    #: others through :func:`_make_profiler`).
    _seams: Seams
    # The scopes enter and exit steps and phases through these: the boundaries' own
    # methods, bound once in __init__ (a method here that forwarded to them would add
    # a call to every boundary).
    _enter: Any
    _exit: Any

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
        flush_every_s: float = FLUSH_EVERY_S,
        boundary: str = "auto",
        overhead_budget: float | None = None,
        energy_every_s: float | None = ENERGY_EVERY_S,
        explain_peak: bool | int = False,
        model: Any = None,
        optimizer: Any = None,
        _seams: Seams = REAL,
    ) -> None:
        options = ProfilerOptions(  # every argument is checked before the log is opened
            log, warmup=warmup, device=device, nvtx=nvtx, syncs=syncs, max_syncs=max_syncs,
            on_sync=on_sync, memory_every=memory_every, phase_peaks_every=phase_peaks_every,
            flops=flops, flops_per_step=flops_per_step, ranks_every=ranks_every,
            log_ranks=log_ranks, group=group, flush_every_s=flush_every_s, boundary=boundary,
            overhead_budget=overhead_budget, energy_every_s=energy_every_s,
            explain_peak=explain_peak, model=model, optimizer=optimizer,
        )
        self._options = options
        check_compiled(options.boundary)  # "compiled" that is not built: refused before the log opens
        log, device, nvtx, syncs = options.log, options.device, options.nvtx, options.syncs
        flops_mode, given = options.flops, options.flops_per_step
        ranks_every, log_ranks = options.ranks_every, options.log_ranks
        self.warmup = options.warmup
        self.max_syncs = options.max_syncs
        self.on_sync = options.on_sync
        self.memory_every = options.memory_every
        self.phase_peaks_every = options.phase_peaks_every
        self.flush_every_s = options.flush_every_s
        self.boundary = options.boundary
        self.overhead_budget = options.overhead_budget
        self.energy_every_s = options.energy_every_s
        ident = _dist.identify()
        group = check_group(options.group, ident, ranks_every)
        # -- wiring: boundaries -> pending -> collector -> record -> sinks ---------------
        seams = self._seams = _seams
        # Distributed: rank fields on every record, a log per rank, the exchange.
        if ident is not None and log is not None:
            log = None if log_ranks == "zero" and ident.rank else _dist.rank_log_path(os.fspath(log), ident.rank)
        run_id = secrets.token_hex(6)  # this writer's identity, on every record it writes
        self._log = LogSink(log, ident.fields() if ident is not None else None, run_id)
        self.log = self._log.path
        self._summary_sink = SummarySink(run_id)
        self._summary: Summary | None = None
        self._ended_by: str | None = None  # a signal's name, once one arrived
        self._signal_written = -1  # the log's record count after the signal's summary
        clock = seams.clock
        every = seams.collect_every_s
        self._collector = Collector(
            self._log, self._summary_sink, clock0_ns=clock(), unix0_s=time.time(),
            phase_peaks_every=self.phase_peaks_every,
            collect_every_s=None if every is None else min(every, self.flush_every_s),
            # The collector's own work is timed in its thread's CPU time: its wall time would
            # also count the stretches it waits for the GIL while the training thread runs.
            cost_clock=time.thread_time_ns if clock is REAL.clock else clock,
            overhead_budget=self.overhead_budget, flush_every_ns=round(self.flush_every_s * 1e9),
        )
        self._boundaries = b = Boundaries(
            self._collector, options.capture, options.sync, backend=seams.backend, clock=clock,
            read_rss=HOST_RSS.read,
        )
        self._enter = b.enter
        self._exit = b.exit
        # Optional behaviour: a hook each, in the order their records follow a step's.
        self._flops = (
            FlopsHook(given, warmup=self.warmup, backend=seams.backend, retire=b.hooks.retire)
            if flops_mode is not None or given is not None else None
        )
        self._memory = MemoryHook(warmup=self.warmup, every=self.memory_every, retire=b.hooks.retire)
        self._exchange = exchange = (
            ExchangeHook(_dist.Exchange(ranks_every, ident, group=group, gather=seams.gather,
                                        close_wait_s=seams.close_wait_s, budget=self._collector.budget),
                         self._collector.harvest_if_free)
            if ident is not None and ranks_every else None
        )
        if exchange is not None and self._collector.budget is not None:
            self._collector.budget.shared = True  # the ranks agree on the interval
        self._energy = EnergyHook(self.energy_every_s, clock) if self.energy_every_s is not None else None
        self._compiles = CompileHook(b.threads.step_of, lambda: b.next_index, b.hooks.retire)
        explain = options.explain_peak
        self._peak = (
            # True: the first measured step, or the next one if FLOPs are counted on the first.
            PeakHook(self.warmup + (flops_mode == "auto") if explain is True else explain, model=options.model,
                     optimizer=options.optimizer, ensure_backend=b.slot.ensure,
                     watch_phases=b.watch_phases, retire=b.hooks.retire)
            if explain is not False else None
        )
        hooks: list[Hook] = [
            h for h in (self._flops, self._memory, self._peak, exchange, self._energy, self._compiles)
            if h is not None
        ]
        self._hooks = hooks
        b.use(hooks)
        self._collector.use(hooks)
        self._close_lock = threading.RLock()  # one close(): a concurrent one waits for it
        # begin_step/begin_phase's tokens, per thread: [(name, token), ...], the step's first.
        self._begun: dict[int, list[tuple[str | None, Any]]] = {}
        track_open(self)

    # -- public -------------------------------------------------------------

    def step(
        self,
        name: str | None = None,
        *,
        batch_size: int | None = None,
        max_syncs: int | None = None,
        on_sync: str | None = None,
        batch: Any = NO_BATCH,
    ) -> StepScope:
        """A context manager around one training step.

        Args:
            name: the step's name in the log (default ``"step"``).
            batch_size: samples in the step; enables ``samples_per_s``.
            max_syncs, on_sync: this step's sync budget and policy (default: the
                profiler's).
            batch: the step's batch, to infer ``batch_size`` from (see
                :func:`stepprof.profile_step`).
        """
        return StepScope(self, check_name(name), check_batch_size(batch_size),
                         *check_budget(max_syncs, on_sync), batch=batch)

    # -- the same without context managers: for code that only has hooks ------------------

    def begin_step(self, batch_size: int | None = None, name: str | None = None, *, batch: Any = NO_BATCH) -> None:
        """Open a step on this thread, as ``with prof.step(...)`` would; :meth:`end_step` closes it.

        For code that only has hooks (a framework's callbacks).  Arguments as for :meth:`step`.
        """
        begun = self._begun.get(threading.get_ident())
        if begun:
            raise UsageError(
                "begin_step() was called while the step begun before is still open on this thread; "
                "call prof.end_step() first"
            )
        name, batch_size, reason = check_name(name), check_batch_size(batch_size), None
        if batch_size is None and batch is not NO_BATCH:  # an explicit batch_size wins
            batch_size, reason = infer_batch_size(batch)
        token = self._enter(name, batch_size, step=True, batch_reason=reason)
        self._begun[threading.get_ident()] = [(name, token)]

    def end_step(self, error: BaseException | None = None) -> None:
        """Close the step :meth:`begin_step` opened on this thread, and any phase still open in it.

        Args:
            error: the exception the step raised, recorded as its ``error``; None when it
                completed.
        """
        if error is not None and not isinstance(error, BaseException):
            raise UsageError(
                f"end_step(error=...) takes the exception the step raised, or None (got {error!r}); "
                f"pass e.g. end_step(error=exc) in an except block"
            )
        begun = self._begun.pop(threading.get_ident(), None)
        if not begun:
            raise UsageError("end_step() without begin_step() on this thread; call prof.begin_step() first")
        self._exit(begun[0][1], error)  # the step's exit closes the phases left open in it

    def begin_phase(self, name: str) -> None:
        """Open a phase of the step begun on this thread, as ``with prof.measure(name)`` would."""
        begun = self._begun.get(threading.get_ident())
        checked = check_name(name)
        if checked is None:
            raise UsageError("begin_phase() needs a name: prof.begin_phase('forward')")
        if not begun:
            raise UsageError(
                f"begin_phase({checked!r}) outside a step: call prof.begin_step() first"
            )
        begun.append((checked, self._enter(checked, None, step=False)))

    def end_phase(self, name: str | None = None) -> None:
        """Close the innermost phase :meth:`begin_phase` opened on this thread (``name``, if
        given, must be its name)."""
        begun = self._begun.get(threading.get_ident())
        if not begun or len(begun) == 1:
            raise UsageError("end_phase() without begin_phase() in the step begun on this thread")
        open_name = begun[-1][0]
        if name is not None and name != open_name:
            raise UsageError(
                f"end_phase({name!r}), but the innermost open phase is {open_name!r}; "
                f"end {open_name!r} first"
            )
        self._exit(begun.pop()[1], None)

    def add_batch(self, *batches: Any, fetch_s: float | None = None) -> None:
        """The batches a step trains on, for code that fetches them where :meth:`iterate` cannot
        wrap (a framework's hooks; gradient accumulation's micro-batches).

        Inside a step open on this thread, their samples (the tensors' first dimension, as
        for ``profile_step(batch=...)``) add to its ``batch_size``; outside one they are the
        next step's, as :meth:`iterate`'s are, and ``fetch_s``, the seconds fetching them took,
        adds to its ``data_ms``.  A batch whose size cannot be inferred makes ``batch_size``
        null, with the reason.

        Example:
            >>> prof = stepprof.Profiler(None)                      # doctest: +SKIP
            >>> prof.begin_step()                                   # doctest: +SKIP
            >>> for micro in micro_batches:                         # doctest: +SKIP
            ...     prof.add_batch(micro); loss_of(micro).backward()
            >>> prof.end_step()                                     # doctest: +SKIP
        """
        if not batches:
            raise UsageError("add_batch() needs a batch: prof.add_batch(batch), or several: prof.add_batch(*micro_batches)")
        fetch_ns = None if fetch_s is None else round(check_seconds(fetch_s, "fetch_s", allow_zero=True) * 1e9)
        if self._summary is not None or self._boundaries.broken is not None:
            return
        size, reason = total_batch_size(batches)
        step = self._boundaries.threads.step()
        if step is None:
            self._boundaries.note_batch(fetch_ns, (size, reason))
        elif step.batch_size is not None or step.batch_reason is None:  # else a batch had no size
            if size is None:
                step.batch_size, step.batch_reason = None, reason
            else:
                step.batch_size = (step.batch_size or 0) + size

    def measure(self, name: Any = None) -> Any:
        """Like :func:`stepprof.measure`, but recording into this profiler."""
        return make_measure(name, self)

    def iterate(self, iterable: Any) -> Iterated:
        """Like :func:`stepprof.iterate`, but recording into this profiler."""
        return iterate_over(iterable, self)

    def watch(self, watcher: Watcher) -> None:
        """Call ``watcher(record)`` with each step record as it is written, on stepprof's
        collector thread (the framework callbacks' logged medians come from here).

        ``watcher`` must return quickly and leave the record as it is; an exception it
        raises is a warning, and it is not called again.
        """
        check_callable(watcher, "watcher", "e.g. prof.watch(records.append)")
        with self._collector.lock:
            hook = next((h for h in self._hooks if isinstance(h, WatchHook)), None)
            if hook is None:
                hook = WatchHook()
                self._hooks.append(hook)  # the last record hook: it sees the finished record
                self._collector.use(self._hooks)
            hook.add(watcher)

    def _note_batch(self, data_ns: int, item: Any) -> None:
        """:func:`stepprof.iterate` fetched ``item`` in ``data_ns``: for this thread's next step."""
        if self._summary is None and self._boundaries.broken is None:
            self._boundaries.note_batch(data_ns, infer_batch_size(item))

    @property
    def summary(self) -> Summary | None:
        """The summary once :meth:`close` has run, else None."""
        return self._summary

    @property
    def closed(self) -> bool:
        return self._summary is not None

    def flush(self) -> None:
        """Write every step whose device work has completed, now, from the calling thread.

        It never waits on the device: a step still running on the GPU is written by a later
        flush, the collector thread, or :meth:`close`.  A framework callback calls it at each
        logging step, before it reads its window of figures.
        """
        self._collector.drain()

    def close(self, error: BaseException | None = None) -> Summary:
        """Wait for the pending steps' events, write every record and the summary, close the log.

        Args:
            error: the exception that ended the run, if one did (the summary's ``ended_by``
                is then ``"exception"``, as when it propagates out of ``with Profiler(...)``).

        Calling it again returns the same summary.
        """
        return self._end("close" if error is None else "exception")

    def _end(self, ended_by: str) -> Summary:
        """:meth:`close`, saying how the run ended (``"close"``, ``"exception"``, ``"exit"``)."""
        if self._summary is not None:
            return self._summary
        with self._close_lock:
            if self._summary is not None:  # another thread closed it meanwhile
                return self._summary
            return self._close(self._ended_by or ended_by)

    def _close(self, ended_by: str) -> Summary:
        b, collector = self._boundaries, self._collector
        try:
            ctx = b.context()
            if ctx.step is not None:
                b.end_step(ctx, ctx.step, RuntimeError("profiler closed while the step was open"))
        except Exception as e:  # noqa: BLE001 - close must always produce a summary
            if raised_by_user(e):
                raise
            b.fail(e)
        # From here on, other threads' steps neither start nor write: close writes what
        # was pending when it began, and returns while they go on.
        b.closing = True
        collector.stop()
        with collector.lock:  # held to the end: no harvest writes to a log being closed
            try:
                collector.finish()
            except Exception as e:  # noqa: BLE001 - close must always produce a summary
                if raised_by_user(e):
                    raise
                b.fail(e)
            collector.pending.clear()
            closing = Closing(collector.write, b.backend, b.next_index - 1 if b.next_index else None,
                              b.broken is not None)
            for hook in self._hooks:
                hook.on_close(closing)
            self._end_syncs()
            self._summary = self._build_summary(ended_by)
            b.closed = True
            if self._log.count != self._signal_written:  # else the signal's summary says it all
                self._log.write(self._summary.to_record())
            self._log.close()
        collector.warn_async()
        forget_open(self)
        return self._summary

    def _end_syncs(self, report: bool = True) -> None:
        """End the backend's sync session: the process's sync state comes back (unless
        another profiler's session holds it).  A failure stops recording, if ``report``."""
        b = self._boundaries.backend
        try:
            if b is not None:
                b.end_syncs()
        except Exception as e:  # noqa: BLE001 - close must always produce a summary
            if raised_by_user(e):
                raise
            if report:
                self._boundaries.fail(e)

    def _build_summary(self, ended_by: str) -> Summary:
        b = self._boundaries.backend
        return self._summary_sink.summary(
            log=self.log,
            ended_by=ended_by,
            device=b.device if b is not None else "none",
            stopped=self._collector.error or self._boundaries.broken,
            log_failed=self._log.failed,
            flops_reason=self._flops.summary_reason() if self._flops is not None else None,
            boundary=b.boundary if b is not None and b.has_device_timing else None,
            budget_unmet=self._collector.budget.unmet if self._collector.budget is not None else None,
            syncs_outside=b.syncs_outside_steps() if b is not None else (None, NOT_WATCHED),
            energy_reason=ENERGY_OFF if self._energy is None else None,
            boundary_reason=self._boundaries.slot.reason(),
        )

    def __enter__(self) -> Profiler:
        push_active(self)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        pop_active(self)
        self.close(exc)

    def _on_signal(self, name: str) -> None:
        """SIGTERM or SIGINT arrived (main thread): write the completed steps and a summary.

        The profiler stays open: if the process goes on, later steps are recorded, and
        :meth:`close` writes a summary again if anything was written since.
        """
        if self._summary is not None or self._log.writer is None or self._boundaries.broken:
            self._ended_by = self._ended_by or name
            return
        self._ended_by = self._ended_by or name
        collector = self._collector
        # The collector thread holds this lock only while it writes; the interrupted
        # training thread may hold it too (an inline harvest), so wait a little, no more.
        locked = collector.lock.acquire(timeout=0.2)
        try:
            if locked:
                try:
                    collector.harvest()  # completed steps only: never waits on the device
                except Exception as e:  # noqa: BLE001, S110 - the summary still goes out
                    if raised_by_user(e):
                        raise
            self._log.write_now(self._build_summary(self._ended_by).to_record())
            self._signal_written = self._log.count
        finally:
            if locked:
                collector.lock.release()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self._boundaries.next_index} steps"
        return f"<stepprof.Profiler log={self.log!r} warmup={self.warmup} {state}>"

    # -- used by bench/ and stepprof.memory_report() --------------------------------

    def _known_peak(self) -> int:
        """The highest step peak so far: written steps, pending ones and the open one."""
        peaks = [self._memory.peak_seen, *(s.peak for s in tuple(self._collector.pending))]
        peaks.extend(s.peak for s in self._boundaries.threads.open_steps())
        return max(peaks)

    def _memory_report(self, device: torch.device | None) -> MemoryReport:
        """:func:`stepprof.memory_report` while this profiler is active: report, and log it."""
        own = self._boundaries.backend
        if own is not None and own.has_device_memory and (
            device is None or (device.type == "cuda" and (device.index is None or own.device == str(device)))
        ):
            b, floor = own, self._known_peak()
        else:
            b, floor = memory_backend(device), -1
        n = self._boundaries.next_index
        rep = _memory.report(b, trigger=_memory.ON_DEMAND, step=n - 1 if n else None, peak_floor=floor)
        if self._summary is None:
            with self._collector.lock:
                try:
                    self._collector.harvest()  # completed steps first, so the log stays in order
                except Exception as e:  # noqa: BLE001, S110 - the collector meets and reports it too
                    if raised_by_user(e):
                        raise
                self._collector.write(rep.to_record())
        return rep

    def _forked(self) -> None:
        """In a forked child: drop the parent's state and record nothing more (see above)."""
        self._end_syncs(report=False)  # the child gets the sync-debug mode, filters, functions back
        self._collector.forget()
        self._boundaries.forget(_INHERITED.format(pid=os.getpid()))
        self._memory.forget()
        if self._energy is not None:
            self._energy.forget(_INHERITED.format(pid=os.getpid()))
        self._compiles.forget()
        self._hooks = [h for h in self._hooks if h is not self._exchange]
        self._exchange = None
        self._close_lock = threading.RLock()
        self._begun = {}
        self._log.forget()


def _make_profiler(
    log: str | os.PathLike[str] | None,
    *,
    backend: Any = None,
    clock: Any = None,
    collect_every_s: float | None = REAL.collect_every_s,
    gather: Any = None,
    close_wait_s: float = REAL.close_wait_s,
    **options: Any,
) -> Profiler:
    """A profiler with replaced parts, for tests and benchmarks (see :class:`Seams`).

    Args:
        log, options: as for :class:`Profiler`.
        backend, clock, collect_every_s, gather, close_wait_s: the :class:`Seams`; None
            for ``backend``, ``clock`` or ``gather`` keeps the profiler's own.
    """
    seams = Seams(backend=backend, clock=clock or REAL.clock, collect_every_s=collect_every_s,
                  gather=gather, close_wait_s=close_wait_s)
    return Profiler(log, **options, _seams=seams)
