"""The profiler: :class:`Profiler`, a facade over the recorder (:mod:`stepprof._recorder`).

Data flows one way: the boundaries (``_recorder.boundaries``) measure each step on the
training thread and queue it; the collector (``_recorder.collector``) turns completed
steps into records off that thread and hands them to the sinks (``_recorder.sinks``: the
log and the summary).  FLOP counting, memory records and the cross-rank exchange are
hooks (``_recorder.hooks``).  This module holds the facade, the argument checks and the
scopes that ``profile_step`` and ``measure`` return.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from typing import Any

import torch

from . import _dist, _memory
from ._cuda import SYNC_MECHANISMS, memory_backend
from ._errors import ConfigError, UsageError, check_count
from ._log import check_log
from ._memory import MemoryReport
from ._records import Summary
from ._recorder.boundaries import Boundaries
from ._recorder.collector import Collector
from ._recorder.exchange import ExchangeHook
from ._recorder.flops import FLOPS_NOT_REQUESTED, FlopsHook
from ._recorder.hooks import Closing, Hook
from ._recorder.memory_records import MemoryHook
from ._recorder.seams import REAL, Seams
from ._recorder.sinks import LogSink, SummarySink
from ._roofline import check_flops
from ._syncs import check_max_syncs, check_on_sync

__all__ = ["Profiler"]


def check_device(device: Any) -> torch.device | None:
    """``device`` as a ``torch.device`` (None stays None), or a ConfigError naming it."""
    if device is None:
        return None
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(
            f"'device' must name a torch device such as 'cuda:0' or 'cpu' (got {device!r})"
        ) from e


def check_warmup(warmup: Any, argument: str = "warmup") -> int:
    if isinstance(warmup, bool) or not isinstance(warmup, int):
        raise ConfigError(f"{argument!r} must be an int >= 0 (got {warmup!r}); pass e.g. {argument}=3")
    if warmup < 0:
        raise ConfigError(f"{argument!r} must be >= 0 (got {warmup}); pass 0 to keep every step")
    return warmup


#: Default of ``Profiler(memory_every=...)``: a memory record costs about 100 µs of
#: the training thread's time, so every 1000 steps it adds under 0.1 µs per step,
#: and a run of 100k steps logs 100 of them.
MEMORY_EVERY = 1000


def check_memory_every(memory_every: Any, argument: str = "memory_every") -> int:
    return check_count(
        memory_every, argument,
        f"pass e.g. {argument}={MEMORY_EVERY}, or 0 to write no periodic memory record",
    )


#: Default of ``Profiler(phase_peaks_every=...)``.  A phase's peak costs one raw
#: allocator-stats read at its exit (12 µs in a tight loop, 25-40 µs inside a
#: launch-bound step on the H200), so three phases read on every step cost more
#: than the rest of stepprof together.  While the step's own peak (read on every
#: step) holds steady, phase peaks are read on one step in this many.
PHASE_PEAKS_EVERY = 50


def check_phase_peaks_every(n: Any, argument: str = "phase_peaks_every") -> int:
    return check_count(
        n, argument,
        f"pass 1 to read every phase's peak on every step, {PHASE_PEAKS_EVERY} (the default) to "
        f"read them on one step in {PHASE_PEAKS_EVERY} while the step's peak is steady, or 0 never "
        f"to read them",
    )


def check_name(name: Any, argument: str = "name") -> str | None:
    if name is not None and not isinstance(name, str):
        if callable(name):
            hint = "; to make a function a step, decorate it with @stepprof.measure"
        elif isinstance(name, int) and not isinstance(name, bool):
            hint = f"; to give the step's batch size, pass it by keyword: batch_size={name!r}"
        else:
            hint = "; pass a name such as 'train', or nothing for the default"
        raise UsageError(f"{argument!r} must be a str or None (got {name!r}){hint}")
    return name


def check_batch_size(batch_size: Any) -> int | None:
    fix = "pass the number of samples in the step, e.g. batch_size=len(batch), or None"
    if batch_size is None:
        return None
    if isinstance(batch_size, bool):
        raise ConfigError(f"'batch_size' must be a positive int or None (got {batch_size!r}); {fix}")
    try:
        n = int(batch_size.__index__())
    except (AttributeError, TypeError):
        raise ConfigError(
            f"'batch_size' must be a positive int or None (got {batch_size!r}); {fix}"
        ) from None
    if n <= 0:
        raise ConfigError(f"'batch_size' must be a positive int or None (got {n}); {fix}")
    return n


def check_budget(max_syncs: Any, on_sync: Any) -> tuple[int | None, str | None]:
    return check_max_syncs(max_syncs), None if on_sync is None else check_on_sync(on_sync)


class _HostRss:
    """This process's resident set size, read at every step on the host.

    On Linux: one ``pread`` of ``/proc/self/statm``, kept open (about 1 µs; procfs
    regenerates the file on every read from offset 0), which is the figure psutil
    reads too.  Elsewhere: ``psutil.Process().memory_info().rss`` (about 12 µs).
    A forked child reopens its own (see :func:`_forget_collectors_in_child`).
    """

    def __init__(self) -> None:
        self._fd: int | None = None
        self._page = 0
        self._process: Any = None

    def read(self) -> int | None:
        try:
            if self._fd is None and self._process is None:
                self._open()
            if self._fd is not None:
                return int(os.pread(self._fd, 256, 0).split()[1]) * self._page
            return int(self._process.memory_info().rss)
        except Exception:  # noqa: BLE001 - a missing figure, never a crash
            return None

    def _open(self) -> None:
        try:
            self._page = os.sysconf("SC_PAGE_SIZE")
            self._fd = os.open("/proc/self/statm", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except (OSError, AttributeError, ValueError):
            import psutil

            self._process = psutil.Process()

    def forget(self) -> None:
        """After a fork: the open file and the psutil handle are the parent's."""
        fd, self._fd, self._process = self._fd, None, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


