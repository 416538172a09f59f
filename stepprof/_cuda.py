"""The one module that talks to CUDA and torch's caching allocator.

Everything the recorder needs from the device goes through a *backend*: marks
(CUDA events) to time the device, the allocator's peak counter, NVTX ranges and
one final synchronisation.  :class:`CudaBackend` is the real one,
:class:`HostBackend` stands in where there is no CUDA, and tests drive the
recorder with a fake that has the same methods.

Per-call host costs measured on an H200 (torch 2.11, ``bench/primitives.py``)
chose the calls used here:

==========================================  =========
``torch.Event.record()`` (C++ current stream)  2.4 µs
``torch.cuda.Event.record()``                  10.4 µs (Python ``current_stream()``)
``Event.query()`` on a finished event          1.7 µs
``Event.elapsed_time`` on finished events      3.7 µs
``torch._C._cuda_memoryStats(dev)``            10.7 µs
``torch.cuda.max_memory_allocated()``          141 µs (flattens the whole dict)
``torch._C._cuda_resetPeakMemoryStats(dev)``   0.2 µs
``torch.cuda.reset_peak_memory_stats()``       4.1 µs
NVTX push + pop                                0.4 µs
==========================================  =========

None of these synchronises: ``query()`` polls, and ``elapsed_time`` is only
called once both events have completed.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = [
    "Backend",
    "CudaBackend",
    "CudaSweepBackend",
    "HostBackend",
    "HostSweepBackend",
    "select_backend",
    "select_sweep_backend",
]


class Backend(Protocol):
    """What the recorder needs from a device.  Marks are opaque to the recorder."""

    device: str
    #: Why device timing is unavailable, or None when marks are real.
    gpu_reason: str | None
    #: Why allocator memory figures are unavailable, or None when they are real.
    memory_reason: str | None

    def mark(self) -> Any | None: ...
    def is_done(self, mark: Any) -> bool: ...
    def elapsed_ms(self, start: Any, end: Any) -> float: ...
    def release(self, mark: Any) -> None: ...
    def reset_peak(self) -> None: ...
    def read_memory(self) -> tuple[int, int] | None: ...
    def synchronize(self) -> None: ...
    def range_push(self, name: str) -> None: ...
    def range_pop(self) -> None: ...


class HostBackend:
    """No device: marks are None, memory figures are unavailable with ``reason``."""

    def __init__(self, reason: str) -> None:
        self.device = "cpu"
        self.gpu_reason = reason
        self.memory_reason = (
            f"{reason}; torch's CPU allocator keeps no peak counter (see host_rss_bytes)"
        )

    def mark(self) -> None:
        return None

    def is_done(self, mark: Any) -> bool:
        return True

    def elapsed_ms(self, start: Any, end: Any) -> float:  # pragma: no cover - never called
        raise AssertionError("HostBackend has no marks")

    def release(self, mark: Any) -> None:
        pass

    def reset_peak(self) -> None:
        pass

    def read_memory(self) -> None:
        return None

    def synchronize(self) -> None:
        pass

    def range_push(self, name: str) -> None:
        pass

    def range_pop(self) -> None:
        pass


class CudaBackend:
    """CUDA events from a reusable pool, the raw allocator stats, NVTX.

    Events are ``torch.Event(device="cuda:N", enable_timing=True)``: its
    ``record()`` finds the current stream in C++, four times cheaper than
    ``torch.cuda.Event.record()``.  An event goes back to the pool once the
    recorder has read it, so a long run allocates only as many events as are
    ever in flight at once.
    """

    def __init__(self, device_index: int, *, nvtx: bool = True) -> None:
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
        self._nvtx = nvtx
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
        event and its ``gpu_ms`` is null.  The check costs about 0.5 µs.
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
        return start.elapsed_time(end)

    def release(self, mark: Any) -> None:
        if mark is not None:
            self._pool.append(mark)

    def reset_peak(self) -> None:
        self._reset_peak(self.index)

    def read_memory(self) -> tuple[int, int]:
        """(peak allocated since the last reset, reserved now), from one raw-stats call."""
        stats = self._memory_stats(self.index)
        return stats["allocated_bytes"]["all"]["peak"], stats["reserved_bytes"]["all"]["current"]

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.index)

    def range_push(self, name: str) -> None:
        if self._nvtx:
            self._push(name)

    def range_pop(self) -> None:
        if self._nvtx:
            self._pop()


def select_backend(device: Any = None, *, nvtx: bool = True) -> Backend:
    """Choose the backend for a step that is starting now.

    With ``device=None`` the CUDA backend is used only when CUDA is available
    *and already initialised* by the user's code: stepprof never creates a CUDA
    context (hundreds of MiB) for a job that trains on the CPU.
    """
    if device is not None:
        dev = torch.device(device)
        if dev.type == "cpu":
            return HostBackend("device='cpu' was requested")
        if dev.type != "cuda":
            return HostBackend(f"device type {dev.type!r} has no CUDA events")
        if not torch.cuda.is_available():
            return HostBackend("CUDA is not available")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        return CudaBackend(index, nvtx=nvtx)
    if not torch.cuda.is_available():
        return HostBackend("CUDA is not available")
    if not torch.cuda.is_initialized():
        return HostBackend("CUDA was not initialised when the step began (the step ran on the CPU)")
    return CudaBackend(torch.cuda.current_device(), nvtx=nvtx)


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


def select_sweep_backend(device: Any = None) -> CudaSweepBackend | HostSweepBackend:
    """The sweep's backend: CUDA when asked for, or (``device=None``) when the process
    has already initialised CUDA (the model is on the GPU); otherwise the host."""
    chosen = select_backend(device, nvtx=False)
    if isinstance(chosen, CudaBackend):
        return CudaSweepBackend(chosen.index)
    return HostSweepBackend(chosen.gpu_reason or "CUDA is not available")
