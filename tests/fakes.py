"""A fake device and clock for driving stepprof's recorder on a CPU, and a fake NVML.

``FakeGpu`` simulates an asynchronous device: work launched from the host is
queued and runs back to back; a mark (event) completes when simulated device
time reaches it; the host clock only moves when a test says so.  It also keeps
an allocator's current/peak counters, and the memory the process holds outside
the allocator (``outside``: the CUDA context, libraries).

``FakeNvml`` stands in for the ``pynvml`` module (tests put it in
``sys.modules``, where ``stepprof._device.nvml`` imports it).  It sees a ``FakeGpu``:
the process's NVML figure is the allocator's reserved bytes plus ``outside``.
"""

from __future__ import annotations

import os
import random
import sys
import time
from types import SimpleNamespace

from stepprof import _syncs
from stepprof._device.backend import AllocatorFigures, BoundaryOps

GiB = 2**30
MiB = 2**20


class FakeEvent:
    __slots__ = ("t_ns", "uid")
    _next = 0

    def __init__(self, t_ns: int) -> None:
        self.t_ns = t_ns
        FakeEvent._next += 1
        self.uid = FakeEvent._next


class FakeRoute:
    """A sync route (``stepprof._syncs.Route``) that only counts; ``give_way`` is what its
    ``ensure`` says (as the "warn" route says when the user set a sync-debug mode)."""

    traced = False

    def __init__(self) -> None:
        self.installs = self.uninstalls = self.ensures = 0
        self.give_way: str | None = None

    def install(self) -> None:
        self.installs += 1

    def uninstall(self) -> None:
        self.uninstalls += 1

    def ensure(self) -> str | None:
        self.ensures += 1
        return self.give_way

    def checks(self) -> tuple:
        """What ensure() checks: that it gives no way."""
        return ((self, "give_way", None, None),)