_HOST_RSS = _HostRss()


# Why an inherited profiler records nothing in a forked child (see _forget_collectors_in_child).
_INHERITED_PREFIX = "this Profiler was inherited by the forked process"
_INHERITED = _INHERITED_PREFIX + (
    " {pid}: a profiler records only in the "
    "process that created it, so it records nothing here; open a new stepprof.Profiler in the "
    "child to profile it"
)

# Open profilers, held strongly: one that is never closed is still flushed at exit.
_open_profilers: set[Profiler] = set()



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

    #: The replaceable parts (tests get others through :func:`_make_profiler`).
    _seams: Seams = REAL
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
    ) -> None:
        log = check_log(log)
        self.warmup = check_warmup(warmup)
        flops_mode, given = check_flops(flops, flops_per_step)  # before the log is opened
        ranks_every = _dist.check_ranks_every(ranks_every)
        log_ranks = _dist.check_log_ranks(log_ranks)
        device = check_device(device)
        if not isinstance(nvtx, bool):
            raise ConfigError(f"'nvtx' must be True or False (got {nvtx!r})")
        if syncs not in SYNC_MECHANISMS:
            raise ConfigError(
                f"'syncs' must be one of {', '.join(map(repr, SYNC_MECHANISMS))} (got {syncs!r}); "
                f"'warn' is the cheap default"
            )
        self._sync_mode = syncs
        self.max_syncs = check_max_syncs(max_syncs)
        self.on_sync = check_on_sync(on_sync)
        self.memory_every = check_memory_every(memory_every)
        self.phase_peaks_every = check_phase_peaks_every(phase_peaks_every)
        ident = _dist.identify()
        group = _dist.check_group(group, ident, ranks_every)
        # -- wiring: boundaries -> pending -> collector -> record -> sinks ---------------
        seams = self._seams
        # Distributed: rank fields on every record, a log per rank, the exchange.
        if ident is not None and log is not None:
            log = None if log_ranks == "zero" and ident.rank else _dist.rank_log_path(os.fspath(log), ident.rank)
        self._log = LogSink(log, ident.fields() if ident is not None else None)
        self.log = self._log.path
        self._summary_sink = SummarySink()
        self._summary: Summary | None = None
        clock = seams.clock
        self._collector = Collector(
            self._log, self._summary_sink, clock0_ns=clock(), unix0_s=time.time(),
            phase_peaks_every=self.phase_peaks_every, collect_every_s=seams.collect_every_s,
        )
        self._boundaries = b = Boundaries(
            self._collector, backend=seams.backend, clock=clock, device=device, nvtx=nvtx,
            syncs=syncs, warmup=self.warmup, max_syncs=self.max_syncs, on_sync=self.on_sync,
            phase_peaks_every=self.phase_peaks_every, read_rss=_HOST_RSS.read,
        )
        self._enter = b.enter
        self._exit = b.exit
        # Optional behaviour: a hook each, in the order their records follow a step's.
        self._flops = (
            FlopsHook(given, warmup=self.warmup, backend=seams.backend, retire=b.retire)
            if flops_mode is not None or given is not None else None
        )
        self._memory = MemoryHook(warmup=self.warmup, every=self.memory_every, retire=b.retire)
        self._exchange = exchange = (
            ExchangeHook(_dist.Exchange(ranks_every, ident, group=group, gather=seams.gather,
                                        close_wait_s=seams.close_wait_s),
                         self._collector.harvest_if_free)
            if ident is not None and ranks_every else None
        )
        hooks: list[Hook] = [h for h in (self._flops, self._memory, exchange) if h is not None]
        self._hooks = hooks
        b.use(hooks)
        self._collector.use(hooks)
        self._close_lock = threading.RLock()  # one close(): a concurrent one waits for it
        _open_profilers.add(self)

    # -- public -------------------------------------------------------------

    def step(
        self,
        name: str | None = None,
        *,
        batch_size: int | None = None,
        max_syncs: int | None = None,
        on_sync: str | None = None,
    ) -> _StepContext:
        """A context manager around one training step.

        Args:
            name: the step's name in the log (default ``"step"``).
            batch_size: samples in the step; enables ``samples_per_s``.
            max_syncs, on_sync: this step's sync budget and policy (default: the
                profiler's).
        """
        return _StepContext(self, check_name(name), check_batch_size(batch_size),
                            *check_budget(max_syncs, on_sync))

    def measure(self, name: Any = None) -> Any:
        """Like :func:`stepprof.measure`, but recording into this profiler."""
        return _make_measure(name, self)

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
        b, collector = self._boundaries, self._collector
        try:
            if b.step is not None and b.owner == threading.get_ident():
                b.end_step(b.step, RuntimeError("profiler closed while the step was open"))
        except Exception as e:  # noqa: BLE001 - close must always produce a summary
            b.fail(e)
        collector.stop()
        with collector.lock:
            try:
                collector.finish()
            except Exception as e:  # noqa: BLE001 - close must always produce a summary
                b.fail(e)
            collector.pending.clear()
            closing = Closing(self._log.write, b.backend, b.next_index - 1 if b.next_index else None,
                              b.broken is not None)
            for hook in self._hooks:
                hook.on_close(closing)
        self._summary = self._build_summary()
        b.closed = True
        self._log.write(self._summary.to_record())
        self._log.close()
        b.warn_async()
        _open_profilers.discard(self)
        return self._summary

    def _build_summary(self) -> Summary:
        b = self._boundaries.backend
        return self._summary_sink.summary(
            device=b.device if b is not None else "none",
            sync_mechanism=b.sync_mechanism if b is not None else None,
            log=self.log,
            stopped=self._collector.error or self._boundaries.broken,
            log_failed=self._log.failed,
            flops_reasons=(self._flops.summary_reasons() if self._flops is not None
                           else (FLOPS_NOT_REQUESTED, None)),
        )

    def __enter__(self) -> Profiler:
        from ._api import push_active

        push_active(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        from ._api import pop_active

        pop_active(self)
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self._boundaries.next_index} steps"
        return f"<stepprof.Profiler log={self.log!r} warmup={self.warmup} {state}>"

    # -- used by bench/ and stepprof.memory_report() --------------------------------

    def _drain(self) -> None:
        """Write every completed step now, from the calling thread (never waits on the device)."""
        self._collector.drain()

    def _known_peak(self) -> int:
        """The highest step peak so far: written steps, pending ones and the open one."""
        peaks = [self._memory.peak_seen, *(s.peak for s in tuple(self._collector.pending))]
        if self._boundaries.step is not None:
            peaks.append(self._boundaries.step.peak)
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
                except Exception:  # noqa: BLE001, S110 - the collector meets and reports it too
                    pass
                self._log.write(rep.to_record())
        return rep

    def _forked(self) -> None:
        """In a forked child: drop the parent's state and record nothing more (see above)."""
        self._collector.forget()
        self._boundaries.forget(_INHERITED.format(pid=os.getpid()))
        self._memory.forget()
        self._hooks = [h for h in self._hooks if h is not self._exchange]
        self._exchange = None
        self._close_lock = threading.RLock()
        self._log.forget()


