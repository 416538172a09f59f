"""The training thread's side of the recorder: the boundaries of steps and phases.

How one step is measured (``B`` = a boundary, where stepprof does its work)::

    B step entry : reset the allocator's peak counter, record the start event
    B phase entry: a top-level phase starts at the previous top-level boundary's
                   event; a nested phase reads the peak so far (folding it into
                   every open scope), resets, and records its own start event
    B phase exit : record the end event, read the peak (fold), reset
    B step exit  : record the end event, read the peak (fold) and reserved,
                   and queue the step for the collector

Every read is folded into every open scope, and every interval of the step is
covered by some read, so the step's peak is the exact high-water mark over the
whole step, phases and gaps included.  Each phase gets its own peak; a
top-level phase's peak also covers the (normally empty) gap since the previous
read, which saves one raw-stats read per phase.  Events are only *queried*, never
waited on (see :mod:`.collector`).

This is the hot path: each boundary costs what bench/boundary_costs.py and
bench/inloop_costs.py measure, and nothing here may add a call or an allocation per
boundary.  Active hooks (:mod:`.hooks`) are called once at step entry and once at step
exit; with none active the loop over them is empty.

Threads: each thread has its own step context (:class:`ThreadSteps`: its open step,
phase stack and sync tracker).  The *training thread* is the first to open a step;
steps of other threads are recorded too, with their thread's name, and skip the hooks
(FLOPs, memory records, the exchange), which follow the training thread's steps.  The
allocator's peak counter is one per device, so a step that overlaps another thread's
step has no peak (null, with the reason).

Interrupts: an exception that is the user's (a ``KeyboardInterrupt``, or any exception
raised by a signal handler) may land at any bytecode of a boundary.  Each boundary
catches it, leaves the thread's context consistent (a step either never started, or is
closed and recorded with that exception as its ``error``), and re-raises it unchanged.
Where one lands before stepprof can catch it (at the very start of a scope's
``__exit__``), the step is left open with nobody holding it; the next entry on that
thread finds it orphaned (by its reference count) and closes it first.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from operator import sub
from typing import Any

import torch

from .. import _memory
from .._device import compiled
from .._device.backend import MARK, POP, PUSH, READ, RESET, Backend, HostBackend
from .._device.cuda import CudaBackend
from .._device.select import upgrade_from_host
from .._registry import HOST_RSS
from .._batch import NO_BATCH, infer_batch_size
from .._errors import StepprofError, UsageError, from_signal_handler, raised_by_user, warn
from .._syncs import SyncTracker
from .collector import PENDING_MAX, Collector
from .exchange import ExchangeHook
from .hooks import Hook
from .step import OpenPhase, PhaseTotals, Step

#: The step clock: nanoseconds, monotonic.
Clock = Callable[[], int]


#: The error of a step whose scope was left without closing it (an interrupt landed
#: before stepprof's exit could run), recorded when the thread's next step enters.
ORPHANED = "the step's scope was left without closing it (an interrupt landed in stepprof's exit)"


# A step or phase that a scope opened is also held by that scope (its token list, or the
# decorator's frame).  Once that holder is gone without closing it (an interrupt landed at
# the very start of the scope's __exit__, before any of its code ran), it is orphaned: only
# stepprof's own references are left.  sys.getrefcount(x) counts them, plus its argument:
# an open step is held by its context's ``step``, the open-steps map and the caller's local
# variable; an open phase by its context's stack.  tests/test_interrupts.py checks both.
_STEP_ORPHANED = 4
_PHASE_ORPHANED = 2


#: The token of a phase entered in a light step (``overhead_budget``): nothing is recorded.
LIGHT_PHASE = object()


def error_message(exc: BaseException) -> str:
    """The user's exception's message for a step's ``error``, truncated to 2000 characters."""
    try:
        return str(exc)[:2000]
    except BaseException as e:  # noqa: BLE001 - its __str__ failing (even with a KeyboardInterrupt) is the user's
        if from_signal_handler(e):
            raise
        return f"<unprintable {type(exc).__name__}: its __str__ raised {type(e).__name__}>"


