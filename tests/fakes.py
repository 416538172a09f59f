"""A fake device and clock for driving stepprof's recorder on a CPU.

``FakeGpu`` simulates an asynchronous device: work launched from the host is
queued and runs back to back; a mark (event) completes when simulated device
time reaches it; the host clock only moves when a test says so.  It also keeps
an allocator's current/peak counters.
"""

from __future__ import annotations

import random


class FakeEvent:
    __slots__ = ("t_ns", "uid")
    _next = 0

    def __init__(self, t_ns: int) -> None:
        self.t_ns = t_ns
        FakeEvent._next += 1
        self.uid = FakeEvent._next


class FakeGpu:
    device = "cuda:0"
    gpu_reason = None
    memory_reason = None

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

    def wait_idle(self) -> None:
        """Let the host sleep until the device has drained (not a stepprof sync)."""
        self.host_ns = max(self.host_ns, self.gpu_free_at)

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

    def read_memory(self) -> tuple[int, int]:
        self._maybe_fail("read_memory")
        return self.peak, self.reserved

    def synchronize(self) -> None:
        self.syncs += 1
        self.wait_idle()

    def range_push(self, name: str) -> None:
        self.ranges.append("+" + name)

    def range_pop(self) -> None:
        self.ranges.append("-")


# -- the batch-size sweep ------------------------------------------------------------


class FakeSweepGpu(FakeGpu):
    """FakeGpu plus what the sweep reads: allocator counters, live bytes, capacity."""

    index = 0

    def __init__(self, *, capacity: int, seed: int = 0) -> None:
        super().__init__(seed=seed)
        self.capacity = capacity
        self.retries = 0
        self.device_allocs = 0
        self.empty_cache_calls = 0

    def allocator_counters(self) -> tuple[int, int]:
        return self.retries, self.device_allocs

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
            self.gpu.retries += 2
            self.gpu.device_allocs += 2
        self.gpu.launch(self.ms(n) * (1 + self.rng.uniform(-self.noise, self.noise)))
        self.gpu.wait_idle()
        del layers