class FakeGpu(BoundaryOps):
    device = "cuda:0"
    index: int | None = None
    has_device_timing = True
    has_device_memory = True
    gpu_reason = None
    memory_reason = None
    sync_mechanism = "fake"
    sync_reason = None

    def __init__(self, *, mark_cost_ns: int = 0, seed: int = 0) -> None:
        self.host_ns = 1_000_000_000
        self.gpu_free_at = self.host_ns
        self.allocated = 0
        self.peak = 0
        self.reserved = 0
        self.syncs = 0
        self.marks_made = 0
        self.released: list[FakeEvent] = []
        self.ranges: list[str] = []
        self.calls: list[str] = []
        self.mark_cost_ns = mark_cost_ns
        self.rng = random.Random(seed)
        self.fail_on: str | None = None
        # The allocator's cumulative counters, in ALLOCATOR_COUNTERS order: num_alloc_retries,
        # num_sync_all_streams, num_device_alloc, num_device_free (also read by name below).
        self.counters = [0, 0, 0, 0]
        self.route = FakeRoute()  # what a sync session holds: counts its (un)installs
        self.sessions = _syncs.Sessions()
        # Memory for the reconciliation: outside the allocator, and the device.
        self.outside = 500 * MiB          # CUDA context and libraries
        self.total = 80 * GiB
        self.others = 0                   # bytes other processes hold on the device
        self.inactive_split = 0
        self.num_ooms = 0
        self.uuid: str | None = "6f1c2a3b-0000-4000-8000-00000000c0de"
        self.pci_bus_id: str | None = "00000000:65:00.0"
        # explain_peak: a tests.peak_snapshots.FakeAllocator stands in for the allocator's
        # history (None: begin_history says why not, with history_reason).
        self.history = None
        self.history_reason = "the fake has no allocator history"
        self.history_calls: list[str] = []

    # -- what a test does -------------------------------------------------
    def clock(self) -> int:
        return self.host_ns

    def host(self, ms: float) -> None:
        """Host-side Python work: advances the host clock."""
        self.host_ns += int(ms * 1e6)

    def launch(self, ms: float, jitter: float = 0.0) -> None:
        """Queue device work of ``ms`` (plus seeded noise up to ``jitter`` ms)."""
        ms += self.rng.uniform(0, jitter)
        start = max(self.gpu_free_at, self.host_ns)
        self.gpu_free_at = start + int(ms * 1e6)

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)
        self.reserved = max(self.reserved, self.allocated)

    def free(self, n: int) -> None:
        self.allocated -= n

    def sync(self, hint: str | None = None, *, depth: int = 1) -> None:
        """A host-device wait made by the caller's line (as torch would report it)."""
        _syncs.dispatch(hint, sys._getframe(depth))
        self.wait_idle()

    def wait_idle(self) -> None:
        """Let the host sleep until the device has drained (not a stepprof sync)."""
        self.host_ns = max(self.host_ns, self.gpu_free_at)

    @property
    def num_alloc_retries(self) -> int:
        return self.counters[0]

    @num_alloc_retries.setter
    def num_alloc_retries(self, n: int) -> None:
        self.counters[0] = n

    @property
    def num_device_alloc(self) -> int:
        return self.counters[2]

    @num_device_alloc.setter
    def num_device_alloc(self, n: int) -> None:
        self.counters[2] = n

    # -- the backend interface -----------------------------------------------
    def _maybe_fail(self, what: str) -> None:
        self.calls.append(what)
        if self.fail_on == what:
            raise RuntimeError(f"fake failure in {what}")

    def mark(self) -> FakeEvent:
        self._maybe_fail("mark")
        self.marks_made += 1
        self.host_ns += self.mark_cost_ns
        ev = FakeEvent(max(self.gpu_free_at, self.host_ns))
        self.gpu_free_at = ev.t_ns
        return ev

    def is_done(self, mark: FakeEvent | None) -> bool:
        return mark is None or mark.t_ns <= self.host_ns

    def elapsed_ms(self, start: FakeEvent, end: FakeEvent) -> float:
        assert self.is_done(start) and self.is_done(end), "elapsed_ms on a pending event would sync"
        return (end.t_ns - start.t_ns) / 1e6

    def release(self, mark: FakeEvent | None) -> None:
        if mark is not None:
            assert mark not in self.released, "event released twice"
            self.released.append(mark)

    def reset_peak(self) -> None:
        self._maybe_fail("reset_peak")
        self.peak = self.allocated

    def read_memory(self) -> tuple[int, ...]:
        self._maybe_fail("read_memory")
        return (self.peak, self.reserved, *self.counters)

    def watch_syncs(self, tracker: _syncs.SyncTracker) -> str | None:
        if self.sync_reason is not None:
            return self.sync_reason
        tracker.mechanism = self.sync_mechanism
        return self.sessions.watch(tracker, lambda: self.route)

    def unwatch_syncs(self, tracker: _syncs.SyncTracker) -> None:
        try:
            self._maybe_fail("unwatch_syncs")  # like an undo that fails: the rest still run
        finally:
            _syncs.detach(tracker)

    def end_syncs(self) -> None:
        self._maybe_fail("end_syncs")
        self.sessions.end()

    def syncs_outside_steps(self) -> tuple[int | None, str | None]:
        return self.sessions.outside(self.sync_reason)

    @property
    def installs(self) -> int:
        return self.route.installs

    @property
    def uninstalls(self) -> int:
        return self.route.uninstalls

    def synchronize(self) -> None:
        self.syncs += 1
        self.wait_idle()

    def wait(self, marks) -> None:  # waits for the events' completion: the fake's device idles
        self.synchronize()

    def range_push(self, name: str) -> None:
        self.ranges.append("+" + name)

    def range_pop(self) -> None:
        self.ranges.append("-")

    def read_allocator(self) -> AllocatorFigures:
        self._maybe_fail("read_allocator")
        return AllocatorFigures(
            self.allocated, self.peak, self.reserved, self.inactive_split,
            self.num_ooms, self.num_alloc_retries,
        )

    def mem_get_info(self) -> tuple[int, int]:
        self._maybe_fail("mem_get_info")
        return self.total - self.process_bytes() - self.others, self.total

    def begin_history(self, max_entries: int):
        from stepprof._device.backend import HistoryStart

        self.history_calls.append(f"begin {max_entries}")
        self._maybe_fail("begin_history")
        if self.history is None:
            return self.history_reason
        before = time.time_ns() / 1000
        start = self.history.start()
        return HistoryStart(start, before, time.time_ns() / 1000, self.history.annotating)

    def end_history(self):
        self.history_calls.append("end")
        self._maybe_fail("end_history")
        snap = self.history.snapshot()
        self.history.recording = False
        return snap

    def identity(self) -> tuple[str | None, str | None]:
        self._maybe_fail("identity")
        return self.uuid, self.pci_bus_id

    def process_bytes(self) -> int:
        """What the driver holds for this process: the allocator's reserve plus the rest."""
        return self.reserved + self.outside


