"""A profiler's part in the cross-rank exchange of a distributed run (``Profiler(ranks_every=...)``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._dist import Exchange
from .._errors import raised_by_user
from .hooks import Closing, Hook
from .sinks import Write
from .step import Step, elapsed_ms

#: The token of a step entered after recording stopped (see :meth:`ExchangeHook.enter_unrecorded`).
UNRECORDED = object()


class ExchangeHook(Hook):
    """Feeds the exchange's window and counts every step exit in it, recorded or not.

    Every rank must exit the same number of steps for the exchanges to match, so a step
    that recording dropped (after an internal error) still counts, exactly once.

    Args:
        exchange: the exchange.
        harvest_if_free: harvests now unless a harvest is under way.
    """

    keeps_end_marks = True  # the start of the gap to the next step

    def __init__(self, exchange: Exchange, harvest_if_free: Callable[[], None]) -> None:
        self.exchange = exchange
        self._harvest_if_free = harvest_if_free
        self._gap_from: tuple[Any, int] | None = None  # the last step's end, for the next gap
        self._unrecorded_open = False  # a step entered after recording stopped

    # -- training thread ------------------------------------------------------------

    def on_step_end(self, step: Step, exc: BaseException | None) -> None:
        ex = self.exchange
        if ex.due():
            # Bring the window up to date first: the collector runs every 100 ms, so a short
            # window could otherwise still be empty.  This harvests only steps whose events
            # have completed (query(), never a wait).
            self._harvest_if_free()
        ex.step_exit(step.index, step.backend.index)  # after the sync watch: enqueues, never waits

    def on_fail(self, step_open: bool, why: str) -> None:
        if step_open:
            # The step stays open for the exchange until its own exit: the phases entered
            # in it from now on are not steps of their own.
            self._unrecorded_open = True

    def enter_unrecorded(self) -> Any:
        """After an internal error: still count steps, so that the exchanges stay matched."""
        if self._unrecorded_open:
            return None  # a phase of the unrecorded step
        self._unrecorded_open = True
        return UNRECORDED

    def entry_failed(self) -> Any:
        """The step that failed to open still counts: its exit takes part in the exchange."""
        self._unrecorded_open = False
        return self.enter_unrecorded()

    def stopped_in_step(self) -> None:
        """Recording stopped inside a step whose exit has now counted."""
        self._unrecorded_open = False

    def exit_unrecorded(self, token: Any, device_index: int | None) -> None:
        """Exit of a step that recording dropped: take part in its exchange all the same."""
        ex = self.exchange
        if token is UNRECORDED:
            self._unrecorded_open = False
        elif not isinstance(token, Step):
            return  # a phase
        else:
            self._unrecorded_open = False  # the step that was open when recording stopped
            if ex.exits != token.index:
                return  # its exchange already ran
        try:
            ex.step_exit(None if token is UNRECORDED else token.index, device_index)
        except Exception as e:  # noqa: BLE001 - Exchange warns about its own failures
            if raised_by_user(e):
                raise

    # -- collector ------------------------------------------------------------------

    def on_harvest(self, write: Write) -> None:
        self.exchange.poll(write)

    def on_record(self, step: Step, record: dict[str, Any]) -> None:
        """Add a completed step to the exchange window; keep its end mark for the next gap.

        The collector leaves every step's end mark to this hook (``keeps_end_marks``).
        """
        b = step.backend
        prev, self._gap_from = self._gap_from, (step.end_mark, step.t1)
        gap = None
        if prev is not None:
            if prev[0] is not None and step.start_mark is not None:
                gap = elapsed_ms(b, prev[0], step.start_mark)
            elif not b.has_device_timing:
                gap = (step.t0 - prev[1]) / 1e6
            b.release(prev[0])
        if step.warmup or step.error is not None or step.sampled == 0:
            return  # a light step (overhead_budget) has no GPU figures to compare
        gpu_ms = record["gpu_ms"]
        key = "gpu_ms" if gpu_ms is not None else "wall_ms"
        top = {k: v[key] for k, v in record["phases"].items() if "/" not in k}
        self.exchange.window.add(
            gpu_ms, record["wall_ms"], step.peak if step.peak >= 0 else None,
            step.syncs["count"] if step.syncs is not None else None, gap, top)

    def on_close(self, closing: Closing) -> None:
        """Finish the enqueued exchanges (start none); release the last end mark."""
        self.exchange.close(closing.write)
        if self._gap_from is not None and closing.backend is not None:
            closing.backend.release(self._gap_from[0])
