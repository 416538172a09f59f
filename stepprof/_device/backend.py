"""What the recorder and the sweep need from a device: the :class:`Backend` contract.

A backend gives the recorder marks to time the device, the allocator's figures,
NVTX ranges and its waits.  Callers never ask which class a backend is: they read
its capabilities (:attr:`Backend.index`, :attr:`Backend.has_device_timing`,
:attr:`Backend.has_device_memory`, :attr:`Backend.sync_mechanism`), and a figure a
backend cannot give comes with a reason (``gpu_reason``, ``memory_reason``).

:class:`HostBackend` stands in where there is no CUDA (and
:class:`HostSweepBackend` for the sweep); the CUDA ones are in
:mod:`stepprof._device.cuda`, and tests drive the recorder with a fake that has the
same attributes and methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from .._validate import SYNC_MECHANISMS

if TYPE_CHECKING:  # annotations only: _syncs imports torch, and this module needs none
    from .._syncs import SyncTracker

__all__ = [
    "ALLOCATOR_COUNTERS",
    "MARK",
    "POP",
    "PUSH",
    "READ",
    "RESET",
    "BoundaryOps",
    "SYNC_MECHANISMS",
    "AllocatorFigures",
    "Backend",
    "HistoryStart",
    "HostBackend",
    "HostSweepBackend",
    "SweepBackend",
]

#: The allocator's own hidden-sync counters, reported as per-step deltas.
ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free")

Counters = tuple[int, ...]

#: What one boundary call (:meth:`Backend.cross`) does, in this order: pop the innermost
#: NVTX range, record a mark, read the allocator's figures, reset its peak, push a range.
POP = 16
MARK = 1
READ = 2
RESET = 4
PUSH = 8

#: A memory read: (peak allocated since the last reset, reserved now, then the allocator's
#: cumulative :data:`ALLOCATOR_COUNTERS`, which a torch that lacks them leaves out).
Memory = tuple[int, ...]


class AllocatorFigures(NamedTuple):
    """The caching allocator's figures for one device, from one raw-stats read."""

    allocated_bytes: int
    #: Since the last reset of the peak counters (stepprof resets them at every boundary).
    peak_allocated_bytes: int
    reserved_bytes: int
    inactive_split_bytes: int
    #: Cumulative since the process started (or ``reset_accumulated_memory_stats``).
    num_ooms: int
    num_alloc_retries: int


class HistoryStart(NamedTuple):
    """The allocator's history is being recorded: the snapshot taken right after it began,
    the host's epoch clock (µs, ``time.time_ns() / 1000``) around that snapshot, and whether
    ``record_function`` ranges from every thread go into the history's
    ``external_annotations`` (``global_record_annotations``)."""

    #: torch's ``_snapshot()`` format; None when only the history could be turned on.
    snapshot: dict[str, Any] | None
    host_before_us: float
    host_after_us: float
    annotations: bool = False


