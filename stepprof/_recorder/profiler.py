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
from collections.abc import Callable
from typing import Any, TypeVar, overload

import torch

from .. import _dist, _memory
from .._device.select import check_compiled, memory_backend
from .._memory import MemoryReport
from .._options import ENERGY_EVERY_S, FLUSH_EVERY_S, ProfilerOptions
from .._records import Summary
from .._registry import HOST_RSS, pop_active, push_active, track_open
from .._signals import Deferring
from .._batch import NO_BATCH, count_tokens, infer_batch_size
from .._scopes import Iterated, MeasureScope, StepScope, iterate_over, make_measure, step_scope
from .._errors import raised_by_user
from .._validate import (
    MEMORY_EVERY, PHASE_PEAKS_EVERY, check_cuda_device,
)
from .boundaries import Boundaries
from .collector import Collector
from .core import make_core
from .energy import EnergyHook
from .compiles import CompileHook
from .exchange import ExchangeHook
from .flops import FlopsHook
from .hooked import HookedSteps
from .hooks import Hook
from .lifecycle import Lifecycle
from .memory_records import MemoryHook
from .peak import PeakHook
from .seams import REAL, Seams
from .sinks import LogSink, SummarySink

__all__ = ["Profiler"]

_F = TypeVar("_F", bound=Callable[..., Any])


class Profiler(HookedSteps, Lifecycle):
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
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
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
        if _seams.backend is None:
            check_cuda_device(options.device)  # device="cuda" without CUDA: refused, not the CPU's figures
        # The settings it keeps as attributes of its own (read back: prof.warmup, ...).
        self.warmup, self.max_syncs, self.on_sync = options.warmup, options.max_syncs, options.on_sync
        self.memory_every, self.phase_peaks_every = options.memory_every, options.phase_peaks_every
        self.flush_every_s, self.boundary = options.flush_every_s, options.boundary
        self.overhead_budget, self.energy_every_s = options.overhead_budget, options.energy_every_s
        ident = _dist.identify()
        group = _dist.check_group(options.group, ident, options.ranks_every)
        # -- wiring: boundaries -> pending -> collector -> record -> sinks ---------------
        seams = self._seams = _seams
        run_id = secrets.token_hex(6)  # this writer's identity, on every record it writes
        self._log = _open_log(options, ident, run_id)
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
        self._boundaries = b = Boundaries(self._collector, options.capture, options.sync, backend=seams.backend,
                                          clock=clock, read_rss=HOST_RSS.read)
        self._bind_core()
        b.on_core = self._bind_core  # the C module built in the background: from the next boundary on
        parts = _make_hooks(options, seams, b, self._collector, ident, group)
        self._flops, self._memory, self._peak, self._exchange, self._energy, self._compiles = parts
        self._hooks = hooks = [h for h in parts if h is not None]
        b.use(hooks)
        self._collector.use(hooks)
        self._close_lock = threading.RLock()  # one close(): a concurrent one waits for it
        # begin_step/begin_phase's tokens, per thread: [(name, token), ...], the step's first.
        self._begun: dict[int, list[tuple[str | None, Any]]] = {}
        track_open(self)

    def _bind_core(self) -> None:
        """The scopes' entry and exit: the step core's (``_core.c``) once built, else the Python boundaries'."""
        b, core = self._boundaries, make_core(self._boundaries, self.boundary)
        self._core, (self._enter, self._exit) = core, (core.enter, core.exit) if core is not None else (b.enter, b.exit)

    # -- public -------------------------------------------------------------

    def step(
        self,
        name: str | None = None,
        *,
        batch_size: int | None = None,
        max_syncs: int | None = None,
        on_sync: str | None = None,
        batch: Any = NO_BATCH,
        tokens: int | None = None,
    ) -> StepScope:
        """A context manager around one training step.

        Args:
            name: the step's name in the log (default ``"step"``).
            batch_size: samples in the step; enables ``samples_per_s``.
            max_syncs, on_sync: this step's sync budget and policy (default: the
                profiler's).
            batch, tokens: the step's batch, to infer ``batch_size`` and its tokens from, and
                its tokens when given (see :func:`stepprof.profile_step`).
        """
        return step_scope(self, name, batch_size, max_syncs, on_sync, batch, tokens)

    @overload
    def measure(self, name: _F) -> _F: ...
    @overload
    def measure(self, name: str | None = None) -> MeasureScope: ...
    def measure(self, name: str | Callable[..., Any] | None = None) -> Any:
        """Like :func:`stepprof.measure`, but recording into this profiler."""
        return make_measure(name, self)

    def iterate(self, iterable: Any) -> Iterated:
        """Like :func:`stepprof.iterate`, but recording into this profiler."""
        return iterate_over(iterable, self)

    def _note_batch(self, data_ns: int, item: Any) -> None:
        """:func:`stepprof.iterate` fetched ``item`` in ``data_ns``: for this thread's next step."""
        if self._summary is None and self._boundaries.broken is None:
            self._boundaries.note_batch(data_ns, infer_batch_size(item), count_tokens(item))

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

    def __enter__(self) -> Profiler:
        push_active(self)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        pop_active(self)
        self.close(exc)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self._boundaries.next_index} steps"
        return f"<stepprof.Profiler log={self.log!r} warmup={self.warmup} {state}>"

    # -- used by bench/ and stepprof.memory_report() --------------------------------

    def _known_peak(self) -> int:
        """The highest step peak so far: written steps, pending ones and the open one."""
        peaks: list[int] = [self._memory.peak_seen, *(s.peak for s in tuple(self._collector.pending))]
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
            with Deferring(self._collector.lock), self._collector.lock:
                try:
                    self._collector.harvest()  # completed steps first, so the log stays in order
                except Exception as e:  # noqa: BLE001, S110 - the collector meets and reports it too
                    if raised_by_user(e):
                        raise
                self._collector.write(rep.to_record())
        return rep



