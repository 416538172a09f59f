"""The periodic ``kind: "memory"`` records of a profiler (``Profiler(memory_every=...)``)."""

from __future__ import annotations

from collections.abc import Callable

from .. import _memory
from .._device.backend import Backend
from .._memory import Snapshot
from .._errors import raised_by_user
from .hooks import Closing, Hook, Quiet
from .sinks import Write
from .step import Step

#: ``MemoryHook.due`` when no further memory record is due (no step has index -1).
_NEVER = -1
_TRACKS_PEAK = Quiet(tracks_peak=True)


class MemoryHook(Hook):
    """The ``kind: "memory"`` records: read on the training thread, reconciled by the collector.

    At the exit of a step that is due one (the first after warm-up, then every
    ``memory_every`` steps) the training thread reads the allocator, ``cudaMemGetInfo``
    and NVML (see bench/memory_costs.py for the cost); the collector reconciles the
    readings and writes the record right after that step's.  Every other step costs one
    call and one integer comparison; once no periodic record is due, nothing.

    Args:
        warmup: the profiler's warm-up steps (the first record follows them).
        every: ``memory_every``: steps between periodic records; 0 for none.
        retire: takes the hook off the step boundaries.
    """

    def __init__(self, *, warmup: int, every: int, retire: Callable[[Hook], None]) -> None:
        self.due = warmup
        self.peak_seen = -1  # the highest step peak written so far (kept by the collector)
        self._warmup = warmup
        self._every = every
        self._retire = retire
        self._snaps: dict[int, tuple[str, Snapshot | str]] = {}

    def on_step_end(self, step: Step, exc: BaseException | None) -> None:
        if step.index == self.due:
            self._snapshot(step, step.backend)

    def _snapshot(self, step: Step, b: Backend) -> None:
        """At the exit of a step due a memory record: read now; the collector reconciles."""
        self.due = step.index + self._every if self._every else _NEVER
        if self.due == _NEVER:
            self._retire(self)
        if not b.has_device_memory:
            return  # on the host there is no GPU memory to reconcile
        trigger = _memory.AFTER_WARMUP if step.index == self._warmup else _memory.PERIODIC
        try:
            _memory.observe(b)  # no-op once the baseline exists
            snap: Snapshot | str = _memory.take_snapshot(b)
        except Exception as e:  # noqa: BLE001 - a missing record, never a stopped recorder
            if raised_by_user(e):
                raise
            snap = f"reading memory failed: {type(e).__name__}: {e}"
        self._snaps[step.index] = (trigger, snap)

    def quiet(self, b: Backend) -> Quiet | None:
        """Until the first step due a memory record, only ``peak_seen`` follows the steps."""
        snaps = self._snaps
        return Quiet(tracks_peak=True, before=min(snaps)) if snaps else _TRACKS_PEAK

    def after_record(self, step: Step, write: Write) -> None:
        """The memory record of ``step``, right after its step record."""
        self.peak_seen = max(self.peak_seen, step.peak)
        if not self._snaps:
            return
        item = self._snaps.pop(step.index, None)
        if item is None:
            return
        trigger, snap = item
        device = step.backend.device
        try:
            if isinstance(snap, str):
                rep = _memory.unavailable_report(device, snap, trigger=trigger, step=step.index)
            else:
                rep = _memory.build(snap, trigger=trigger, step=step.index, peak_floor=self.peak_seen)
        except Exception as e:  # noqa: BLE001 - a missing record, never a stopped collector
            if raised_by_user(e):
                raise
            rep = _memory.unavailable_report(
                device, f"reconciling failed: {type(e).__name__}: {e}", trigger=trigger, step=step.index
            )
        write(rep.to_record())

    def on_close(self, closing: Closing) -> None:
        """The close record (readings of steps never written are dropped)."""
        self._snaps.clear()
        b = closing.backend
        if b is None or not b.has_device_memory or closing.stopped:
            return
        rep = _memory.report(b, trigger=_memory.CLOSE, step=closing.last_step, peak_floor=self.peak_seen)
        closing.write(rep.to_record())

    def forget(self) -> None:
        """After a fork: the readings are the parent's."""
        self._snaps = {}