class _StepContext:
    """The context manager returned by :meth:`Profiler.step` and :func:`stepprof.profile_step`."""

    __slots__ = ("_profiler", "_name", "_batch_size", "_budget", "_tokens")

    def __init__(
        self,
        profiler: Profiler | None,
        name: str | None,
        batch_size: int | None,
        max_syncs: int | None = None,
        on_sync: str | None = None,
    ) -> None:
        self._profiler = profiler
        self._name = name
        self._batch_size = batch_size
        self._budget = (max_syncs, on_sync)
        self._tokens: list[tuple[Profiler, Any]] = []

    def __enter__(self) -> _StepContext:
        if torch.compiler.is_compiling():
            return self
        from ._api import current

        prof = self._profiler or current()
        self._tokens.append(
            (prof, prof._enter(self._name, self._batch_size, step=True, budget=self._budget))
        )
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if torch.compiler.is_compiling() or not self._tokens:
            return
        prof, token = self._tokens.pop()
        prof._exit(token, exc)


def _make_measure(name: Any, profiler: Profiler | None) -> Any:
    from ._api import make_measure

    global _make_measure
    _make_measure = make_measure  # bind once: this sits on the per-phase path
    return make_measure(name, profiler)


def _forget_collectors_in_child() -> None:
    # A forked child (a DataLoader worker, say) inherits the parent's profilers, their
    # pending steps and their log's descriptor.  A profiler records only in the process that
    # made it: in the child it goes inert, so that nothing is written twice or mixed into
    # the parent's log, and no device call is made (CUDA cannot be used after a fork).
    _HOST_RSS.forget()
    for prof in _open_profilers:
        prof._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_collectors_in_child)


def _close_all_at_exit() -> None:
    for prof in list(_open_profilers):
        try:
            prof.close()
        except Exception:  # noqa: BLE001 - at interpreter exit, nothing may raise
            pass


atexit.register(_close_all_at_exit)


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
    prof = Profiler.__new__(Profiler)
    prof._seams = Seams(backend=backend, clock=clock or REAL.clock, collect_every_s=collect_every_s,
                        gather=gather, close_wait_s=close_wait_s)
    prof.__init__(log, **options)  # type: ignore[misc]
    return prof