class Backend(Protocol):
    """What the recorder needs from a device.  Marks are opaque to the recorder.

    The four capabilities are the contract callers branch on:

    - ``index``: the CUDA device index, or None when the backend is not on a CUDA device.
    - ``has_device_timing``: marks are device events, so GPU time and gaps come from
      them; without it the host clock times the step (and a profiler or sweep that
      chose the host may switch once CUDA comes up, see
      :func:`stepprof._device.select.upgrade_from_host`).
    - ``has_device_memory``: the caching allocator's figures (peak, reserved, counters)
      are real; without them the recorder reads the host's RSS instead, and
      ``memory_reason`` says why.
    - ``sync_mechanism``: how syncs are counted (one of :data:`SYNC_MECHANISMS` but
      "off"), or None when they are not.
    """

    # Read-only to the callers (properties here): a backend may narrow them (index: int).
    @property
    def device(self) -> str: ...
    @property
    def index(self) -> int | None: ...
    @property
    def has_device_timing(self) -> bool: ...
    @property
    def has_device_memory(self) -> bool: ...
    @property
    def sync_mechanism(self) -> str | None: ...
    #: Why device timing is unavailable, or None when marks are real.
    @property
    def gpu_reason(self) -> str | None: ...
    #: Why allocator memory figures are unavailable, or None when they are real.
    @property
    def memory_reason(self) -> str | None: ...
    #: "python" (:class:`BoundaryOps`) or "compiled" (one C++ call per boundary).
    @property
    def boundary(self) -> str: ...

    def cross(self, flags: int, name: str | None = None) -> tuple[Any | None, Memory | None]: ...
    def mark(self) -> Any | None: ...
    def is_done(self, mark: Any) -> bool: ...
    def elapsed_ms(self, start: Any, end: Any) -> float: ...
    def release(self, mark: Any) -> None: ...
    # The collector's, once per step: its marks' times, and their release.
    def read_marks(self, marks: tuple[Any, ...]) -> tuple[float | None, ...] | None: ...
    def release_marks(self, marks: tuple[Any, ...], keep: Any = None) -> None: ...
    #: Where released marks go, when that is all :meth:`release_marks` does (each distinct
    #: mark once, but ``keep``): the C harvest then gives them back itself; None: it calls it.
    event_pool: list[Any] | None
    def reset_peak(self) -> None: ...
    def read_memory(self) -> Memory | None: ...
    def synchronize(self) -> None: ...
    def wait(self, marks: list[Any]) -> None: ...
    def range_push(self, name: str) -> None: ...
    def range_pop(self) -> None: ...
    def watch_syncs(self, tracker: SyncTracker) -> str | None: ...
    def unwatch_syncs(self, tracker: SyncTracker) -> None: ...
    # Once per profiler: its sync session's end (at close, in a forked child), its figure.
    def end_syncs(self) -> None: ...
    def syncs_outside_steps(self) -> tuple[int | None, str | None]: ...
    # For the memory reconciliation, never per step:
    def read_allocator(self) -> AllocatorFigures | None: ...
    def mem_get_info(self) -> tuple[int, int] | None: ...
    def identity(self) -> tuple[str | None, str | None]: ...
    # For explain_peak, on one step only (see stepprof._recorder.peak):
    def begin_history(self, max_entries: int) -> HistoryStart | str: ...
    def end_history(self) -> dict[str, Any]: ...


class SweepBackend(Backend, Protocol):
    """A :class:`Backend` plus the allocator reads and the cache release of the sweep.

    Each read is None where ``has_device_memory`` is false.
    """

    def allocator_counters(self) -> tuple[int, int] | None: ...
    def allocated_bytes(self) -> int | None: ...
    def empty_cache(self) -> None: ...
    def capacity_bytes(self) -> int | None: ...


class BoundaryOps:
    """:meth:`Backend.cross` made of a backend's single calls (the Python boundary).

    A backend with a compiled boundary overrides :meth:`cross` with one call that does
    the same work (:mod:`stepprof._device.compiled`).
    """

    #: Which boundary does the device work: "python" (these single calls) or "compiled".
    boundary = "python"
    event_pool: list[Any] | None = None

    def cross(self, flags: int, name: str | None = None) -> tuple[Any | None, Memory | None]:
        """One boundary's device work: ``flags`` is a sum of :data:`POP`, :data:`MARK`,
        :data:`READ`, :data:`RESET` and :data:`PUSH` (done in that order); ``name`` is the
        pushed range's.  Returns (the mark or None, the memory read or None)."""
        if flags & POP:
            self.range_pop()  # type: ignore[attr-defined]
        mark = self.mark() if flags & MARK else None  # type: ignore[attr-defined]
        mem = self.read_memory() if flags & READ else None  # type: ignore[attr-defined]
        if flags & RESET:
            self.reset_peak()  # type: ignore[attr-defined]
        if flags & PUSH:
            self.range_push(name)  # type: ignore[attr-defined]
        return mark, mem

    def core_plan(self) -> tuple[Any, ...]:
        """How the step core (``stepprof/_core.c``) crosses a boundary on this backend:
        ``(0,)``: nothing to do; ``(1, boundary, event pool, make event, device index, flag
        mask)``: the compiled CUDA boundary's call, with its pool; ``(2, cross)``: call
        :meth:`cross`.  Asked once per backend object."""
        return (2, self.cross)

    def read_marks(self, marks: tuple[Any, ...]) -> tuple[float | None, ...] | None:
        """A step's device times: ``marks`` is (start, end, start, end, ...).  None until every
        end mark has completed (queried, never waited on); then each pair's milliseconds, None
        where a mark is None or its time cannot be read.  One call per step for the collector
        (a compiled backend makes it one C call)."""
        is_done = self.is_done  # type: ignore[attr-defined]
        for i in range(1, len(marks), 2):
            if not is_done(marks[i]):
                return None
        out: list[float | None] = []
        for i in range(0, len(marks), 2):
            start, end = marks[i], marks[i + 1]
            ms = None
            if start is not None and end is not None:
                try:
                    ms = self.elapsed_ms(start, end)  # type: ignore[attr-defined]
                except RuntimeError:
                    pass
            out.append(ms)
        return tuple(out)

    def release_marks(self, marks: tuple[Any, ...], keep: Any = None) -> None:
        """Give back every mark of a read step once (top-level phases share boundary marks),
        but ``keep`` (a mark a hook still needs)."""
        seen = {id(keep)} if keep is not None else set()
        for m in marks:
            if m is not None and id(m) not in seen:
                seen.add(id(m))
                self.release(m)  # type: ignore[attr-defined]