class ThreadSteps:
    """One thread's step context: its open step, its phase stack, its sync tracker."""

    __slots__ = ("tid", "thread", "step", "stack", "last_top_mark", "tracker", "watching", "hooked",
                 "last_exit", "data_ns", "batch")

    def __init__(self, tid: int, thread: str | None, tracker: SyncTracker, hooked: bool) -> None:
        self.tid = tid
        self.thread = thread  # the thread's name on its step records; None: the training thread
        self.step: Step | None = None
        self.stack: list[OpenPhase] = []
        self.last_top_mark: Any = None
        self.tracker = tracker
        self.watching = False
        self.hooked = hooked  # the training thread: its steps run the hooks
        self.last_exit = 0  # the clock when its last step's exit returned (0: none, or it failed)
        self.data_ns = -1  # time in stepprof.iterate's __next__ since then (-1: not used)
        self.batch: tuple[int | None, str | None] | None = None  # the last batch iterate() saw


class Boundaries:
    """The threads' open steps and phase stacks, and what each boundary records.

    Each thread has its own :class:`ThreadSteps`.  An internal error stops recording
    (:meth:`fail`), never the training; an exception of the user's that lands inside a
    boundary propagates unchanged, after the boundary has left the thread's context
    consistent (see the module docstring).

    Args:
        collector: where finished steps are queued.
        backend: the device backend, or None to choose it at the first step.
        clock: the step clock.
        device: the ``device`` argument (None: CUDA once the training code initialised it).
        nvtx, syncs: the backend's settings.
        warmup, max_syncs, on_sync, phase_peaks_every: the profiler's settings.
        read_rss: reads this process's resident set size (host steps record it).
        flush_every_ns: the most the log may lag behind a step's exit (see :meth:`_catch_up`).
    """

    def __init__(
        self,
        collector: Collector,
        *,
        backend: Backend | None,
        clock: Clock,
        device: torch.device | None,
        nvtx: bool,
        syncs: str,
        warmup: int,
        max_syncs: int | None,
        on_sync: str,
        phase_peaks_every: int,
        read_rss: Callable[[], int | None],
        flush_every_ns: int | None = None,
        boundary: str = "auto",
    ) -> None:
        self.backend = backend
        self._boundary = boundary
        self._budget = collector.budget
        self.closed = False
        self.closing = False  # close() has begun: no step starts, no step exit writes
        self.broken: str | None = None  # why recording stopped
        self.next_index = 0
        self._collector = collector
        self._pending = collector.pending
        self._writer = collector.log.writer  # read at each step exit: whether writing failed
        self._inline = collector.every_s is None
        self._flush_every_ns = flush_every_ns
        self._catch_up_at = 0 if flush_every_ns is not None else 2**63  # before it, the age is not checked
        self._clock = clock
        self._device_arg = device
        self._pinned = backend is not None or device is not None
        self._nvtx = nvtx
        self._sync_mode = syncs
        self._warmup = warmup
        self._max_syncs = max_syncs
        self._on_sync = on_sync
        self._phase_peaks_every = phase_peaks_every
        self._read_rss = read_rss
        #: The background build this profiler waits for (boundary="auto"), taken at a step
        #: boundary once it has loaded; None when none is awaited.
        self._core: Any = None
        #: Why the compiled boundary is not used (None: it is, or no backend could use it).
        self.core_reason: str | None = None
        self._main: ThreadSteps | None = None  # the training thread's context
        self._contexts: dict[int, ThreadSteps] = {}  # every thread's, the training thread's included
        self._open: dict[int, Step] = {}  # the open steps, by thread
        self._counters: tuple[int, ...] | None = None  # the allocator's, at the last read
        self._last_peak = -1      # the previous step's peak ...
        self._steady = 0          # ... and how many steps in a row have repeated it
        self._phase_peaks_at = -1  # the last step that read its phases' peaks
        self._warned: set[str] = set()
        self._warn_at_entry: str | None = None
        self._hooks: tuple[Hook, ...] = ()
        self._begin_hooks: tuple[Hook, ...] = ()
        self._end_hooks: tuple[Hook, ...] = ()
        self._exchange: ExchangeHook | None = None
        if backend is not None and backend.has_device_memory:
            _memory.observe(backend)

    # -- hooks ------------------------------------------------------------------------

    def use(self, hooks: Sequence[Hook]) -> None:
        """Call these hooks at step entry and exit (each only where its class overrides)."""
        self._hooks = tuple(hooks)
        self._exchange = next((h for h in hooks if isinstance(h, ExchangeHook)), None)
        self._activate()

    def retire(self, hook: Hook) -> None:
        """Stop calling ``hook`` at step boundaries (it still gets records and close)."""
        hook.retired = True
        self._activate()  # new tuples: a loop over the old ones (this very call's) goes on

    def _activate(self) -> None:
        active = [h for h in self._hooks if not h.retired]
        self._begin_hooks = tuple(h for h in active if type(h).on_step_begin is not Hook.on_step_begin)
        self._end_hooks = tuple(h for h in active if type(h).on_step_end is not Hook.on_step_end)

    def watch_phases(self, fn: Callable[[str, str], None] | None) -> None:
        """Call ``fn("enter" | "exit", key)`` at every phase boundary until ``watch_phases(None)``.

        For the one step that ``explain_peak`` explains: the wrappers shadow the class's
        methods on this instance only while they are needed, so other steps pay nothing.
        """
        if fn is None:
            self.__dict__.pop("begin_phase", None)
            self.__dict__.pop("end_phase", None)
            return
        begin, end = Boundaries.begin_phase.__get__(self), Boundaries.end_phase.__get__(self)

        def begin_phase(ctx: ThreadSteps, step: Step, name: str) -> OpenPhase:
            ph = begin(ctx, step, name)
            fn("enter", ph.key)
            return ph

        def end_phase(ctx: ThreadSteps, step: Step, ph: OpenPhase, exc: BaseException | None) -> None:
            if ph in ctx.stack:  # it closes the phases left open inside it too
                for top in reversed(ctx.stack[ctx.stack.index(ph):]):
                    fn("exit", top.key)
            end(ctx, step, ph, exc)

        self.begin_phase = begin_phase  # type: ignore[method-assign]
        self.end_phase = end_phase  # type: ignore[method-assign]

    # -- the threads' contexts ---------------------------------------------------------

    def context(self) -> ThreadSteps:
        """The calling thread's step context (made at its first step)."""
        tid = threading.get_ident()
        ctx = self._main
        if ctx is not None and ctx.tid == tid:
            return ctx
        ctx = self._contexts.get(tid)
        if ctx is None:
            ctx = self._new_context(tid)
        return ctx

    def _new_context(self, tid: int) -> ThreadSteps:
        main = self._main is None
        ctx = ThreadSteps(tid, None if main else threading.current_thread().name,
                          SyncTracker(self._sync_mode), hooked=main)
        self._contexts[tid] = ctx
        if main:
            self._main = ctx
        return ctx

    def note_batch(self, data_ns: int, batch: tuple[int | None, str | None]) -> None:
        """stepprof.iterate fetched a batch on this thread: ``data_ns`` in ``__next__``, its size
        (or why not); the thread's next step takes both."""
        ctx = self.context()
        ctx.data_ns = data_ns if ctx.data_ns < 0 else ctx.data_ns + data_ns
        ctx.batch = batch

    @property
    def step(self) -> Step | None:
        """The calling thread's open step, or None."""
        ctx = self._contexts.get(threading.get_ident())
        return ctx.step if ctx is not None else None

    def step_of(self, tid: int | None) -> tuple[Step | None, bool]:
        """Thread ``tid``'s open step (None: the training thread's), and whether it has stepped."""
        ctx = self._main if tid is None else self._contexts.get(tid)
        return (None, False) if ctx is None else (ctx.step, True)

    def open_steps(self) -> list[Step]:
        """Every thread's open step."""
        return list(self._open.values())

    # -- entry and exit, shared by steps, phases and measured functions -------------

    def enter(
        self,
        name: str | None,
        batch_size: int | None,
        step: bool,
        budget: tuple[int | None, str | None] = (None, None),
        batch_reason: str | None = None,
        batch: Any = NO_BATCH,
    ) -> Any:
        """Open a step (``step=True``, or no step is open on this thread) or a phase; return a token.

        ``batch_reason``: why ``batch_size`` is None when a batch was given and its size could
        not be inferred.  ``batch``: a measured function's batch, whose size a step it opens
        infers when it has none.
        """
        if self.closed or (self.closing and (step or self.context().step is None)):
            # While close() runs, a step already open on another thread goes on: its
            # phases are measured, and its exit only queues it (close wrote what it had).
            raise UsageError(
                "this Profiler is closed; open a new stepprof.Profiler(...) for more steps"
            )
        if self.broken is not None:
            if self._warn_at_entry is not None:
                why, self._warn_at_entry = self._warn_at_entry, None
                warn(f"stepprof: {why}", stacklevel=4)
            ex = self._exchange
            return ex.enter_unrecorded() if ex is not None and self.context().hooked else None
        ctx = self.context()
        open_step = ctx.step
        if open_step is not None and sys.getrefcount(open_step) <= _STEP_ORPHANED:
            self._close_orphan(ctx, open_step)  # its scope is gone: closed now, with the reason
            open_step = None
        if open_step is not None and step:
            raise UsageError(
                f"profile_step() was entered inside step {open_step.index} "
                f"({open_step.name!r}); steps do not nest. Use stepprof.measure({name or 'name'!r}) "
                f"for a phase inside a step, or leave the outer step first"
            )
        if open_step is not None and open_step.sampled == 0:
            return LIGHT_PHASE  # a phase of a light step: not measured
        depth = len(ctx.stack)
        try:
            if open_step is None:
                if batch_size is None and batch is not NO_BATCH:
                    batch_size, batch_reason = infer_batch_size(batch)
                return self.begin_step(ctx, name or "step", batch_size, budget, batch_reason)
            return self.begin_phase(ctx, open_step, name or "phase")
        except StepprofError:
            raise
        except BaseException as e:  # noqa: BLE001 - stepprof never breaks training
            if raised_by_user(e):  # an interrupt: leave the context consistent, re-raise it
                self._undo_entry(ctx, open_step, depth, e)
                raise
            self.fail(e)
            if open_step is None and self._exchange is not None and ctx.hooked:
                return self._exchange.entry_failed()
            return None

    def exit(self, token: Any, exc: BaseException | None) -> None:
        """Close the step or phase that :meth:`enter` returned ``token`` for.

        Idempotent: a token already closed (an exit that an interrupt cut short, done
        again by the scope) is a no-op.
        """
        if token is LIGHT_PHASE:
            return
        if token is None or self.broken is not None or self.closed:
            if token is not None:
                self._exit_unrecorded(token)
            return
        try:
            if isinstance(token, Step):
                ctx = token.ctx
                if token is ctx.step:
                    self.end_step(ctx, token, exc)
                    if self.broken is not None and self._exchange is not None and ctx.hooked:
                        self._exchange.stopped_in_step()  # recording stopped within this step
            else:
                ctx = token.ctx
                if ctx.step is not None:
                    self.end_phase(ctx, ctx.step, token, exc)
        except BaseException as e:  # noqa: BLE001 - stepprof never breaks training
            if raised_by_user(e):
                self._finish_exit(token, e)
                raise
            self.fail(e)
            if self._exchange is not None and isinstance(token, Step) and token.ctx.hooked:
                self._exchange.exit_unrecorded(token, self._device_index())
                self._exchange.stopped_in_step()
            return
        if isinstance(token, Step):
            tracker = token.ctx.tracker
            if exc is None and tracker.deferred is not None:
                # A step over its budget on the "trace" route, where the callback that found it
                # could not raise (torch calls it from C++): raised at the step's exit instead.
                deferred, tracker.deferred = tracker.deferred, None
                raise deferred

    def _exit_unrecorded(self, token: Any) -> None:
        """The exit of a scope that is not recorded (recording stopped, or closed)."""
        if isinstance(token, Step):
            ctx = token.ctx
            if ctx.step is token:
                self._discard(ctx)
            if self._exchange is not None and ctx.hooked and not self.closed:
                self._exchange.exit_unrecorded(token, self._device_index())
                if self.broken is not None:
                    self._exchange.stopped_in_step()
        elif isinstance(token, OpenPhase):
            ctx = token.ctx
            if token in ctx.stack:
                del ctx.stack[ctx.stack.index(token):]
        elif self._exchange is not None and not self.closed:
            self._exchange.exit_unrecorded(token, self._device_index())

    def _device_index(self) -> int | None:
        return self.backend.index if self.backend is not None else None

    # -- interrupts ----------------------------------------------------------------

    def _undo_entry(self, ctx: ThreadSteps, open_step: Step | None, depth: int, exc: BaseException) -> None:
        """An interrupt landed in an entry: the step closes as recorded, a phase never started."""
        try:
            if open_step is None:
                step = ctx.step
                if step is not None:
                    self._finish_exit(step, exc)
            else:
                self._pop_phases(ctx, depth)
        except Exception as e:  # noqa: BLE001 - the user's exception goes on; recording stops
            if raised_by_user(e):
                raise
            self.fail(e)

    def _finish_exit(self, token: Any, exc: BaseException) -> None:
        """An interrupt landed in an exit (or a step's entry): close the token's scope anyway.

        A step is closed and queued (once), its ``error`` the interrupt; a phase is closed.
        """
        try:
            ctx = token.ctx
            if isinstance(token, Step):
                if token.error is None:
                    token.error = {"type": type(exc).__name__, "message": error_message(exc)}
                if ctx.step is token:
                    b = self.backend
                    if token.t1 == 0:
                        token.t1 = self._clock()
                    self._unwatch(ctx)
                    if b is not None:
                        for _ in range(len(ctx.stack) + (token.sampled != 0)):
                            b.range_pop()
                    ctx.stack.clear()
                    ctx.step = None
                    ctx.last_top_mark = None
                    ctx.last_exit = 0  # the next step's wait is not measured from a cut-short exit
                self._open.pop(ctx.tid, None)
                if token.backend is None:  # cut short before the first backend was chosen
                    token.backend = self.backend
                if not token.queued and token.backend is not None:
                    token.queued = True
                    self._pending.append(token)
                    if self._inline or self._collector.thread is None:
                        self._collector.harvest_if_free()
            elif token in ctx.stack:
                self._pop_phases(ctx, ctx.stack.index(token))
        except Exception as e:  # noqa: BLE001 - the user's exception goes on; recording stops
            if raised_by_user(e):
                raise
            self.fail(e)

    def _pop_phases(self, ctx: ThreadSteps, depth: int) -> None:
        """Close the thread's phases above ``depth`` unrecorded, and their NVTX ranges."""
        b = self.backend
        while len(ctx.stack) > depth:
            ctx.stack.pop()
            if b is not None:
                b.range_pop()

    def _close_orphan(self, ctx: ThreadSteps, step: Step) -> None:
        """Close a step that its scope left open, recorded with the reason."""
        step.error = {"type": "Interrupted", "message": ORPHANED}
        self._finish_exit(step, RuntimeError(ORPHANED))

    # -- the boundaries ----------------------------------------------------------------

    def ensure_backend(self) -> Backend:
        """The backend, chosen at the first step; a host one moves to CUDA once it is up.

        With ``device=None``, a profiler that started on the host (CUDA not initialised
        yet) switches to CUDA at the first step after the training code initialised it.
        """
        b = upgrade_from_host(self.backend, self._device_arg, pinned=self._pinned, nvtx=self._nvtx,
                              syncs=self._sync_mode, boundary=self._boundary)
        if b is None:
            return self.backend  # type: ignore[return-value]
        self.backend = b
        if b.has_device_memory:  # CUDA, seen for the first time: the context baseline
            _memory.observe(b)
        if self._boundary != "python":
            self._await_core(b)
        return b

    def _await_core(self, b: Backend) -> None:
        """A backend that could use the compiled boundary and does not: have it built in
        the background (:func:`compiled.build_in_background`), to take at a step boundary."""
        if type(b) is CudaBackend or (type(b) is HostBackend and self._read_rss == HOST_RSS.read):
            self._core, self.core_reason = compiled.build_in_background()
            if self._core is not None and self._core.module is not None:
                self._take_core()
        elif b.boundary == "compiled":
            self._core = self.core_reason = None

    def boundary_reason(self) -> str | None:
        """Why the run's device work was not on the compiled boundary (for the summary)."""
        if self._boundary == "python":
            return "boundary='python' was asked for"
        if self._core is not None:
            return ("the compiled boundary was still being built in the background when the run "
                    "closed; the next run uses it")
        return self.core_reason

    def _take_core(self) -> None:
        """The background build is done (at a step's entry: this thread has no step open,
        and a step open on another thread ends on the backend it began on)."""
        core, self._core = self._core, None
        if core is None:  # another thread's step entry took it just now
            return
        module, self.core_reason = core.module, core.reason
        if module is None:
            return
        b = self.backend
        try:
            if type(b) is CudaBackend and getattr(module, "CUDA", False):
                self.backend = compiled.CompiledCudaBackend.adopt(b, module)
            elif type(b) is HostBackend and hasattr(module, "host_rss"):
                self._read_rss = HOST_RSS.with_core(module.host_rss)
        except Exception as e:  # noqa: BLE001 - the Python boundary goes on
            if raised_by_user(e):
                raise
            self.core_reason = f"the compiled boundary could not be taken ({type(e).__name__}: {e})"

    def begin_step(
        self,
        ctx: ThreadSteps,
        name: str,
        batch_size: int | None,
        syncs: tuple[int | None, str | None],
        batch_reason: str | None = None,
    ) -> Step:
        t_in = self._clock()
        index = self.next_index
        self.next_index = index + 1
        if batch_size is None and batch_reason is None and ctx.batch is not None:
            batch_size, batch_reason = ctx.batch  # from stepprof.iterate: the batch just fetched
        step = Step(index, name, index < self._warmup, batch_size)
        step.batch_reason = batch_reason
        if ctx.last_exit:
            step.data_wait_ns = t_in - ctx.last_exit
        if ctx.data_ns >= 0:
            step.data_ns, ctx.data_ns = ctx.data_ns, -1
        ctx.batch = None
        step.ctx = ctx
        step.thread = ctx.thread
        step.backend = self.backend
        ctx.step = step  # from here on, an interrupt closes the step instead of undoing it
        open_steps = self._open
        open_steps[ctx.tid] = step
        if len(open_steps) > 1:  # another thread's step is open: neither has a peak of its own
            for s in list(open_steps.values()):
                s.shared = True
        if ctx.hooked:
            for hook in self._begin_hooks:
                hook.on_step_begin(index)
        step.t0 = t_in
        core = self._core
        if core is not None and (core.module is not None or core.reason is not None):
            self._take_core()  # built in the background: from this step on
        b = self.backend
        if b is None or not b.has_device_timing:
            b = self.ensure_backend()
        step.backend = b
        budget = self._budget
        if budget is not None and not step.warmup:
            k = budget.interval_at(index)
            if index % k:  # a light step: the clock and the sync count only
                step.sampled = 0
                self._counters = None  # the next full step reads a new baseline
                self._watch(ctx, step, b, syncs)
                step.t0 = self._clock()
                step.overhead_ns = step.t0 - t_in
                return step
            step.sampled = k
        n = self._phase_peaks_every
        if n != 1:
            step.phase_peaks = n > 0 and (
                step.warmup or self._steady < 2 or index - self._phase_peaks_at >= n
            )
        if step.phase_peaks:
            self._phase_peaks_at = index
        flags = MARK | RESET | PUSH
        if self._counters is None and b.has_device_memory:
            flags |= READ  # once: the baseline of the allocator's counters (read before the reset)
        self._watch(ctx, step, b, syncs)
        mark, mem = b.cross(flags, f"{name} {index}")
        if mem is not None:
            self._counters = mem[2:] or None
        step.start_mark = ctx.last_top_mark = mark
        step.t0 = self._clock()
        step.overhead_ns = step.t0 - t_in
        return step

    def _watch(self, ctx: ThreadSteps, step: Step, b: Backend, syncs: tuple[int | None, str | None]) -> None:
        """Start counting this thread's syncs for ``step`` (its sync budget: ``max_syncs``, ``on_sync``)."""
        if not b.has_device_timing:  # the host: no device to wait on, nothing to count
            step.syncs_reason = b.watch_syncs(ctx.tracker)
            ctx.watching = False
            return
        max_syncs = self._max_syncs if syncs[0] is None else syncs[0]
        tracker = ctx.tracker
        tracker.begin(ctx.stack, max_syncs, syncs[1] or self._on_sync, not step.warmup)
        step.syncs_reason = b.watch_syncs(tracker)
        ctx.watching = step.syncs_reason is None

    @staticmethod
    def _fold_peak(ctx: ThreadSteps, step: Step, mem: Any) -> None:
        """Fold a memory read's peak (since the last reset) into every open scope."""
        peak = mem[0]
        if peak > step.peak:
            step.peak = peak
        for ph in ctx.stack:
            if peak > ph.peak:
                ph.peak = peak

    def _unwatch(self, ctx: ThreadSteps) -> None:
        """Stop routing this thread's waits to its tracker (idempotent)."""
        if ctx.watching or ctx.tracker.attached:
            ctx.watching = False
            try:
                self.backend.unwatch_syncs(ctx.tracker)  # type: ignore[union-attr]
            except Exception as e:  # noqa: BLE001 - stepprof never breaks training
                if raised_by_user(e):
                    raise
                self.fail(e)

    def begin_phase(self, ctx: ThreadSteps, step: Step, name: str) -> OpenPhase:
        t_in = self._clock()
        b = step.backend  # a step ends on the backend it began on (see _take_core)
        assert b is not None
        stack = ctx.stack
        if stack and sys.getrefcount(stack[-1]) <= _PHASE_ORPHANED:
            self._finish_exit(stack[-1], RuntimeError(ORPHANED))  # its scope is gone: closed
        if stack:
            # Nested: read the enclosing phase's peak so far before the reset, and
            # give the phase its own start event.
            ph = OpenPhase(f"{stack[-1].key}/{name}", ctx)
            if step.phase_peaks:
                ph.mark, mem = b.cross(MARK | READ | RESET | PUSH, name)
                if mem is not None:
                    self._fold_peak(ctx, step, mem)
            else:
                ph.mark = b.cross(MARK | PUSH, name)[0]
            stack.append(ph)
        else:
            # Top level: top-level phases tile the step.  The peak counter already
            # runs from the last read, and the last top-level boundary's event (the
            # step's start or the previous phase's end) serves as this phase's start,
            # which saves a raw-stats read and an event record per phase (see
            # bench/boundary_costs.py).  Any device work or allocation between two
            # phases counts toward the next.
            ph = OpenPhase(name, ctx)
            stack.append(ph)
            b.cross(PUSH, name)
            ph.mark = ctx.last_top_mark
        ph.t0 = self._clock()
        step.overhead_ns += ph.t0 - t_in
        return ph

    def end_phase(self, ctx: ThreadSteps, step: Step, ph: OpenPhase, exc: BaseException | None) -> None:
        t_in = self._clock()
        b = step.backend
        assert b is not None
        stack = ctx.stack
        if ph not in stack:
            return  # already closed (e.g. by its step's exit)
        last = stack[-1] is ph  # the common case: only ph closes, and its range pops in the call
        flags = MARK | POP if last else MARK
        if step.phase_peaks:
            flags |= READ | RESET
        end, mem = b.cross(flags)
        if mem is not None:
            self._fold_peak(ctx, step, mem)
        if stack[0] is ph:
            ctx.last_top_mark = end
        # Close ph and anything opened inside it that was left open.
        while stack:
            top = stack[-1]
            total = step.phases.get(top.key)
            if total is None:
                total = step.phases[top.key] = PhaseTotals(top.t0)  # its first run: keys run one after another
            total.wall_ns += t_in - top.t0
            total.marks.append((top.mark, end))
            if top.peak > total.peak:
                total.peak = top.peak
            total.count += 1
            total.syncs += top.syncs
            stack.pop()
            if top is not ph or not last:  # ph's own range popped in the call when it was last
                b.range_pop()
            if top is ph:
                break
        step.overhead_ns += self._clock() - t_in

    def end_step(self, ctx: ThreadSteps, step: Step, exc: BaseException | None) -> None:
        step.t1 = self._clock()
        b = step.backend
        assert b is not None
        raised = exc  # the user's exception (the hooks get this one)
        try:
            if ctx.stack:  # phases left open (a generator suspended mid-phase, say)
                self.end_phase(ctx, step, ctx.stack[0], exc)
            t_in = self._clock()
            mem = None
            light = step.sampled == 0
            if not light:
                step.end_mark, mem = b.cross(MARK | READ | POP)
                if mem is not None:
                    self._fold_peak(ctx, step, mem)
            if ctx.watching:
                step.syncs = ctx.tracker.end()
                if exc is None and ctx.tracker.deferred is not None:
                    exc = ctx.tracker.deferred  # the "trace" route's: exit() raises it
        finally:
            self._unwatch(ctx)
        if mem is not None:
            if step.peak == self._last_peak:
                self._steady += 1
            else:
                self._steady, self._last_peak = 0, step.peak
            step.reserved = mem[1]
            counters, previous = mem[2:] or None, self._counters
            if counters is not None and previous is not None:
                step.counters = tuple(map(sub, counters, previous))  # (a generator costs 5x, per step)
            self._counters = counters
        if not b.has_device_memory and not light:
            step.rss = self._read_rss()
        if ctx.hooked:
            for hook in self._end_hooks:
                hook.on_step_end(step, raised)
        if exc is not None:
            step.error = {"type": type(exc).__name__, "message": error_message(exc)}
        ctx.step = None
        ctx.last_top_mark = None
        self._open.pop(ctx.tid, None)
        collector = self._collector
        step.queued = True
        if self.closing:  # another thread is closing: it writes what was pending when it began
            self._pending.append(step)
            return
        if self._inline:  # inline mode: harvest older steps here (the harvest times itself)
            step.overhead_ns += self._clock() - t_in
            collector.harvest()
            self._pending.append(step)
            if not b.has_device_timing:
                collector.harvest()  # nothing to wait for on the host: write it now
            ctx.last_exit = self._clock()
            return
        if collector.error is not None or (self._writer is not None and self._writer.failed is not None):
            self.warn_async()
        now = self._clock()
        step.overhead_ns += now - t_in
        pending = self._pending
        pending.append(step)
        ctx.last_exit = now
        if collector.thread is None:
            collector.start()
            ctx.last_exit = self._clock()
        elif (now >= self._catch_up_at or len(pending) > PENDING_MAX) and self._catch_up(now):
            ctx.last_exit = self._clock()  # the harvest is stepprof's time, not the data wait

    def _catch_up(self, now: int) -> bool:
        """Keep the log within ``flush_every_s`` of the training thread, and the steps
        waiting to be written under ``PENDING_MAX``.

        The collector thread writes every 20 ms, but it needs the GIL and a CPU, which a
        busy training thread or other processes may hold for long stretches.  When the
        oldest step still waiting left its exit more than ``flush_every_s`` ago, or more
        than ``PENDING_MAX`` steps wait, the training thread writes the completed steps
        itself (query only, never a wait on the device), taking over from the collector
        thread (:meth:`Collector.take_over`).  The age is checked at most four times per
        ``flush_every_s``.  Returns whether it wrote.
        """
        every = self._flush_every_ns
        pending = self._pending
        if every is not None:
            self._catch_up_at = now + every // 4
        overdue = every is not None and bool(pending) and now - pending[0].t1 > every
        if not overdue and len(pending) <= PENDING_MAX:
            return False
        self._collector.take_over()  # its time goes to the records it writes
        return True

    # -- failure ---------------------------------------------------------------------

    def warn_async(self) -> None:
        """Warn, from the training thread, about what went wrong on the collector thread."""
        for why in (self._collector.error, self._collector.log.failed):
            if why is not None and why not in self._warned:
                self._warned.add(why)
                warn(f"stepprof: {why}; logging stopped", stacklevel=4)

    def _discard(self, ctx: ThreadSteps) -> None:
        """Drop this thread's open step and phases unrecorded: NVTX ranges and sync watch undone."""
        self._unwatch(ctx)
        b = self.backend
        if b is not None and (ctx.step is not None or ctx.stack):
            for _ in range(len(ctx.stack) + (ctx.step is not None and ctx.step.sampled != 0)):
                try:
                    b.range_pop()
                except Exception as e:  # noqa: BLE001
                    if raised_by_user(e):
                        raise
                    break
        if ctx.step is not None:
            self._open.pop(ctx.tid, None)
        ctx.step = None
        ctx.stack.clear()
        ctx.last_top_mark = None
        ctx.last_exit = 0

    def fail(self, exc: BaseException) -> None:
        """An internal failure: stop recording, keep training, say so once."""
        ctx = self._contexts.get(threading.get_ident())
        step_open = ctx is not None and ctx.step is not None
        why = f"{type(exc).__name__}: {exc}"
        for hook in self._hooks:
            hook.on_fail(step_open and ctx.hooked, why)  # type: ignore[union-attr]
        if self.broken is None:
            self.broken = f"stepprof stopped recording after an internal error: {why}"
            warn(self.broken, stacklevel=3)
        if ctx is not None:  # other threads' open steps are dropped at their own exits
            self._discard(ctx)

    def forget(self, why: str) -> None:
        """In a forked child: record nothing more, and warn at the first use."""
        self.broken = self._warn_at_entry = why
        self._main = None
        self._contexts = {}
        self._open = {}
        self._hooks = self._begin_hooks = self._end_hooks = ()
        self._exchange = None
        self._pending = self._collector.pending
        self._writer = None