def _make_hooks(options: ProfilerOptions, seams: Seams, b: Boundaries, collector: Collector, ident: Any,
                group: Any) -> tuple[Any, ...]:
    """The optional behaviour, a hook each (None: off), in the order their records follow a
    step's: FLOPs, memory, peak, the ranks' exchange, energy, compiles."""
    given, flops_mode = options.flops_per_step, options.flops
    flops = (
        FlopsHook(given, warmup=options.warmup, backend=seams.backend, retire=b.hooks.retire)
        if flops_mode is not None or given is not None else None
    )
    memory = MemoryHook(warmup=options.warmup, every=options.memory_every, retire=b.hooks.retire)
    exchange = (
        ExchangeHook(_dist.Exchange(options.ranks_every, ident, group=group, gather=seams.gather,
                                    close_wait_s=seams.close_wait_s, budget=collector.budget),
                     collector.harvest_if_free)
        if ident is not None and options.ranks_every else None
    )
    if exchange is not None and collector.budget is not None:
        collector.budget.shared = True  # the ranks agree on the interval
    energy = EnergyHook(options.energy_every_s, seams.clock) if options.energy_every_s is not None else None
    compiles = CompileHook(b.threads.step_of, lambda: b.next_index, b.hooks.retire)
    explain = options.explain_peak
    peak = (
        # True: the first measured step, or the next one if FLOPs are counted on the first.
        PeakHook(options.warmup + (flops_mode == "auto") if explain is True else explain, model=options.model,
                 optimizer=options.optimizer, ensure_backend=b.slot.ensure,
                 watch_phases=b.watch_phases, retire=b.hooks.retire)
        if explain is not False else None
    )
    return flops, memory, peak, exchange, energy, compiles


def _open_log(options: ProfilerOptions, ident: Any, run_id: str) -> LogSink:
    """The run's log; in a distributed run, this rank's (or none), with its rank fields."""
    log = options.log
    if ident is not None and log is not None:
        zero = options.log_ranks == "zero"
        log = None if zero and ident.rank else _dist.rank_log_path(os.fspath(log), ident.rank)
    return LogSink(log, ident.fields() if ident is not None else None, run_id)


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
