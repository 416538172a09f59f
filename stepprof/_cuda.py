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

The memory reconciliation (:mod:`stepprof._memory`) reads three more things
here, never per step: the allocator's detailed figures (the same raw-stats
call), ``torch.cuda.mem_get_info`` (5.7 µs) and the device's identity (UUID and
PCI bus id, from ``get_device_properties``), which :mod:`stepprof._nvml` uses
to find the same GPU in NVML.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch

from . import _syncs
from ._errors import SyncBudgetExceeded
from ._stats import median

__all__ = [
    "ALLOCATOR_COUNTERS",
    "SYNC_MECHANISMS",
    "AllocatorFigures",
    "Backend",
    "CudaBackend",
    "CudaSweepBackend",
    "ExchangeSlots",
    "HostBackend",
    "HostSweepBackend",
    "memory_backend",
    "select_backend",
    "select_sweep_backend",
]

#: How sync points are detected: torch's sync-debug warnings (plus wrappers for the
#: device and event waits they miss), torch's GPU-trace callbacks, or not at all.
SYNC_MECHANISMS = ("warn", "trace", "off")

#: The allocator's own hidden-sync counters, reported as per-step deltas.
ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free")

_Counters = tuple[int, ...]


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


class Backend(Protocol):
    """What the recorder needs from a device.  Marks are opaque to the recorder."""

    device: str
    #: The CUDA device index, or None on the host.
    index: int | None
    #: Marks are device events: GPU time and gaps come from them (else from the host clock).
    has_device_timing: bool
    #: The caching allocator's figures (peak, reserved, counters) are real; without them
    #: the recorder reads the host's RSS instead.
    has_device_memory: bool
    #: How syncs are counted on this backend ("warn", "trace"), or None when they are not.
    sync_mechanism: str | None
    #: Why device timing is unavailable, or None when marks are real.
    gpu_reason: str | None
    #: Why allocator memory figures are unavailable, or None when they are real.
    memory_reason: str | None

    def mark(self) -> Any | None: ...
    def is_done(self, mark: Any) -> bool: ...
    def elapsed_ms(self, start: Any, end: Any) -> float: ...
    def release(self, mark: Any) -> None: ...
    def reset_peak(self) -> None: ...
    def read_memory(self) -> tuple[int, int, _Counters | None] | None: ...
    def synchronize(self) -> None: ...
    def wait(self, marks: list[Any]) -> None: ...
    def range_push(self, name: str) -> None: ...
    def range_pop(self) -> None: ...
    def watch_syncs(self, tracker: _syncs.SyncTracker) -> str | None: ...
    def unwatch_syncs(self) -> None: ...
    # For the memory reconciliation, never per step:
    def read_allocator(self) -> AllocatorFigures | None: ...
    def mem_get_info(self) -> tuple[int, int] | None: ...
    def identity(self) -> tuple[str | None, str | None]: ...


class HostBackend:
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
        self.sync_mechanism: str | None = None
        self.sync_reason = f"{reason}: there is no device for the host to wait on"

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

    def wait(self, marks: list[Any]) -> None:
        pass

    def range_push(self, name: str) -> None:
        pass

    def range_pop(self) -> None:
        pass

    def watch_syncs(self, tracker: _syncs.SyncTracker) -> str:
        return self.sync_reason

    def unwatch_syncs(self) -> None:
        pass
    def read_allocator(self) -> None:
        return None

    def mem_get_info(self) -> None:
        return None

    def identity(self) -> tuple[None, None]:
        return None, None


