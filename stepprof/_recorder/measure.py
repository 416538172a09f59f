"""What each step and phase boundary measures, on the thread that steps.

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
exit; with none active the loop over them is empty.  The allocator's peak counter is one
per device, so a step that overlaps another thread's step has no peak (null, with the
reason).  Which scope opens what, and the repair after an interrupt, are
:class:`~.boundaries.Boundaries`', which builds on this class.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from operator import sub
from typing import Any

from .._device.backend import MARK, POP, PUSH, READ, RESET, Backend
from .._errors import from_signal_handler, raised_by_user
from .._options import CaptureSettings, SyncSettings
from .backend_slot import BackendSlot
from .collector import Collector
from .exchange import ExchangeHook
from .hooks import ActiveHooks
from .step import OpenPhase, PhaseTotals, Step
from .threads import Threads, ThreadSteps

#: The step clock: nanoseconds, monotonic.
Clock = Callable[[], int]

#: The error of a step whose scope was left without closing it (an interrupt landed
#: before stepprof's exit could run), recorded when the thread's next step enters.
ORPHANED = "the step's scope was left without closing it (an interrupt landed in stepprof's exit)"

# An open phase is held by its context's stack and by its scope; with the scope gone
# (see :mod:`.boundaries`), sys.getrefcount counts the stack and its own argument.
_PHASE_ORPHANED = 2


def error_message(exc: BaseException) -> str:
    """The user's exception's message for a step's ``error``, truncated to 2000 characters."""
    try:
        return str(exc)[:2000]
    except BaseException as e:  # noqa: BLE001 - its __str__ failing (even with a KeyboardInterrupt) is the user's
        if from_signal_handler(e):
            raise
        return f"<unprintable {type(exc).__name__}: its __str__ raised {type(e).__name__}>"


class StepMeasure:
    """The measurement at each boundary of a step or phase, and the run's measuring state.

    :class:`~.boundaries.Boundaries` adds the entry and exit that scopes call, the repair
    after an interrupt (``_finish_exit``) and failure (``fail``), which this class calls.

    Args:
        collector: where finished steps are queued.
        capture, sync: the profiler's settings, grouped.
        backend: the device backend, or None to choose it at the first step.
        clock: the step clock.
        read_rss: reads this process's resident set size (host steps record it).
    """

    def __init__(
        self,
        collector: Collector,
        capture: CaptureSettings,
        sync: SyncSettings,
        *,
        backend: Backend | None,
        clock: Clock,
        read_rss: Callable[[], int | None],
    ) -> None:
        self.slot = BackendSlot(backend, device=capture.device, nvtx=capture.nvtx, syncs=sync.mode,
                                boundary=capture.boundary, read_rss=read_rss)
        self._budget = collector.budget
        self.closed = False
        self.closing = False  # close() has begun: no step starts, no step exit writes
        self.broken: str | None = None  # why recording stopped
        self.next_index = 0
        self._collector = collector
        self._pending = collector.pending
        self._writer = collector.log.writer  # read at each step exit: whether writing failed
        self._inline = collector.every_s is None
        self._clock = clock
        self._warmup = capture.warmup
        self._phase_peaks_every = capture.phase_peaks_every
        self._sync = sync
        self.threads = Threads(sync.mode)
        self.context = self.threads.context  # bound once: every entry asks it
        self._open = self.threads.open  # the open steps, by thread
        self._counters: tuple[int, ...] | None = None  # the allocator's, at the last read
        self._last_peak = -1      # the previous step's peak ...
        self._steady = 0          # ... and how many steps in a row have repeated it
        self._phase_peaks_at = -1  # the last step that read its phases' peaks
        self._warn_at_entry: str | None = None
        self.hooks = ActiveHooks()
        self._exchange: ExchangeHook | None = None  # set with the hooks (Boundaries.use)
        #: Called once the background build has been taken (the step core is in it).
        self.on_core: Callable[[], None] | None = None

    @property
    def backend(self) -> Backend | None:
        """The backend in use (None before the first step)."""
        return self.slot.backend

    def begin_step(
        self,
        ctx: ThreadSteps,
        name: str,
        batch_size: int | None,
        syncs: tuple[int | None, str | None],
        batch_reason: str | None,
        t_in: int,
    ) -> Step:
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
        step.tokens, ctx.tokens = ctx.tokens, None  # the tokens of the batch iterate() saw, if any
        step.ctx = ctx
        step.thread = ctx.thread
        step.backend = self.slot.backend
        ctx.step = step  # from here on, an interrupt closes the step instead of undoing it
        open_steps = self._open
        open_steps[ctx.tid] = step
        if len(open_steps) > 1:  # another thread's step is open: neither has a peak of its own
            for s in list(open_steps.values()):
                s.shared = True
        if ctx.hooked:
            for hook in self.hooks.begin:
                hook.on_step_begin(index)
        step.t0 = t_in
        slot = self.slot
        if slot.awaiting is not None and slot.ready():
            slot.take_core()  # built in the background: from this step on
            if self.on_core is not None:
                self.on_core()
        b = slot.backend
        if b is None or not b.has_device_timing:
            b = slot.ensure()
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
        max_syncs = self._sync.max_syncs if syncs[0] is None else syncs[0]
        tracker = ctx.tracker
        tracker.begin(ctx.stack, max_syncs, syncs[1] or self._sync.on_sync, not step.warmup)
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
                self.slot.backend.unwatch_syncs(ctx.tracker)  # type: ignore[union-attr]
            except Exception as e:  # noqa: BLE001 - stepprof never breaks training
                if raised_by_user(e):
                    raise
                self.fail(e)

    def begin_phase(self, ctx: ThreadSteps, step: Step, name: str, t_in: int) -> OpenPhase:
        b = step.backend  # a step ends on the backend it began on (see BackendSlot)
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

    def end_phase(self, ctx: ThreadSteps, step: Step, ph: OpenPhase, exc: BaseException | None, t_in: int) -> None:
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

    def end_step(self, ctx: ThreadSteps, step: Step, exc: BaseException | None, t_in: int) -> None:
        step.t1 = t_in
        b = step.backend
        assert b is not None
        raised = exc  # the user's exception (the hooks get this one)
        try:
            if ctx.stack:  # phases left open (a generator suspended mid-phase, say)
                self.end_phase(ctx, step, ctx.stack[0], exc, self._clock())
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
            step.rss = self.slot.read_rss()
        if ctx.hooked:
            for hook in self.hooks.end:
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
            collector.warn_async()
        now = self._clock()
        step.overhead_ns += now - t_in
        pending = self._pending
        pending.append(step)
        ctx.last_exit = now
        if collector.thread is None:
            collector.start()
            ctx.last_exit = self._clock()
        elif (now >= collector.catch_up_at or len(pending) > collector.harvest_at) and collector.catch_up(now):
            ctx.last_exit = self._clock()  # the harvest is stepprof's time, not the data wait

    # What the boundaries add (:class:`~.boundaries.Boundaries`): closing a scope after an
    # interrupt landed in it, and stopping recording after an internal error.
    _finish_exit: Callable[[Any, BaseException], None]
    fail: Callable[[BaseException], None]