class NVMLError(Exception):
    """pynvml's error: one class per code in the real module; ``value`` is the code."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return f"fake NVML error {self.value}"


class FakeNvml:
    """Enough of the ``pynvml`` module for stepprof._device.nvml, seeing one ``FakeGpu``.

    ``fail[name] = code`` makes ``name`` raise ``NVMLError(code)``; ``calls``
    counts every call by name; ``pid_visible=False`` lists the process under a
    host PID, as NVML does inside a container.
    """

    # Real NVML values (nvml.h).
    NVML_ERROR_UNINITIALIZED = 1
    NVML_ERROR_INVALID_ARGUMENT = 2
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_NO_PERMISSION = 4
    NVML_ERROR_NOT_FOUND = 6
    NVML_ERROR_DRIVER_NOT_LOADED = 9
    NVML_ERROR_LIBRARY_NOT_FOUND = 12
    NVML_ERROR_FUNCTION_NOT_FOUND = 13
    NVML_ERROR_GPU_IS_LOST = 15
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
    NVML_ERROR_UNKNOWN = 999
    nvmlMemory_v2 = 0x02000028
    NVMLError = NVMLError

    def __init__(self, gpu, *, official: bool = True) -> None:
        self.gpu = gpu
        self.fail: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.initialised = 0
        self.pid_visible = True
        self.other_pids: list[int] = []
        self.used_memory_available = True
        self.mig = False              # the device torch names is a MIG instance
        self.parent_in_mig = False    # torch's UUID names a whole GPU that is in MIG mode
        self.driver_reserved = 300 * MiB
        # The energy counter: the device draws ``power_w`` (None: NotSupported, as on a GPU
        # without the counter), integrated over the fake host clock; ``energy_threads``
        # names the thread of each read.
        self.power_w: float | None = None
        self.power_limit_w: float | None = 700.0
        self.energy_threads: list[str] = []
        self._energy_mj = 0.0
        self._energy_at = gpu.host_ns
        # The GPU as NVML knows it (torch's side may be changed to miss it).
        self.uuid, self.pci_bus_id = gpu.uuid, gpu.pci_bus_id
        if official:
            self._nvmlGetFunctionPointer = lambda name: None

    def _call(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        if name in self.fail:
            raise NVMLError(self.fail[name])
        if name not in ("nvmlInit", "nvmlShutdown") and self.initialised <= 0:
            raise NVMLError(self.NVML_ERROR_UNINITIALIZED)

    def nvmlInit(self) -> None:
        self._call("nvmlInit")
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self._call("nvmlShutdown")
        self.initialised -= 1

    def _uuid(self) -> str:
        return ("MIG-" if self.mig else "GPU-") + str(self.uuid)

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        self._call("nvmlDeviceGetHandleByUUID")
        if uuid != self._uuid():
            raise NVMLError(self.NVML_ERROR_NOT_FOUND)
        return "handle"

    def nvmlDeviceGetHandleByPciBusId(self, bus_id: str) -> str:
        self._call("nvmlDeviceGetHandleByPciBusId")
        if bus_id != self.pci_bus_id:
            raise NVMLError(self.NVML_ERROR_NOT_FOUND)
        return "handle"

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:  # stepprof must never call it
        raise AssertionError("stepprof matched an NVML device by index")

    def nvmlDeviceGetUUID(self, handle: str) -> str:
        self._call("nvmlDeviceGetUUID")
        return self._uuid()

    def nvmlDeviceIsMigDeviceHandle(self, handle: str) -> int:
        self._call("nvmlDeviceIsMigDeviceHandle")
        return int(self.mig)

    def nvmlDeviceGetMigMode(self, handle: str) -> list[int]:
        self._call("nvmlDeviceGetMigMode")
        if not self.parent_in_mig:
            raise NVMLError(self.NVML_ERROR_NOT_SUPPORTED)   # as on a GPU without MIG
        return [1, 1]

    def nvmlDeviceGetMemoryInfo(self, handle: str, version: int | None = None) -> SimpleNamespace:
        self._call("nvmlDeviceGetMemoryInfo")
        used = self.gpu.process_bytes() + self.gpu.others
        return SimpleNamespace(
            total=self.gpu.total + self.driver_reserved, reserved=self.driver_reserved,
            free=self.gpu.total - used, used=used,
        )

    def nvmlDeviceGetComputeRunningProcesses(self, handle: str) -> list[SimpleNamespace]:
        self._call("nvmlDeviceGetComputeRunningProcesses")
        mine = self.gpu.process_bytes() if self.used_memory_available else None
        pid = os.getpid() if self.pid_visible else 4_000_000 + os.getpid()
        procs = [SimpleNamespace(pid=pid, usedGpuMemory=mine)]
        return procs + [SimpleNamespace(pid=p, usedGpuMemory=GiB) for p in self.other_pids]

    def set_power(self, watts: float | None) -> None:
        """From the fake host clock's now on, the device draws ``watts``."""
        self._energy_mj = self.energy_mj()
        self._energy_at = self.gpu.host_ns
        self.power_w = watts

    def energy_mj(self) -> float:
        """The counter's exact value now (the test's reference)."""
        return self._energy_mj + (self.power_w or 0.0) * (self.gpu.host_ns - self._energy_at) / 1e6

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: str) -> int:
        import threading

        self._call("nvmlDeviceGetTotalEnergyConsumption")
        self.energy_threads.append(threading.current_thread().name)
        if self.power_w is None:
            raise NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return round(self.energy_mj())

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: str) -> int:
        self._call("nvmlDeviceGetEnforcedPowerLimit")
        if self.power_limit_w is None:
            raise NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return round(self.power_limit_w * 1e3)


