"""The CUDA backends, and the choice between them and the host's.

:class:`CudaBackend` times steps with CUDA events, reads torch's caching
allocator through its raw-stats call, and pushes NVTX ranges.  The calls are the
cheapest torch offers for each job, chosen by their per-call host cost (see
bench/primitives.py): ``torch.Event.record()`` (which finds the current stream in
C++) rather than ``torch.cuda.Event.record()``, ``torch._C._cuda_memoryStats``
rather than ``torch.cuda.max_memory_allocated()`` (which flattens the whole
dict), ``torch._C._cuda_resetPeakMemoryStats`` and the C NVTX bindings.  None of
them synchronises: ``query()`` polls, and ``elapsed_time`` is only called once
both events have completed.

The memory reconciliation (:mod:`stepprof._memory`) reads three more things
here, never per step: the allocator's detailed figures (the same raw-stats
call), ``torch.cuda.mem_get_info`` and the device's identity (UUID and PCI bus
id, from ``get_device_properties``), which :mod:`stepprof._device.nvml` uses to
find the same GPU in NVML.

Which backend a step gets is decided in :mod:`stepprof._device.select`.
"""

from __future__ import annotations

import inspect
import os
import time
from typing import Any

import torch

from .. import _syncs
from .._errors import raised_by_user, warn
from .backend import ALLOCATOR_COUNTERS, AllocatorFigures, BoundaryOps, HistoryStart, Memory
from .sync_routes import enable_gpu_trace, register_repeat_interleave_probe, trace_route, warn_route

__all__ = ["CudaBackend", "CudaSweepBackend"]


#: Where a tool (Nsight Systems, Nsight Compute) tells NVTX to load its injection library.
#: Without it, NVTX drops every range a process pushes, so stepprof pushes none.
NVTX_INJECTION = "NVTX_INJECTION64_PATH"


def nvtx_attached() -> bool:
    """Whether a tool is there to receive NVTX ranges (:data:`NVTX_INJECTION` is set)."""
    return bool(os.environ.get(NVTX_INJECTION))


