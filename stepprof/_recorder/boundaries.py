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
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import _memory
from .._device.backend import Backend
from .._device.cuda import upgrade_from_host
from .._errors import StepprofError, UsageError
from .._syncs import SyncTracker
from .collector import Collector
from .exchange import ExchangeHook
from .hooks import Hook
from .step import OpenPhase, PhaseTotals, Step

#: The step clock: nanoseconds, monotonic.
Clock = Callable[[], int]


def error_message(exc: BaseException) -> str:
    """The user's exception's message for a step's ``error``, truncated to 2000 characters."""
    try:
        return str(exc)[:2000]
    except Exception as e:  # noqa: BLE001 - its own __str__ failing is the user's, not ours
        return f"<unprintable {type(exc).__name__}: its __str__ raised {type(e).__name__}>"


class Boundaries:
    """The open step and phase stack, and what each step and phase boundary records.

    One thread records at a time (the first to enter a step owns the profiler until
    that step exits).  An internal error stops recording (:meth:`fail`), never the
    training.

    Args:
        collector: where finished steps are queued.
        backend: the device backend, or None to choose it at the first step.
        clock: the step clock.
        device: the ``device`` argument (None: CUDA once the training code initialised it).
        nvtx, syncs: the backend's settings.
        warmup, max_syncs, on_sync, phase_peaks_every: the profiler's settings.
        read_rss: reads this process's resident set size (host steps record it).
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
    ) -> None:
        self.backend = backend
        self.closed = False
        self.broken: str | None = None  # why recording stopped
        self.step: Step | None = None  # the open step
        self.owner: int | None = None  # the thread that records
        self.next_index = 0
        self._collector = collector
        self._pending = collector.pending
        self._writer = collector.log.writer  # read at each step exit: whether writing failed
        self._inline = collector.every_s is None
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
        self._stack: list[OpenPhase] = []
        self._last_top_mark: Any = None
        self._tracker = SyncTracker(syncs)
        self._watching = False
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

    # -- entry and exit, shared by steps, phases and measured functions -------------

    def enter(
        self,
        name: str | None,
        batch_size: int | None,
        *,
        step: bool,
        budget: tuple[int | None, str | None] = (None, None),
    ) -> Any:
        """Open a step (``step=True``, or no step is open) or a phase; return a token."""
        if self.closed:
            raise UsageError(
                "this Profiler is closed; open a new stepprof.Profiler(...) for more steps"
            )
        if self.broken is not None:
            if self._warn_at_entry is not None:
                why, self._warn_at_entry = self._warn_at_entry, None
                warnings.warn(f"stepprof: {why}", RuntimeWarning, stacklevel=4)
            return self._exchange.enter_unrecorded() if self._exchange is not None else None
        tid = threading.get_ident()
        if self.owner != tid:
            if self.owner is not None and self.step is not None:
                return None  # another thread's call while a step is open: not recorded
            self.owner = tid
        open_step = self.step
        if open_step is not None and step:
            raise UsageError(
                f"profile_step() was entered inside step {open_step.index} "
                f"({open_step.name!r}); steps do not nest. Use stepprof.measure({name or 'name'!r}) "
                f"for a phase inside a step, or leave the outer step first"
            )
        try:
            if open_step is None:
                return self.begin_step(name or "step", batch_size, budget)
            return self.begin_phase(open_step, name or "phase")
        except StepprofError:
            raise
        except Exception as e:  # noqa: BLE001 - stepprof never breaks training
            self.fail(e)
            if open_step is None and self._exchange is not None:
                return self._exchange.entry_failed()
            return None

    def exit(self, token: Any, exc: BaseException | None) -> None:
        """Close the step or phase that :meth:`enter` returned ``token`` for."""
        if token is None or self.broken is not None:
            if token is not None and self._exchange is not None:
                self._exchange.exit_unrecorded(token, self._device_index())
            return
        try:
            if isinstance(token, Step):
                if token is self.step:
                    self.end_step(token, exc)
                if self.broken is not None and self._exchange is not None:
                    self._exchange.stopped_in_step()
            elif self.step is not None:
                self.end_phase(self.step, token, exc)
        except Exception as e:  # noqa: BLE001 - stepprof never breaks training
            self.fail(e)
            if self._exchange is not None:
                self._exchange.exit_unrecorded(token, self._device_index())
        if exc is None and isinstance(token, Step) and self._tracker.deferred is not None:
            # A step over its budget on the "trace" route, where the callback that found it
            # could not raise (torch calls it from C++): raised at the step's exit instead.
            deferred, self._tracker.deferred = self._tracker.deferred, None
            raise deferred

    def _device_index(self) -> int | None:
        return self.backend.index if self.backend is not None else None

    # -- the boundaries ----------------------------------------------------------------

    def ensure_backend(self) -> Backend:
        """The backend, chosen at the first step; a host one moves to CUDA once it is up.

        With ``device=None``, a profiler that started on the host (CUDA not initialised
        yet) switches to CUDA at the first step after the training code initialised it.
        """
        b = upgrade_from_host(self.backend, self._device_arg, pinned=self._pinned, nvtx=self._nvtx,
                              syncs=self._sync_mode)
        if b is None:
            return self.backend  # type: ignore[return-value]
        self.backend = b
        if b.has_device_memory:  # CUDA, seen for the first time: the context baseline
            _memory.observe(b)
        return b

    def begin_step(
        self, name: str, batch_size: int | None, budget: tuple[int | None, str | None]
    ) -> Step:
        for hook in self._begin_hooks:
            hook.on_step_begin(self.next_index)
        t_in = self._clock()
        b = self.ensure_backend()
        index = self.next_index
        self.next_index += 1
        step = Step(index, name, index < self._warmup, batch_size)
        step.backend = b
        n = self._phase_peaks_every
        if n != 1:
            step.phase_peaks = n > 0 and (
                step.warmup or self._steady < 2 or index - self._phase_peaks_at >= n
            )
        if step.phase_peaks:
            self._phase_peaks_at = index
        self.step = step
        b.range_push(f"{name} {index}")
        if self._counters is None and b.has_device_memory:
            mem = b.read_memory()  # once: the baseline of the allocator's counters
            self._counters = mem[2] if mem is not None else None
        max_syncs = self._max_syncs if budget[0] is None else budget[0]
        self._tracker.begin(self._stack, max_syncs, budget[1] or self._on_sync, not step.warmup)
        step.syncs_reason = b.watch_syncs(self._tracker)
        self._watching = step.syncs_reason is None
        b.reset_peak()
        step.start_mark = self._last_top_mark = b.mark()
        step.t0 = self._clock()
        step.overhead_ns = step.t0 - t_in
        return step

    def _fold_peak(self, step: Step, b: Backend) -> tuple[int, int, Any] | None:
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
                self.backend.unwatch_syncs()  # type: ignore[union-attr]
            except Exception as e:  # noqa: BLE001 - stepprof never breaks training
                self.fail(e)

    def begin_phase(self, step: Step, name: str) -> OpenPhase:
        t_in = self._clock()
        b = self.backend
        assert b is not None
        if self._stack:
            # Nested: read the enclosing phase's peak so far before the reset, and
            # give the phase its own start event.
            ph = OpenPhase(f"{self._stack[-1].key}/{name}")
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
            # which saves a raw-stats read and an event record per phase (see
            # bench/boundary_costs.py).  Any device work or allocation between two
            # phases counts toward the next.
            ph = OpenPhase(name)
            b.range_push(name)
            self._stack.append(ph)
            ph.mark = self._last_top_mark
        ph.t0 = self._clock()
        step.overhead_ns += ph.t0 - t_in
        return ph

    def end_phase(self, step: Step, ph: OpenPhase, exc: BaseException | None) -> None:
        t_in = self._clock()
        b = self.backend
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
                total = step.phases[top.key] = PhaseTotals()
            total.wall_ns += t_in - top.t0
            total.marks.append((top.mark, end))
            if top.peak > total.peak:
                total.peak = top.peak
            total.count += 1
            total.syncs += top.syncs
            if top is ph:
                break
        step.overhead_ns += self._clock() - t_in

    def end_step(self, step: Step, exc: BaseException | None) -> None:
        step.t1 = self._clock()
        b = self.backend
        assert b is not None
        raised = exc  # the user's exception (the hooks get this one)
        try:
            if self._stack:  # phases left open (a generator suspended mid-phase, say)
                self.end_phase(step, self._stack[0], exc)
            t_in = self._clock()
            step.end_mark = b.mark()
            mem = self._fold_peak(step, b)
            if self._watching:
                step.syncs = self._tracker.end()
                if exc is None and self._tracker.deferred is not None:
                    exc = self._tracker.deferred  # the "trace" route's: exit() raises it
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
        if not b.has_device_memory:
            step.rss = self._read_rss()
        b.range_pop()
        for hook in self._end_hooks:
            hook.on_step_end(step, raised)
        if exc is not None:
            step.error = {"type": type(exc).__name__, "message": error_message(exc)}
        self.step = None
        self._last_top_mark = None
        collector = self._collector
        if self._inline:  # inline mode: harvest older steps here
            collector.harvest()
            step.overhead_ns += self._clock() - t_in
            self._pending.append(step)
            if not b.has_device_timing:
                collector.harvest()  # nothing to wait for on the host: write it now
            return
        if collector.error is not None or (self._writer is not None and self._writer.failed is not None):
            self.warn_async()
        step.overhead_ns += self._clock() - t_in
        self._pending.append(step)
        if collector.thread is None:
            collector.start()

    # -- failure ---------------------------------------------------------------------

    def warn_async(self) -> None:
        """Warn, from the training thread, about what went wrong on the collector thread."""
        for why in (self._collector.error, self._collector.log.failed):
            if why is not None and why not in self._warned:
                self._warned.add(why)
                warnings.warn(f"stepprof: {why}; logging stopped", RuntimeWarning, stacklevel=4)

    def fail(self, exc: BaseException) -> None:
        """An internal failure: stop recording, keep training, say so once."""
        self._unwatch()
        why = f"{type(exc).__name__}: {exc}"
        for hook in self._hooks:
            hook.on_fail(self.step is not None, why)
        if self.broken is None:
            self.broken = f"stepprof stopped recording after an internal error: {why}"
            warnings.warn(self.broken, RuntimeWarning, stacklevel=3)
        b = self.backend
        if b is not None:  # close the NVTX ranges this step had opened
            for _ in range(len(self._stack) + (self.step is not None)):
                try:
                    b.range_pop()
                except Exception:  # noqa: BLE001
                    break
        self.step = None
        self._stack.clear()

    def forget(self, why: str) -> None:
        """In a forked child: record nothing more, and warn at the first use."""
        self.broken = self._warn_at_entry = why
        self.step = None
        self._stack = []
        self._hooks = self._begin_hooks = self._end_hooks = ()
        self._exchange = None
        self._pending = self._collector.pending
        self._writer = None
