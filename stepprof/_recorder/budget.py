"""``Profiler(overhead_budget=...)``: how often a step is measured in full.

Under a budget every step still gets its wall time, index and sync count (a *light*
step: two clock reads and the sync tracker), and one step in :attr:`Budget.interval`
also gets its GPU time, peaks and phases (a *full* step: the device boundaries).  The
interval is a power of two, and a step is full when its index is a multiple of it, so
the full steps of a shorter interval include those of a longer one.

The collector feeds :meth:`Budget.add` with every measured record's ``overhead_us`` and
``wall_ms`` and calls :meth:`Budget.choose` after each harvest; the training thread only
reads :attr:`Budget.interval`.  With F the median cost of a full step, L of a light one
and W the median step time, the mean cost over an interval of k steps is
(F + (k - 1) L) / k, which is within ``fraction`` x W when
k >= (F - L) / (fraction x W - L).
"""

from __future__ import annotations

import math
import statistics
from collections import deque

#: The longest interval: one full step in this many.
MAX_INTERVAL = 1024
#: Recent records the choice looks at, per kind.
WINDOW = 32
#: Full steps measured before the first choice.
FIRST_CHOICE_AFTER = 4


class Budget:
    """The interval between full steps, chosen from the measured costs.

    Args:
        fraction: the budget, a fraction of the median step time (``overhead_budget``).
    """

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction
        #: One step in this many is measured in full (a power of two; 1 until measured).
        self.interval = 1
        #: Why the budget cannot be met (a light step alone costs more), or None.
        self.unmet: str | None = None
        self._full: deque[float] = deque(maxlen=WINDOW)
        self._light: deque[float] = deque(maxlen=WINDOW)
        self._wall: deque[float] = deque(maxlen=WINDOW)

    def add(self, full: bool, overhead_us: float, wall_ms: float) -> None:
        """A measured step's record (not warm-up, no error): its cost and its time."""
        (self._full if full else self._light).append(overhead_us)
        self._wall.append(wall_ms)

    def choose(self) -> int:
        """Choose the interval again from the recent records; return it."""
        if len(self._full) < FIRST_CHOICE_AFTER:
            return self.interval
        full = statistics.median(self._full)
        light = statistics.median(self._light) if self._light else 0.0
        allowed = self.fraction * statistics.median(self._wall) * 1e3  # µs per step
        if allowed <= light:
            k = MAX_INTERVAL
            self.unmet = (
                f"a step without GPU figures still costs {light:.1f} µs, over "
                f"overhead_budget={self.fraction:g} of the median step ({allowed:.1f} µs)"
            )
        else:
            need = max(1.0, (full - light) / (allowed - light))
            k = min(MAX_INTERVAL, 1 << max(0, math.ceil(math.log2(need))))
            self.unmet = None
        self.interval = k
        return k

    def reason(self, interval: int) -> str:
        """Why a light step has no GPU figures."""
        return f"not sampled (overhead_budget={self.fraction:g}: one step in {interval})"