class CudaBackend(BoundaryOps):
    """CUDA events from a reusable pool, the raw allocator stats, NVTX.

    Events are ``torch.Event(device="cuda:N", enable_timing=True)``: its
    ``record()`` finds the current stream in C++, several times cheaper than
    ``torch.cuda.Event.record()`` (see bench/primitives.py).  An event goes back
    to the pool once the recorder has read it, so a long run allocates only as
    many events as are ever in flight at once.
    """

    has_device_timing = True
    has_device_memory = True

    def __init__(self, device_index: int, *, nvtx: bool = True, syncs: str = "warn") -> None:
        self.index = device_index
        self.device = f"cuda:{device_index}"
        self.gpu_reason = None
        self.memory_reason = None
        self._pool: list[Any] = []
        self._torch_device = torch.device("cuda", device_index)
        self._event_cls = getattr(torch, "Event", None)
        self._capturing = torch.cuda.is_current_stream_capturing
        self._memory_stats = torch._C._cuda_memoryStats
        self._reset_peak = torch._C._cuda_resetPeakMemoryStats
        # Without a tool attached every NVTX call is a no-op (NVTX's own rule): none is made.
        nvtx = self._nvtx = nvtx and nvtx_attached()
        self.sync_mechanism: str | None = None if syncs == "off" else syncs
        self.sync_reason: str | None = "sync tracking was turned off (syncs='off')" if syncs == "off" else None
        self._sync_resolved = syncs != "trace"
        self._sessions = _syncs.Sessions(final=True)  # one profiler's backend
        register_repeat_interleave_probe(device_index)
        if nvtx:
            # The C bindings behind torch.cuda.nvtx.range_push/range_pop, minus a Python frame.
            nv = getattr(torch._C, "_nvtx", None)
            self._push = getattr(nv, "rangePushA", None) or torch.cuda.nvtx.range_push
            self._pop = getattr(nv, "rangePop", None) or torch.cuda.nvtx.range_pop

    def _new_event(self) -> Any:
        if self._event_cls is not None:
            return self._event_cls(device=self._torch_device, enable_timing=True)
        return torch.cuda.Event(enable_timing=True)  # pragma: no cover - torch < 2.4

    def mark(self) -> Any | None:
        """Record an event on the current stream now; None while it captures a CUDA graph.

        A timing event recorded into a capture would become part of the user's graph (or
        invalidate the capture), so a boundary inside ``torch.cuda.graph(...)`` gets no
        event and its ``gpu_ms`` is null.  The check is cheap (see bench/primitives.py).
        """
        if self._capturing():
            return None
        ev = self._pool.pop() if self._pool else self._new_event()
        try:
            ev.record()
        except RuntimeError:
            self._pool.append(ev)
            return None
        return ev

    def is_done(self, mark: Any) -> bool:
        return mark is None or mark.query()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        ms: float = start.elapsed_time(end)
        return ms

    def release(self, mark: Any) -> None:
        if mark is not None:
            self._pool.append(mark)

    def reset_peak(self) -> None:
        self._reset_peak(self.index)

    def read_memory(self) -> Memory:
        """(peak allocated since the last reset, reserved now, then the allocator's counters).

        One raw-stats call; the counters (:data:`ALLOCATOR_COUNTERS`, cumulative) are
        left out on a torch that lacks them.
        """
        stats = self._memory_stats(self.index)
        head = (stats["allocated_bytes"]["all"]["peak"], stats["reserved_bytes"]["all"]["current"])
        try:
            return head + tuple(stats[k] for k in ALLOCATOR_COUNTERS)
        except KeyError:
            return head

    def watch_syncs(self, tracker: _syncs.SyncTracker) -> str | None:
        """Route this thread's host-device waits to ``tracker`` until :meth:`unwatch_syncs`.

        The first call opens this backend's sync session (the route is installed then, if
        no other session holds it); later ones check the route and push the tracker.
        Returns why they are not counted this step, or None when they are.
        """
        if self.sync_mechanism is None:
            return self.sync_reason
        if not self._sync_resolved:  # "trace": check once that the callbacks fire
            self._sync_resolved = True
            why = enable_gpu_trace(self.index)
            if why is not None:
                self.sync_mechanism = "warn"
                warn(
                    f"stepprof: syncs='trace' is not usable here ({why}); counting syncs "
                    f"with 'warn' (torch's sync-debug warnings) instead", stacklevel=5)
        tracker.mechanism = self.sync_mechanism
        return self._sessions.watch(tracker, trace_route if self.sync_mechanism == "trace" else warn_route)

    def unwatch_syncs(self, tracker: _syncs.SyncTracker) -> None:
        _syncs.detach(tracker)

    def sync_plan(self) -> tuple[str | None, tuple[_syncs.Check, ...]] | None:
        """For the C step core: :meth:`watch_syncs`' common case as data
        (:meth:`stepprof._syncs.Sessions.plan`), which it may do itself while the plan's
        checks hold; and :meth:`unwatch_syncs` is :func:`stepprof._syncs.detach`.  None where a
        subclass does its own watch (the core then calls it every step)."""
        own = type(self).watch_syncs is not CudaBackend.watch_syncs or (
            type(self).unwatch_syncs is not CudaBackend.unwatch_syncs)
        if own or self.sync_mechanism is None:
            return None
        return self._sessions.plan(self.sync_mechanism)

    def end_syncs(self) -> None:
        """Close the sync session: the route is restored unless another session holds it."""
        self._sessions.end()

    def syncs_outside_steps(self) -> tuple[int | None, str | None]:
        """(waits on threads with no open step during the session, None), or (None, why)."""
        return self._sessions.outside(self.sync_reason if self.sync_mechanism is None else None)

    def synchronize(self) -> None:
        with _syncs.OWN_WAITS:  # stepprof's own wait: nobody's sync
            torch.cuda.synchronize(self.index)

    def wait(self, marks: list[Any]) -> None:
        """Block until these events have completed (``cudaEventSynchronize`` on each).

        Unlike :meth:`synchronize`, it waits for nothing else on the device: not for a
        collective on NCCL's stream that another rank never joins.
        """
        with _syncs.OWN_WAITS:  # stepprof's own waits: nobody's syncs
            for m in marks:
                if m is not None:
                    m.synchronize()

    def range_push(self, name: str) -> None:
        if self._nvtx:
            try:
                self._push(name)
            except (TypeError, UnicodeError):  # a name NVTX cannot take: a lone surrogate
                self._push(name.encode("utf-8", "replace").decode("utf-8"))

    def range_pop(self) -> None:
        if self._nvtx:
            self._pop()

    def read_allocator(self) -> AllocatorFigures:
        """The allocator's current, peak and cumulative figures, from one raw-stats read."""
        stats = self._memory_stats(self.index)
        return AllocatorFigures(
            allocated_bytes=stats["allocated_bytes"]["all"]["current"],
            peak_allocated_bytes=stats["allocated_bytes"]["all"]["peak"],
            reserved_bytes=stats["reserved_bytes"]["all"]["current"],
            inactive_split_bytes=stats["inactive_split_bytes"]["all"]["current"],
            num_ooms=stats.get("num_ooms", 0),
            num_alloc_retries=stats.get("num_alloc_retries", 0),
        )

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device as the CUDA driver sees it (``cudaMemGetInfo``).

        Device-wide: it counts every process on the GPU (or on the MIG instance).
        """
        free, total = torch.cuda.mem_get_info(self.index)
        return int(free), int(total)

    def identity(self) -> tuple[str | None, str | None]:
        """The device's UUID (``"xxxxxxxx-xxxx-..."``, no prefix) and PCI bus id.

        Both come from ``cudaGetDeviceProperties``, so they name the physical GPU
        (or MIG instance) behind torch's index, whatever ``CUDA_VISIBLE_DEVICES``
        says.  The bus id is formatted as NVML writes it: ``"00000000:65:00.0"``.
        Either is None when this torch build does not expose it.
        """
        props = torch.cuda.get_device_properties(self.index)
        raw_uuid = getattr(props, "uuid", None)
        uuid = str(raw_uuid) if raw_uuid is not None else None
        bus = getattr(props, "pci_bus_id", None)
        dev = getattr(props, "pci_device_id", None)
        domain = getattr(props, "pci_domain_id", None)
        pci = f"{domain:08X}:{bus:02X}:{dev:02X}.0" if None not in (bus, dev, domain) else None
        return uuid, pci


    # -- explain_peak: the allocator's history over one step ----------------------------

    def begin_history(self, max_entries: int) -> HistoryStart | str:
        """Record the allocator's history (every alloc and free, with Python stacks) from now
        on, bounded to ``max_entries``, and take the start snapshot; or say why not.

        Private torch APIs, feature-detected: ``torch._C._cuda_isHistoryEnabled``,
        ``torch.cuda.memory._record_memory_history(enabled="all", context="alloc",
        stacks="python", max_entries=N)`` and ``torch.cuda.memory._snapshot()``.  A history
        that something else records already is left alone (the reason says so).

        Where the signature has ``global_record_annotations`` (torch 2.8 and later), it is
        passed True: torch then registers a global RecordFunction callback, for
        ``USER_SCOPE`` ranges only, that writes each range's START and END into the
        snapshot's ``external_annotations`` in the history's own clock; stepprof's markers
        are such ranges.  ``enabled=None`` removes that callback again (torch's
        ``setRecordFunctionCallbacks`` in torch/csrc/cuda/memory_snapshot.cpp, since
        pytorch#153839, which the parameter's pull request pytorch#154932 builds on).
        """
        mem = getattr(torch.cuda, "memory", None)
        record = getattr(mem, "_record_memory_history", None)
        snapshot = getattr(mem, "_snapshot", None)
        is_enabled = getattr(torch._C, "_cuda_isHistoryEnabled", None)
        if record is None or snapshot is None:
            return (f"this torch ({torch.__version__}) lacks torch.cuda.memory._record_memory_history "
                    f"or _snapshot, which explaining the peak needs")
        if is_enabled is None:
            return (f"this torch ({torch.__version__}) cannot say whether the allocator's history is "
                    f"already being recorded (no torch._C._cuda_isHistoryEnabled), so stepprof "
                    f"leaves it alone")
        if is_enabled():
            return ("the allocator's history is already being recorded (torch.cuda.memory."
                    "_record_memory_history was called outside stepprof); stepprof leaves it alone")
        annotations = _takes(record, "global_record_annotations")
        extra = {"global_record_annotations": True} if annotations else {}
        try:
            record(enabled="all", context="alloc", stacks="python", max_entries=max_entries, **extra)
        except TypeError as e:  # an older signature
            return f"torch.cuda.memory._record_memory_history refused stepprof's arguments: {e}"
        before = time.time_ns() / 1000
        try:
            start = snapshot()
        except Exception as err:  # noqa: BLE001 - the end snapshot may still serve; end_history stops recording
            if raised_by_user(err):
                raise
            return HistoryStart(None, before, before, annotations)
        return HistoryStart(start, before, time.time_ns() / 1000, annotations)

    def end_history(self) -> dict[str, Any]:
        """The snapshot with the history since :meth:`begin_history`; recording stops."""
        mem = torch.cuda.memory
        try:
            return mem._snapshot()  # type: ignore[no-any-return]
        finally:
            mem._record_memory_history(enabled=None)


def _takes(fn: Any, name: str) -> bool:
    """Whether ``fn``'s signature has a parameter ``name`` (torch sets ``__signature__``)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


# -- what the batch-size sweep needs besides the recorder's calls ----------------
#
# The sweep (``stepprof._sweep``) times whole trials with the same marks, and also
# reads the allocator's event counters, the bytes allocated now, what the device
# can still give, and frees the cache after an out-of-memory error.


class CudaSweepBackend(CudaBackend):
    """:class:`CudaBackend` plus the allocator reads and the cache release of the sweep."""

    def __init__(self, device_index: int) -> None:
        super().__init__(device_index, nvtx=False)
        self._empty_cache = torch._C._cuda_emptyCache

    def allocator_counters(self) -> tuple[int, int] | None:
        """(``num_alloc_retries``, ``num_device_alloc``) so far, from one raw-stats read.

        ``num_alloc_retries`` counts cudaMalloc calls that failed and were retried
        after freeing the cache; ``num_device_alloc`` counts cudaMalloc (and cuMemMap)
        calls.  Neither synchronises.  ``num_device_alloc`` is missing before torch 2.1:
        it reads as 0 there.
        """
        stats = self._memory_stats(self.index)
        return int(stats.get("num_alloc_retries", 0)), int(stats.get("num_device_alloc", 0))

    def allocated_bytes(self) -> int:
        """Bytes of live tensors now (``torch.cuda.memory_allocated()``, without flattening)."""
        return int(self._memory_stats(self.index)["allocated_bytes"]["all"]["current"])

    def empty_cache(self) -> None:
        """Return the allocator's unused cached blocks to the driver (synchronises)."""
        self._empty_cache()

    def capacity_bytes(self) -> int:
        """What torch's allocator could hold on this device now: free + its own reserved.

        ``mem_get_info`` gives the device's free bytes (other processes and the CUDA
        context already taken out); bytes this process has reserved are usable too.
        A per-process memory fraction, when set, caps the figure.
        """
        free, total = torch.cuda.mem_get_info(self.index)
        reserved = int(self._memory_stats(self.index)["reserved_bytes"]["all"]["current"])
        capacity = int(free) + reserved
        get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if get_fraction is not None:
            try:
                fraction = float(get_fraction(self.index))
            except (RuntimeError, TypeError, ValueError):  # pragma: no cover - old torch
                fraction = 1.0
            if 0 < fraction < 1:
                capacity = min(capacity, int(fraction * total))
        return capacity
