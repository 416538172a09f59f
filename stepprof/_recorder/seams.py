"""What tests and benchmarks replace in a profiler: the device, the clock, the collector.

These are not part of ``Profiler(...)``'s signature: a profiler made with seams comes from
``stepprof._recorder.profiler._make_profiler(log, backend=..., clock=..., ...)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import attrs

from .._device.backend import Backend
from .._dist import CLOSE_WAIT_S, Gather
from .collector import COLLECT_EVERY_S


@attrs.frozen
class Seams:
    """A profiler's replaceable parts.

    Attributes:
        backend: the device backend (None: chosen at the first step).
        clock: the step clock, in nanoseconds.
        collect_every_s: the collector thread's period; None harvests inline at each
            step's exit instead (deterministic).
        gather: the exchange's all-gather (None: torch.distributed's).
        close_wait_s: how long close waits for the other ranks' exchanges.
    """

    backend: Backend | None = None
    clock: Callable[[], int] = time.perf_counter_ns
    collect_every_s: float | None = COLLECT_EVERY_S
    gather: Gather | None = None
    close_wait_s: float = CLOSE_WAIT_S


#: A profiler's own parts.
REAL = Seams()