class CudaBackend:
    """CUDA events from a reusable pool, the raw allocator stats, NVTX.

    Events are ``torch.Event(device="cuda:N", enable_timing=True)``: its
    ``record()`` finds the current stream in C++, four times cheaper than
    ``torch.cuda.Event.record()``.  An event goes back to the pool once the
    recorder has read it, so a long run allocates only as many events as are
    ever in flight at once.
    """

    has_device_timing = True
    has_device_memory = True

    def __init__(self, device_index: int, *, nvtx: bool = True, syncs: str = "warn") -> None:
        self.index: int | None = device_index
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
        self.sync_mechanism: str | None = None if syncs == "off" else syncs
        self.sync_reason: str | None = "sync tracking was turned off (syncs='off')" if syncs == "off" else None
        self._sync_resolved = syncs != "trace"
        _syncs.PROBES.setdefault("repeat_interleave", functools.partial(_repeat_interleave_waits, device_index))
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

    def read_memory(self) -> tuple[int, int, _Counters | None]:
        """(peak allocated since the last reset, reserved now, the allocator's counters).

        One raw-stats call; the counters (:data:`ALLOCATOR_COUNTERS`, cumulative)
        are None on a torch that lacks them.
        """
        stats = self._memory_stats(self.index)
        try:
            counters: _Counters | None = tuple(stats[k] for k in ALLOCATOR_COUNTERS)
        except KeyError:
            counters = None
        return (
            stats["allocated_bytes"]["all"]["peak"],
            stats["reserved_bytes"]["all"]["current"],
            counters,
        )

    def watch_syncs(self, tracker: _syncs.SyncTracker) -> str | None:
        """Route this thread's host-device waits to ``tracker`` until :meth:`unwatch_syncs`.

        Returns why they are not counted this step, or None when they are.
        """
        if self.sync_mechanism is None:
            return self.sync_reason
        if not self._sync_resolved:  # "trace": check once that the callbacks fire
            self._sync_resolved = True
            why = _enable_gpu_trace(self.index)
            if why is not None:
                self.sync_mechanism = "warn"
                warnings.warn(
                    f"stepprof: syncs='trace' is not usable here ({why}); counting syncs "
                    f"with 'warn' (torch's sync-debug warnings) instead",
                    RuntimeWarning,
                    stacklevel=5,
                )
        tracker.mechanism = self.sync_mechanism
        if self.sync_mechanism == "trace":
            _syncs.attach(tracker, _install_trace_route)
            return None
        if not _syncs.installed() and torch._C._cuda_get_sync_debug_mode() == 2:
            return (
                "torch's sync-debug mode is 'error' (set outside stepprof), "
                "so a sync raises instead of being counted"
            )
        _syncs.attach(tracker, _install_warn_route)
        return None

    def unwatch_syncs(self) -> None:
        _syncs.detach()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.index)

    def wait(self, marks: list[Any]) -> None:
        """Block until these events have completed (``cudaEventSynchronize`` on each).

        Unlike :meth:`synchronize`, it waits for nothing else on the device: not for a
        collective on NCCL's stream that another rank never joins.
        """
        for m in marks:
            if m is not None:
                m.synchronize()

    def range_push(self, name: str) -> None:
        if self._nvtx:
            self._push(name)

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


# -- sync mechanisms ---------------------------------------------------------------
#
# "warn": torch's sync-debug mode "warn" makes every stream-level wait (``.item()``,
# copies to the host, ``nonzero``, ``Stream.synchronize``...) issue a UserWarning on
# the calling thread, which ``_syncs.WarningTap`` counts; it costs nothing until a
# sync happens.  It misses device and event waits, so ``torch.cuda.synchronize``,
# ``torch.accelerator.synchronize`` and ``torch.cuda.Event.synchronize`` are wrapped
# while a step is open.  ``torch.Event`` is an immutable C type and cannot be wrapped.
#
# "trace": torch's private GPU-trace callbacks see every wait, but torch calls into
# Python on every allocation and free once they are active (for good: activation
# cannot be undone), which costs a few percent on an allocation-heavy step.

_prototype_quiet = False
_UTILS_FILE = os.path.join(os.path.dirname(torch.__file__), "_utils.py")


# Set on a thread while one of the wrappers below runs its original: a wrapper reached
# from inside another one (a user's replacement, made during a step, that calls the
# wrapper it replaced, and is wrapped in turn at the next step) is the same wait.
_waiting = threading.local()


