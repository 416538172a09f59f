"""How a profiler's run ends: :meth:`close`, a signal, interpreter exit, or a fork
(:class:`Lifecycle`, a part of :class:`~.profiler.Profiler`)."""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

from .._errors import raised_by_user
from .._records import Summary
from .._registry import forget_open
from .._signals import Deferring
from .._syncs import NOT_WATCHED
from .boundaries import Boundaries
from .collector import Collector
from .core import reason as core_reason
from .energy import ENERGY_OFF
from .hooks import Closing, Hook
from .sinks import LogSink, SummarySink

# Why an inherited profiler records nothing in a forked child (see Lifecycle._forked).
_INHERITED_PREFIX = "this Profiler was inherited by the forked process"
_INHERITED = _INHERITED_PREFIX + (
    " {pid}: a profiler records only in the "
    "process that created it, so it records nothing here; open a new stepprof.Profiler in the "
    "child to profile it"
)


class Lifecycle:
    """The end of a run: the summary, written once by whoever ends it first (``close``, a
    signal's handler, interpreter exit), and a forked child's profiler that records nothing."""

    log: str | None
    _boundaries: Boundaries
    _collector: Collector
    _log: LogSink
    _summary_sink: SummarySink
    _summary: Summary | None
    _ended_by: str | None
    _core: Any
    boundary: str
    _signal_written: int
    _close_lock: Any
    _hooks: list[Hook]
    _begun: dict[int, list[tuple[str | None, Any]]]
    _flops: Any
    _memory: Any
    _energy: Any
    _exchange: Any
    _compiles: Any
    if TYPE_CHECKING:  # the profiler's: a Registered, to the registry
        @property
        def closed(self) -> bool: ...
        def close(self, error: BaseException | None = None) -> Summary: ...

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
                b.end_step(ctx, ctx.step, RuntimeError("profiler closed while the step was open"), b._clock())
        except Exception as e:  # noqa: BLE001 - close must always produce a summary
            if raised_by_user(e):
                raise
            b.fail(e)
        # From here on, other threads' steps neither start nor write: close writes what
        # was pending when it began, and returns while they go on.
        b.closing = True
        collector.stop()
        # Held to the end: no harvest writes to a log being closed.  A signal meanwhile
        # proceeds after it, and its handler finds the summary written.
        with Deferring(collector.lock), collector.lock:
            try:
                collector.finish()
            except Exception as e:  # noqa: BLE001 - close must always produce a summary
                if raised_by_user(e):
                    raise
                b.fail(e)
            collector.pending.clear()
            collector.held.clear()
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
        boundary, boundary_reason = self._boundary_used()
        return self._summary_sink.summary(
            log=self.log,
            ended_by=ended_by,
            device=b.device if b is not None else "none",
            stopped=self._collector.error or self._boundaries.broken,
            log_failed=self._log.failed,
            flops_reason=self._flops.summary_reason() if self._flops is not None else None,
            boundary=boundary,
            budget=self._collector.budget,
            syncs_outside=b.syncs_outside_steps() if b is not None else (None, NOT_WATCHED),
            energy_reason=ENERGY_OFF if self._energy is None else None,
            boundary_reason=boundary_reason,
        )

    def _boundary_used(self) -> tuple[str | None, str | None]:
        """The summary's ``boundary``, and why it is ``"python"``: ``"compiled"`` where the
        boundaries ran in the step core (``stepprof/_core.c``) and, on CUDA, their device work on
        the compiled boundary; None before any step."""
        b = self._boundaries.backend
        if b is None:
            return None, None
        core_why = None if self._core is not None else core_reason(self.boundary)
        if b.has_device_timing and b.boundary != "compiled":
            return "python", self._boundaries.slot.reason() or core_why
        return ("compiled", None) if core_why is None else ("python", core_why)

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
        # The collector thread holds this lock only while it writes, so wait a little, no
        # more.  This thread never holds it here: a signal that lands while it does waits
        # until it lets go (_signals.Deferring).  The block is entered before the lock is
        # taken: a second SIGTERM or SIGINT just after acquire() returned waits too, where
        # its handler's exception would have left the lock held (close would wait forever).
        with Deferring(collector.lock):
            locked = collector.lock.acquire(timeout=0.2)
            try:
                if locked:
                    try:
                        collector.harvest()  # completed steps only: never waits on the device
                        # Those waiting for their energy sample too: the process may end now.
                        why = f"{name} arrived before the energy sample after this step"
                        collector.held.write(True, why=why)
                    except Exception as e:  # noqa: BLE001, S110 - the summary still goes out
                        if raised_by_user(e):
                            raise
                self._log.write_now(self._build_summary(self._ended_by).to_record())
                self._signal_written = self._log.count
            finally:
                if locked:
                    collector.lock.release()

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