# -- the batch-size sweep ------------------------------------------------------------


class FakeSweepGpu(FakeGpu):
    """FakeGpu plus what the sweep reads: allocator counters, live bytes, capacity."""

    index = 0

    def __init__(self, *, capacity: int, seed: int = 0) -> None:
        super().__init__(seed=seed)
        self.capacity = capacity
        self.empty_cache_calls = 0

    def allocator_counters(self) -> tuple[int, int]:
        return self.num_alloc_retries, self.num_device_alloc

    def allocated_bytes(self) -> int:
        return self.allocated

    def empty_cache(self) -> None:
        self.empty_cache_calls += 1
        self.reserved = self.allocated

    def capacity_bytes(self) -> int:
        return self.capacity


class Held:
    """Fake device memory owned by a Python object: it is freed when the object dies."""

    def __init__(self, gpu: FakeGpu, nbytes: int) -> None:
        gpu.alloc(nbytes)
        self.gpu = gpu
        self.nbytes = nbytes

    def __del__(self) -> None:
        self.gpu.free(self.nbytes)


class SyntheticStep:
    """A training step with a known curve, on a fake device and clock.

    Step time is ``fixed_ms + per_sample_ms * n`` (so samples/s climbs and
    flattens), times ``thrash_factor`` from ``thrash_from`` on, where each step
    also makes the allocator retry; times seeded noise of +-``noise``.  Peak
    memory is ``base_bytes + per_sample_bytes * n``; a step whose peak exceeds
    ``usable`` raises ``torch.OutOfMemoryError`` with half its activations
    still referenced from its frame, as a real step would.
    """

    def __init__(
        self,
        gpu: FakeGpu,
        *,
        fixed_ms: float = 2.0,
        per_sample_ms: float = 0.01,
        base_bytes: int = 10**9,
        per_sample_bytes: int = 10**7,
        usable: int = 39 * 10**9,
        noise: float = 0.01,
        thrash_from: int | None = None,
        thrash_factor: float = 1.0,
        leak_on_oom: bool = False,
        layers: int = 8,
        seed: int = 0,
    ) -> None:
        self.gpu = gpu
        self.layers = layers
        self.fixed_ms = fixed_ms
        self.per_sample_ms = per_sample_ms
        self.per_sample_bytes = per_sample_bytes
        self.usable = usable
        self.noise = noise
        self.thrash_from = thrash_from
        self.thrash_factor = thrash_factor
        self.leak_on_oom = leak_on_oom
        self.leaked: list[Held] = []
        self.rng = random.Random(seed)
        self.weights = Held(gpu, base_bytes)
        self.base_bytes = base_bytes
        self.calls: list[int] = []

    @property
    def true_max(self) -> int:
        """The largest batch that fits."""
        return (self.usable - self.base_bytes) // self.per_sample_bytes

    def ms(self, n: int) -> float:
        """The noiseless step time at batch ``n``."""
        ms = self.fixed_ms + self.per_sample_ms * n
        if self.thrash_from is not None and n >= self.thrash_from:
            ms *= self.thrash_factor
        return ms

    def make_batch(self, n: int):
        import torch

        return torch.empty(n, 1)

    def __call__(self, batch) -> None:
        import torch

        n = int(batch.shape[0])
        self.calls.append(n)
        need = self.per_sample_bytes * n
        # Activations arrive layer by layer: the step fails at the first layer that does
        # not fit, with the earlier layers' activations referenced from this frame.
        layers: list[Held] = []
        for i in range(self.layers):
            size = need // self.layers + (need % self.layers if i == 0 else 0)
            if self.gpu.allocated + size > self.usable:
                if self.leak_on_oom:
                    self.leaked.extend(layers)
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory. Tried to allocate {size / 2**20:.2f} MiB."
                )
            layers.append(Held(self.gpu, size))
        if self.thrash_from is not None and n >= self.thrash_from:
            self.gpu.num_alloc_retries += 2
            self.gpu.num_device_alloc += 2
        self.gpu.launch(self.ms(n) * (1 + self.rng.uniform(-self.noise, self.noise)))
        self.gpu.wait_idle()
        del layers


class TracedGpu(FakeGpu):
    """FakeGpu whose waits reach stepprof as with ``syncs="trace"``: through torch's GPU-trace
    callbacks (``fire_callbacks``, which torch calls from C++ and which logs what a callback
    raises), with stepprof's trace route installed.  Tests count this file as torch's own."""

    sync_mechanism = "trace"

    def __init__(self) -> None:
        super().__init__()
        from torch._utils import CallbackRegistry

        from stepprof._device import sync_routes

        self.callbacks = CallbackRegistry("stream synchronization")
        self.callbacks.add_callback(sync_routes.on_stream_sync)
        self.route = sync_routes.trace_route()

    def sync(self, hint: str | None = None, *, depth: int = 1) -> None:
        self.callbacks.fire_callbacks(0)
        self.wait_idle()


class PlannedGpu(FakeGpu):
    """A FakeGpu whose sync watch the C step core may do itself, as it does CUDA's
    (``CudaBackend.sync_plan``): its unwatch_syncs is ``_syncs.detach``, nothing more."""

    def sync_plan(self):
        return self.sessions.plan(self.sync_mechanism)

    def unwatch_syncs(self, tracker: _syncs.SyncTracker) -> None:
        _syncs.detach(tracker)