class HostBackend(BoundaryOps):
    """No device: marks are None, memory figures are unavailable with ``reason``."""

    index = None
    has_device_timing = False
    has_device_memory = False

    def __init__(self, reason: str) -> None:
        self.device = "cpu"
        self.gpu_reason = reason
        self.memory_reason = (
            f"{reason}; torch's CPU allocator keeps no peak counter (see host_rss_bytes)"
        )
        #: reserved_bytes is not a peak: its own reason.
        self.reserved_reason = f"{reason}: memory reserved by CUDA's caching allocator (see host_rss_bytes)"
        self.sync_mechanism: str | None = None
        self.sync_reason = f"{reason}: there is no device for the host to wait on"

    def cross(self, flags: int, name: str | None = None) -> tuple[None, None]:
        """No mark, no memory read, no range: the host has none of them (one call, not five)."""
        return None, None

    def core_plan(self) -> tuple[Any, ...]:
        return (0,) if type(self).cross is HostBackend.cross else (2, self.cross)

    def mark(self) -> None:
        return None

    def is_done(self, mark: Any) -> bool:
        return True

    def elapsed_ms(self, start: Any, end: Any) -> float:  # pragma: no cover - never called
        raise AssertionError("HostBackend has no marks")

    def release(self, mark: Any) -> None:
        pass

    def read_marks(self, marks: tuple[Any, ...]) -> tuple[None, ...]:
        return (None,) * (len(marks) // 2)  # no marks: nothing to wait for, no device time

    def release_marks(self, marks: tuple[Any, ...], keep: Any = None) -> None:
        pass

    def reset_peak(self) -> None:
        pass

    def read_memory(self) -> None:
        return None

    def synchronize(self) -> None:
        pass

    def wait(self, marks: list[Any]) -> None:
        pass

    def range_push(self, name: str) -> None:
        pass

    def range_pop(self) -> None:
        pass

    def watch_syncs(self, tracker: SyncTracker) -> str:
        return self.sync_reason

    def unwatch_syncs(self, tracker: SyncTracker) -> None:
        pass

    def end_syncs(self) -> None:
        pass

    def syncs_outside_steps(self) -> tuple[None, str]:
        return None, self.sync_reason

    def read_allocator(self) -> None:
        return None

    def mem_get_info(self) -> None:
        return None

    def identity(self) -> tuple[None, None]:
        return None, None

    def begin_history(self, max_entries: int) -> str:
        return f"{self.gpu_reason}: there is no CUDA allocator whose history could be recorded"

    def end_history(self) -> dict[str, Any]:  # pragma: no cover - begin_history never starts it
        raise AssertionError("HostBackend records no history")


class HostSweepBackend(HostBackend):
    """No device: the sweep times with the host clock and has no memory figures."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.memory_reason = f"{reason}; torch's CPU allocator keeps no peak or retry counters"

    def allocator_counters(self) -> None:
        return None

    def allocated_bytes(self) -> None:
        return None

    def empty_cache(self) -> None:
        pass

    def capacity_bytes(self) -> None:
        return None