def _waiter(original: Callable[..., Any], hint: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def wait(*args: Any, **kwargs: Any) -> Any:
        if _syncs.installed() and not getattr(_waiting, "on", False):
            _syncs.dispatch(hint, sys._getframe(1))
            _waiting.on = True
            try:
                return original(*args, **kwargs)
            finally:
                _waiting.on = False
        return original(*args, **kwargs)

    return wait


def _set_sync_debug_mode(mode: int) -> None:
    global _prototype_quiet
    if not _prototype_quiet:  # torch warns once per process that the mode is a prototype
        _prototype_quiet = True
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch._C._cuda_set_sync_debug_mode(mode)
        return
    torch._C._cuda_set_sync_debug_mode(mode)


class _WarnRoute:
    """The "warn" mechanism's installation, built once: installed per step, undone at exit.

    It runs at every step entry and exit, so the wrappers are made once and the
    undo is one call (about 5 µs a step for both on this project's CPU machine).
    """

    def __init__(self) -> None:
        targets = [(torch.cuda, "synchronize", "device_synchronize"),
                   (torch.cuda.Event, "synchronize", "event_synchronize")]
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None and hasattr(accelerator, "synchronize"):
            targets.append((accelerator, "synchronize", "device_synchronize"))
        # [obj, name, hint, wrapper, the original it wraps]
        self.patches = [
            [obj, name, hint, _waiter(getattr(obj, name), hint), getattr(obj, name)]
            for obj, name, hint in targets
        ]
        self.mode_was = 0
        self.tap: _syncs.WarningTap | None = None

    def install(self) -> list[Callable[[], None]]:
        mode = self.mode_was = torch._C._cuda_get_sync_debug_mode()
        if mode == 0:
            _set_sync_debug_mode(1)
        try:
            # The user had "warn" on: count, and pass their warnings on as before.
            self.tap = _syncs.tap(forward=mode == 1)
            self.tap.install()
            for p in self.patches:
                current = getattr(p[0], p[1])
                if current is not p[4]:  # replaced since (by the user): wrap theirs
                    p[3], p[4] = _waiter(current, p[2]), current
                setattr(p[0], p[1], p[3])
        except BaseException:
            self.uninstall()
            raise
        return [self.uninstall]

    def uninstall(self) -> None:
        try:
            for obj, name, _, wrapper, original in self.patches:
                if getattr(obj, name) is wrapper:  # else the user patched it meanwhile: leave theirs
                    setattr(obj, name, original)
            if self.tap is not None:
                self.tap.uninstall()
                self.tap = None
        finally:
            # Still ours ("warn")?  Else the user set a mode of their own meanwhile: leave it.
            if self.mode_was == 0 and torch._C._cuda_get_sync_debug_mode() == 1:
                torch._C._cuda_set_sync_debug_mode(0)


_warn_route: _WarnRoute | None = None


def _install_warn_route() -> list[Callable[[], None]]:
    global _warn_route
    if _warn_route is None:
        _warn_route = _WarnRoute()
    return _warn_route.install()


_trace = {"registered": False, "on": False}
_probe: list[str | None] | None = None


def _trace_fire(hint: str | None) -> None:
    if _probe is not None:
        _probe.append(hint)
        return
    if not _trace["on"]:
        return  # callbacks cannot be unregistered: this flag gates them
    origin = sys._getframe(1)
    while origin is not None and (
        origin.f_code.co_filename == __file__ or origin.f_code.co_filename == _UTILS_FILE
    ):
        origin = origin.f_back
    if origin is not None:
        try:
            _syncs.dispatch(hint, origin)
        except SyncBudgetExceeded as e:  # torch would log it and go on: the step raises it
            _syncs.defer(e)
    else:  # a thread of torch's own (C++ autograd's): no Python caller, so no step open on it
        _syncs.count_elsewhere()


def _on_device_sync(*_: Any) -> None:
    _trace_fire("device_synchronize")


def _on_stream_sync(*_: Any) -> None:
    _trace_fire(None)


def _on_event_sync(*_: Any) -> None:
    _trace_fire("event_synchronize")


def _enable_gpu_trace(index: int) -> str | None:
    """Register the GPU-trace callbacks (once) and check that one fires; None if it does.

    The check waits on an event recorded on a fresh, idle side stream, so it does not
    wait for any of the user's work.
    """
    global _probe
    try:
        import torch.cuda._gpu_trace as gt

        activate = torch._C._activate_gpu_trace
        if not _trace["registered"]:
            gt.register_callback_for_device_synchronization(_on_device_sync)
            gt.register_callback_for_stream_synchronization(_on_stream_sync)
            gt.register_callback_for_event_synchronization(_on_event_sync)
            activate()
            _trace["registered"] = True
        probe: list[str | None] = []
        _probe = probe
        try:
            side = torch.cuda.Stream(index)
            ev = torch.cuda.Event()
            ev.record(side)
            ev.synchronize()
        finally:
            _probe = None
    except Exception as e:  # noqa: BLE001 - a private API: any failure means "not available"
        return f"torch's GPU-trace callbacks are unavailable ({type(e).__name__}: {e})"
    if "event_synchronize" not in probe:
        return "torch's GPU-trace callbacks did not fire in the start-up self-test"
    return None


def _repeat_interleave_waits(index: int) -> int:
    """How many waits one call of ``repeat_interleave`` without ``output_size`` makes.

    Registered as the ``repeat_interleave`` probe of :mod:`stepprof._syncs`, which runs
    it once per process, at the first wait it sees of that kind: from inside the
    user's own call, so its kernels are loaded already.  It runs on a fresh, idle side
    stream, so its waits drain nothing of the user's, and its waits are counted, through
    the mechanism in use, by a :class:`stepprof._syncs.WaitCounter` pushed on this
    thread.  torch 2.4-2.13 read two figures back (the output size, and a check that
    no repeat is negative): 2.  That is torch's implementation, so it is measured.
    """
    counter = _syncs.WaitCounter()
    _syncs.attach(counter, list)  # type: ignore[arg-type] - a step is open: nothing to install
    try:
        side = torch.cuda.Stream(index)
        with torch.cuda.stream(side):
            torch.repeat_interleave(torch.ones(2, dtype=torch.long, device=torch.device("cuda", index)))
    finally:
        _syncs.detach()
    return counter.waits


def _install_trace_route() -> list[Callable[[], None]]:
    _trace["on"] = True

    def undo() -> None:
        _trace["on"] = False

    return [undo]


def select_backend(device: Any = None, *, nvtx: bool = True, syncs: str = "warn") -> Backend:
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
        return CudaBackend(index, nvtx=nvtx, syncs=syncs)
    if not torch.cuda.is_available():
        return HostBackend("CUDA is not available")
    if not torch.cuda.is_initialized():
        return HostBackend("CUDA was not initialised when the step began (the step ran on the CPU)")
    return CudaBackend(torch.cuda.current_device(), nvtx=nvtx, syncs=syncs)


def memory_backend(device: torch.device | None = None) -> Backend:
    """A backend to read memory figures on now, for :func:`stepprof.memory_report`.

    It never initialises CUDA: where the process has no CUDA context yet, the
    answer is a :class:`HostBackend` whose ``gpu_reason`` says so, because
    creating one would itself add hundreds of MiB to what nvidia-smi shows.
    """
    if device is not None and device.type != "cuda":
        return HostBackend(f"device {str(device)!r} has no CUDA memory")
    if not torch.cuda.is_available():
        return HostBackend("CUDA is not available")
    if not torch.cuda.is_initialized():
        return HostBackend(
            "CUDA is not initialised in this process, so it holds no GPU memory "
            "(stepprof never initialises CUDA itself)"
        )
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    if not 0 <= index < torch.cuda.device_count():
        return HostBackend(f"there is no CUDA device {index} ({torch.cuda.device_count()} visible)")
    return CudaBackend(index, nvtx=False)



# -- the cross-rank exchange's buffers (stepprof._dist), on NCCL ---------------------


class _Slot:
    """One exchange's buffers: pinned host in/out, device in/out, the copy-back event."""

    __slots__ = ("host_in", "dev_in", "dev_out", "host_out", "event")

    def __init__(self, device: torch.device, width: int, world: int) -> None:
        self.host_in = torch.empty(width, dtype=torch.float64, pin_memory=True)
        self.dev_in = torch.empty(width, dtype=torch.float64, device=device)
        self.dev_out = torch.empty(world * width, dtype=torch.float64, device=device)
        self.host_out = torch.empty(world * width, dtype=torch.float64, pin_memory=True)
        self.event: Any = None

    def fetch(self) -> list[float] | None:
        """On the collector, once the collective has completed: copy back; the values once done.

        The copy runs on a side stream (the collective's output is complete, so it waits
        on nothing), into pinned memory with ``non_blocking``: nothing here synchronises.
        """
        if self.event is None:
            with torch.cuda.device(self.dev_out.device), torch.cuda.stream(_side_stream(self.dev_out.device)):
                self.host_out.copy_(self.dev_out, non_blocking=True)
                self.event = torch.cuda.Event()
                self.event.record()
        if not self.event.query():
            return None
        self.event = None
        return self.host_out.tolist()


_side_streams: dict[Any, Any] = {}


def _side_stream(device: torch.device) -> Any:
    s = _side_streams.get(device)
    if s is None:
        s = _side_streams[device] = torch.cuda.Stream(device)
    return s


class ExchangeSlots:
    """A ring of exchange buffers on CUDA device ``index``, each reused only once its
    exchange has completed (so a pending copy or collective never sees it rewritten).

    :meth:`stage` runs on the training thread at a step's exit: it writes the vector
    into pinned host memory and enqueues a ``non_blocking`` copy to the device on the
    current stream.  The collective that follows (enqueued by ``stepprof._dist``, never
    waited on) orders itself after that stream's work.  Buffers are allocated once,
    at the first exchange (a pinned allocation and two small device ones).
    """

    def __init__(self, index: int, width: int, world: int) -> None:
        self._device = torch.device("cuda", index)
        self._width, self._world = width, world
        self._free: list[_Slot] = []
        self._lock = threading.Lock()

    def stage(self, values: list[float]) -> _Slot | None:
        if torch.cuda.is_current_stream_capturing():
            return None  # a collective would become part of the user's CUDA graph
        with self._lock:
            slot = self._free.pop() if self._free else None
        if slot is None:
            slot = _Slot(self._device, self._width, self._world)
        slot.host_in.copy_(torch.tensor(values, dtype=torch.float64))
        slot.dev_in.copy_(slot.host_in, non_blocking=True)
        return slot

    def free(self, slot: _Slot) -> None:
        with self._lock:
            self._free.append(slot)


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


# -- calibration: this GPU's achieved rates, for MFU and the roofline ----------------
#
# Timed by the project's measurement rules (docs/measurement.md): random (non-zero) operands, warm-up first, CUDA
# events around a run of back-to-back calls long enough (about 40 ms) that launch
# cost and event resolution do not matter, several runs, the median of the runs.


def _timed_ms(fn: Callable[[], Any], *, target_ms: float, runs: int) -> float:
    """Median device ms of one ``fn()`` call, over ``runs`` runs of back-to-back calls."""
    fn()  # warm-up: cuBLAS heuristics, workspace allocation
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    once = max(start.elapsed_time(end), 1e-3)
    reps = max(1, min(200, int(target_ms / once)))
    per_call = []
    for _ in range(runs):
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / reps)
    return median(per_call)


