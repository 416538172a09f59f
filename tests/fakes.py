"""A fake device and clock for driving stepprof's recorder on a CPU.

``FakeGpu`` simulates an asynchronous device: work launched from the host is
queued and runs back to back; a mark (event) completes when simulated device
time reaches it; the host clock only moves when a test says so.  It also keeps
an allocator's current/peak counters.
"""

from __future__ import annotations

import random
import sys

from stepprof import _syncs


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
        self.counters = [0, 0, 0, 0]  # num_alloc_retries, num_sync_all_streams, device alloc/free
        self.installs = 0
        self.uninstalls = 0

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

    def read_memory(self) -> tuple[int, int, tuple[int, ...]]:
        self._maybe_fail("read_memory")
        return self.peak, self.reserved, tuple(self.counters)

    def watch_syncs(self, tracker: _syncs.SyncTracker) -> str | None:
        if self.sync_reason is not None:
            return self.sync_reason
        tracker.mechanism = self.sync_mechanism

        def install():
            self.installs += 1

            def undo():
                self.uninstalls += 1

            return [undo]

        _syncs.attach(tracker, install)
        return None

    def unwatch_syncs(self) -> None:
        try:
            self._maybe_fail("unwatch_syncs")  # like an undo that fails: the rest still run
        finally:
            _syncs.detach()

    def synchronize(self) -> None:
        self.syncs += 1
        self.wait_idle()

    def range_push(self, name: str) -> None:
        self.ranges.append("+" + name)

    def range_pop(self) -> None:
        self.ranges.append("-")
