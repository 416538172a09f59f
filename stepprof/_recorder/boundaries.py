"""The training thread's side of the recorder: what a scope's entry and exit do.

:class:`Boundaries` builds on :class:`~.measure.StepMeasure` (what each boundary
measures): it decides whether an entry opens a step or a phase, refuses what cannot be
recorded, and keeps each thread's context consistent after an interrupt or an internal
error.

Threads: each thread has its own step context (:class:`~.threads.ThreadSteps`: its open
step, phase stack and sync tracker).  The *training thread* is the first to open a step;
steps of other threads are recorded too, with their thread's name, and skip the hooks
(FLOPs, memory records, the exchange), which follow the training thread's steps.

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
from collections.abc import Callable, Sequence
from typing import Any

from .._batch import NO_BATCH, Tokens, count_tokens, infer_batch_size
from .._errors import StepprofError, UsageError, raised_by_user, warn
from .exchange import ExchangeHook
from .hooks import Hook
from .measure import _PHASE_ORPHANED, ORPHANED, StepMeasure, error_message  # noqa: F401 - tests read _PHASE_ORPHANED here
from .step import OpenPhase, Step, plus_ns
from .threads import ThreadSteps

# A step or phase that a scope opened is also held by that scope (its token list, or the
# decorator's frame).  Once that holder is gone without closing it (an interrupt landed at
# the very start of the scope's __exit__, before any of its code ran), it is orphaned: only
# stepprof's own references are left.  sys.getrefcount(x) counts them, plus its argument:
# an open step is held by its context's ``step``, the open-steps map and the caller's local
# variable; an open phase by its context's stack.  tests/test_interrupts.py checks both.
_STEP_ORPHANED = 4  # (an open phase's count, _PHASE_ORPHANED, is in measure.py, beside its check)


#: The token of a phase entered in a light step (``overhead_budget``): nothing is recorded.
LIGHT_PHASE = object()


class Boundaries(StepMeasure):
    """The threads' open steps and phase stacks, and what each boundary records.

    Each thread has its own :class:`ThreadSteps`.  An internal error stops recording
    (:meth:`fail`), never the training; an exception of the user's that lands inside a
    boundary propagates unchanged, after the boundary has left the thread's context
    consistent (see the module docstring).

    Args: as :class:`~.measure.StepMeasure`.
    """

    # -- hooks ------------------------------------------------------------------------

    def use(self, hooks: Sequence[Hook]) -> None:
        """Call these hooks at step entry and exit (each only where its class overrides)."""
        self.hooks.use(hooks)
        self._exchange = next((h for h in hooks if isinstance(h, ExchangeHook)), None)

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

        def begin_phase(ctx: ThreadSteps, step: Step, name: str, t_in: int) -> OpenPhase:
            ph: OpenPhase = begin(ctx, step, name, t_in)
            fn("enter", ph.key)
            return ph

        def end_phase(ctx: ThreadSteps, step: Step, ph: OpenPhase, exc: BaseException | None, t_in: int) -> None:
            if ph in ctx.stack:  # it closes the phases left open inside it too
                for top in reversed(ctx.stack[ctx.stack.index(ph):]):
                    fn("exit", top.key)
            end(ctx, step, ph, exc, t_in)

        self.begin_phase = begin_phase  # type: ignore[method-assign]
        self.end_phase = end_phase  # type: ignore[method-assign]

    # -- the threads' contexts ---------------------------------------------------------

    def note_batch(self, data_ns: int | None, batch: tuple[int | None, str | None], tokens: Tokens | None) -> None:
        """A batch for this thread's next step (``stepprof.iterate``, ``Profiler.add_batch``):
        the nanoseconds fetching it took (None: not measured), its size or why not, and its
        tokens (None: it holds none)."""
        ctx = self.context()
        if data_ns is not None:
            ctx.data_ns = plus_ns(ctx.data_ns, data_ns)
        ctx.batch = batch
        ctx.tokens = tokens

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
        infers when it has none.  stepprof's time (``overhead_us``) runs from here.
        """
        t_in = self._clock()
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
                if batch is not NO_BATCH:  # a measured function's batch: its size and tokens
                    if batch_size is None:
                        batch_size, batch_reason = infer_batch_size(batch)
                    ctx.tokens = count_tokens(batch) or ctx.tokens
                return self.begin_step(ctx, name or "step", batch_size, budget, batch_reason, t_in)
            return self.begin_phase(ctx, open_step, name or "phase", t_in)
        except BaseException as e:  # noqa: BLE001 - stepprof never breaks training
            return self.entry_failed(ctx, open_step, depth, e)

    def entry_failed(self, ctx: ThreadSteps, open_step: Step | None, depth: int, e: BaseException) -> Any:
        """An exception inside an entry (this class's or the step core's, :mod:`.core`), which
        had ``depth`` phases open and ``open_step`` (None: it was opening a step).

        stepprof's own usage errors and the user's exceptions (an interrupt: the context is
        left consistent first) are raised again; an internal failure stops recording and
        returns the token the scope gets.
        """
        if isinstance(e, StepprofError):
            raise e
        if raised_by_user(e):  # an interrupt: leave the context consistent, re-raise it
            self._undo_entry(ctx, open_step, depth, e)
            raise e
        self.fail(e)
        if open_step is None and self._exchange is not None and ctx.hooked:
            return self._exchange.entry_failed()
        return None

    def exit(self, token: Any, exc: BaseException | None) -> None:
        """Close the step or phase that :meth:`enter` returned ``token`` for.

        Idempotent: a token already closed (an exit that an interrupt cut short, done
        again by the scope) is a no-op.  The step's or phase's time ends here.
        """
        t_in = self._clock()
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
                    self.end_step(ctx, token, exc, t_in)
                    if self.broken is not None and self._exchange is not None and ctx.hooked:
                        self._exchange.stopped_in_step()  # recording stopped within this step
            else:
                ctx = token.ctx
                if ctx.step is not None:
                    self.end_phase(ctx, ctx.step, token, exc, t_in)
        except BaseException as e:  # noqa: BLE001 - stepprof never breaks training
            self.exit_failed(token, e)
            return
        if isinstance(token, Step):
            tracker = token.ctx.tracker
            if exc is None and tracker.deferred is not None:
                # A step over its budget on the "trace" route, where the callback that found it
                # could not raise (torch calls it from C++): raised at the step's exit instead.
                deferred, tracker.deferred = tracker.deferred, None
                raise deferred

    def exit_failed(self, token: Any, e: BaseException) -> None:
        """An exception inside the exit of ``token``'s scope (this class's or the step core's):
        the user's is raised again once the scope is closed; an internal failure stops recording."""
        if raised_by_user(e):
            self._finish_exit(token, e)
            raise e
        self.fail(e)
        if self._exchange is not None and isinstance(token, Step) and token.ctx.hooked:
            self._exchange.exit_unrecorded(token, self.slot.device_index())
            self._exchange.stopped_in_step()

    def _exit_unrecorded(self, token: Any) -> None:
        """The exit of a scope that is not recorded (recording stopped, or closed)."""
        if isinstance(token, Step):
            ctx = token.ctx
            if ctx.step is token:
                self._discard(ctx)
            if self._exchange is not None and ctx.hooked and not self.closed:
                self._exchange.exit_unrecorded(token, self.slot.device_index())
                if self.broken is not None:
                    self._exchange.stopped_in_step()
        elif isinstance(token, OpenPhase):
            ctx = token.ctx
            if token in ctx.stack:
                del ctx.stack[ctx.stack.index(token):]
        elif self._exchange is not None and not self.closed:
            self._exchange.exit_unrecorded(token, self.slot.device_index())

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
                    b = self.slot.backend
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
                    token.backend = self.slot.backend
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
        b = self.slot.backend
        while len(ctx.stack) > depth:
            ctx.stack.pop()
            if b is not None:
                b.range_pop()

    def _close_orphan(self, ctx: ThreadSteps, step: Step) -> None:
        """Close a step that its scope left open, recorded with the reason."""
        step.error = {"type": "Interrupted", "message": ORPHANED}
        self._finish_exit(step, RuntimeError(ORPHANED))

    # -- failure ---------------------------------------------------------------------

    def _discard(self, ctx: ThreadSteps) -> None:
        """Drop this thread's open step and phases unrecorded: NVTX ranges and sync watch undone."""
        self._unwatch(ctx)
        b = self.slot.backend
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
        ctx = self.threads.current()
        step_open = ctx is not None and ctx.step is not None
        why = f"{type(exc).__name__}: {exc}"
        for hook in self.hooks.all:
            hook.on_fail(step_open and ctx.hooked, why)  # type: ignore[union-attr]
        if self.broken is None:
            self.broken = f"stepprof stopped recording after an internal error: {why}"
            warn(self.broken, stacklevel=3)
        if ctx is not None:  # other threads' open steps are dropped at their own exits
            self._discard(ctx)

    def forget(self, why: str) -> None:
        """In a forked child: record nothing more, and warn at the first use."""
        self.broken = self._warn_at_entry = why
        self.threads.forget()
        self.hooks.clear()
        self._exchange = None
        self._pending = self._collector.pending
        self._writer = None