def calibrate(
    index: int = 0, *, runs: int = 5, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Measure this GPU's achieved dense matmul TFLOP/s (bf16, tf32, fp32), copy GB/s and
    the host µs of one small operation.  Takes a few seconds; restores torch's settings.

    Matmul: ``torch.mm`` of random n×n operands into a preallocated output, n in
    (8192, 16384) (fp32: 8192); the rate is ``2n³ / time``, the best size's median.
    Copy: ``dst.copy_(src)`` of 1 GiB, counting the bytes read and written.
    Host cost: the host time of 2000 in-place adds on a 256-element tensor (the
    queue is kept short, so the host, not the GPU, sets the pace).
    """
    import time as _time

    say = progress or (lambda _msg: None)
    dev = torch.device("cuda", index)
    precision = torch.get_float32_matmul_precision()
    gen = torch.Generator(device=dev).manual_seed(0)
    result: dict[str, Any] = {}
    tflops: dict[str, float] = {}
    shapes: dict[str, int] = {}
    try:
        with torch.cuda.device(index):
            for key, dtype, sizes, mode in (
                ("bf16", torch.bfloat16, (8192, 16384), None),
                ("tf32", torch.float32, (8192, 16384), "high"),
                ("fp32", torch.float32, (8192,), "highest"),
            ):
                say(f"matmul {key}")
                if mode is not None:
                    torch.set_float32_matmul_precision(mode)
                best = 0.0
                for n in sizes:
                    a = torch.randn(n, n, device=dev, dtype=dtype, generator=gen)
                    b = torch.randn(n, n, device=dev, dtype=dtype, generator=gen)
                    c = torch.empty(n, n, device=dev, dtype=dtype)
                    ms = _timed_ms(lambda a=a, b=b, c=c: torch.mm(a, b, out=c), target_ms=40, runs=runs)
                    rate = 2 * n**3 / (ms * 1e-3) / 1e12
                    if rate > best:
                        best, shapes[key] = rate, n
                    del a, b, c
                tflops[key] = best
                torch.set_float32_matmul_precision(precision)
            say("copy bandwidth")
            nbytes = 2**30
            src = torch.randn(nbytes // 4, device=dev, generator=gen)
            dst = torch.empty_like(src)
            ms = _timed_ms(lambda src=src, dst=dst: dst.copy_(src), target_ms=40, runs=runs)
            copy_gbps = 2 * nbytes / (ms * 1e-3) / 1e9
            del src, dst
            say("host cost of one operation")
            x = torch.ones(256, device=dev)
            launches = []
            for _ in range(runs):
                torch.cuda.synchronize(dev)
                t0 = _time.perf_counter()
                for _ in range(2000):
                    x.add_(1.0)
                launches.append((_time.perf_counter() - t0) / 2000 * 1e6)
            torch.cuda.synchronize(dev)
            del x
            props = torch.cuda.get_device_properties(index)
            result = {
                "device_name": torch.cuda.get_device_name(index),
                "matmul_tflops": tflops,
                "matmul_n": shapes,
                "copy_gbps": copy_gbps,
                "launch_us": median(launches),
                "runs": runs,
                "multiprocessors": getattr(props, "multi_processor_count", None),
                "total_memory_bytes": getattr(props, "total_memory", None),
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "measured_unix_s": _time.time(),
            }
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.cuda.empty_cache()
    return result


def device_facts(index: int) -> dict[str, Any]:
    """Name, capability and memory of CUDA device ``index`` (initialises CUDA)."""
    props = torch.cuda.get_device_properties(index)
    return {
        "name": torch.cuda.get_device_name(index),
        "capability": f"{props.major}.{props.minor}",
        "total_memory_bytes": int(props.total_memory),
        "multiprocessors": props.multi_processor_count,
    }


def allocator_facts() -> dict[str, Any]:
    """The caching allocator's configuration, read without initialising CUDA."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    alt = os.environ.get("PYTORCH_ALLOC_CONF")
    raw = conf if conf is not None else alt
    backend = None
    try:
        backend = torch.cuda.get_allocator_backend() if torch.cuda.is_initialized() else None
    except Exception:  # noqa: BLE001 - old torch
        backend = None
    if backend is None:
        compact = (raw or "").replace(" ", "").lower()
        backend = "cudaMallocAsync" if "backend:cudamallocasync" in compact else "native"
    expandable = bool(raw) and "expandable_segments:true" in raw.replace(" ", "").lower()
    return {
        "PYTORCH_CUDA_ALLOC_CONF": conf,
        "PYTORCH_ALLOC_CONF": alt,
        "backend": backend,
        "expandable_segments": expandable,
    }


def device_name(index: int) -> str | None:
    """The GPU model of CUDA device ``index`` (``torch.cuda.get_device_name``), or None."""
    try:
        return torch.cuda.get_device_name(index)
    except Exception:  # noqa: BLE001 - a missing name, never a crash
        return None
