"""The state of one step while it is measured and until its record is written.

Also :func:`elapsed_ms`, the device time between two of its marks.

A :class:`Step` is made at the step's entry, filled in at its boundaries on the training
thread, queued at its exit, and read once by the collector.  All three classes use
``__slots__``: one ``Step`` is the only allocation a step without phases makes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .._batch import Tokens
    from .._device.backend import Backend


class OpenPhase:
    """A phase that has been entered and not yet exited: where it started."""

    __slots__ = ("key", "ctx", "mark", "t0", "peak", "syncs")

    def __init__(self, key: str, ctx: Any = None) -> None:
        self.key = key
        self.ctx = ctx  # the thread's step context it was opened in
        self.mark: Any = None
        self.t0 = 0
        self.peak = -1
        self.syncs = 0


class PhaseTotals:
    """A phase name's totals within one step (it may run several times), and its first run's start."""

    __slots__ = ("t0", "wall_ns", "marks", "peak", "count", "syncs")

    def __init__(self, t0: int) -> None:
        self.t0 = t0  # the step clock at the first run's entry (its OpenPhase.t0: no clock read of its own)
        self.wall_ns = 0
        self.marks: list[tuple[Any, Any]] = []
        self.peak = -1
        self.count = 0
        self.syncs = 0


def plus_ns(total_ns: int, ns: int) -> int:
    """``total_ns + ns``, where a ``total_ns`` of -1 means nothing yet (a time not measured)."""
    return ns if total_ns < 0 else total_ns + ns


class Step:
    """One step: its clock readings, device marks, memory reads and phases."""

    __slots__ = (
        "index", "name", "warmup", "batch_size", "t0", "t1", "start_mark", "end_mark",
        "peak", "reserved", "rss", "phases", "overhead_ns", "error", "syncs", "syncs_reason",
        "counters", "phase_peaks", "backend", "ctx", "thread", "shared", "queued", "sampled",
        "data_wait_ns", "data_ns", "wait_in_ns", "global_step", "batch_reason", "times", "flat", "tokens",
    )

    def __init__(self, index: int, name: str, warmup: bool, batch_size: int | None) -> None:
        self.index = index
        self.name = name
        self.warmup = warmup
        self.batch_size = batch_size
        self.t0 = self.t1 = 0
        self.start_mark: Any = None
        self.end_mark: Any = None
        self.peak = -1
        self.reserved: int | None = None
        self.rss: int | None = None
        self.phases: dict[str, PhaseTotals] = {}
        self.overhead_ns = 0
        self.error: dict[str, str] | None = None
        self.syncs: dict[str, Any] | None = None
        self.syncs_reason: str | None = None
        self.counters: tuple[int, ...] | None = None
        self.phase_peaks = True
        # The backend it was measured on: harvested with it even if the profiler has
        # moved from the host to CUDA since (device=None, CUDA initialised later).
        self.backend: Any = None
        self.ctx: Any = None  # the thread's step context it was opened in
        self.thread: str | None = None  # the thread's name, unless it is the training thread
        self.shared = False  # another thread's step overlapped it: no peak of its own
        self.queued = False  # handed to the collector (once)
        # Under overhead_budget: 0 for a light step (no device boundaries), else the interval
        # it was chosen under; without a budget, None.
        self.sampled: int | None = None
        # Host time from the thread's previous step exit to this entry (-1: none), and the
        # part of it spent in stepprof.iterate's __next__ (-1: the loop does not use it).
        self.data_wait_ns = -1
        self.data_ns = -1
        # Input waits inside the step, between its micro-batches (Profiler.add_batch(wait_s=)), -1: none.
        self.wait_in_ns = -1
        self.global_step: int | None = None  # the framework's own step number (begin_step)
        self.batch_reason: str | None = None  # why batch_size is None, when it was not inferred
        #: Each pair of :meth:`flat_marks`' device ms (None: not read yet; see :meth:`read`).
        self.times: tuple[float | None, ...] | None = None
        self.flat: tuple[Any, ...] = ()  # the flat_marks() that were read
        self.tokens: int | Tokens | None = None  # tokens=N, or counted in its batch; None: not counted

    def read(self) -> bool:
        """Whether its marks have all completed; the first time they have, their times are
        read into :attr:`times` (one backend call: ``Backend.read_marks``)."""
        if self.times is not None:
            return True
        if not self.backend.has_device_timing:  # the host: no marks, nothing to wait for
            self.times = ()
            return True
        flat = self.flat_marks()
        times = self.backend.read_marks(flat)
        if times is None:
            return False
        self.times, self.flat = times, flat
        return True

    def gpu_ms(self) -> float | None:
        """The device time between its start and end marks (read once, by :meth:`read`: the
        record and the energy span both need it), or None; None too while it is still running."""
        if self.times is None and not self.read():
            return None
        times = self.times
        return times[0] if times else None

    def flat_marks(self) -> tuple[Any, ...]:
        """Its marks as (start, end, start, end, ...): its own pair, then each phase's runs, in
        the order of :attr:`phases` (the order of :attr:`times`)."""
        if not self.phases:
            return (self.start_mark, self.end_mark)
        out = [self.start_mark, self.end_mark]
        for total in self.phases.values():
            for pair in total.marks:
                out += pair
        return tuple(out)


def elapsed_ms(b: Backend, start: Any, end: Any) -> float | None:
    """Device time between two marks of backend ``b``, or None if either is missing or unusable."""
    if start is None or end is None:
        return None
    try:
        return b.elapsed_ms(start, end)
    except RuntimeError:
        return None
