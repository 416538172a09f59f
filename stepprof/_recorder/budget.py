"""``Profiler(overhead_budget=...)``: how often a step is measured in full.

Under a budget every step still gets its wall time, index and sync count (a *light*
step: two clock reads and the sync tracker), and one step in :attr:`Budget.interval`
also gets its GPU time, peaks and phases (a *full* step: the device boundaries).  The
interval is a power of two, and a step is full when its index is a multiple of it, so
the full steps of a shorter interval include those of a longer one.

The collector feeds :meth:`Budget.add` with every measured record's ``overhead_us`` and
``wall_ms`` and calls :meth:`Budget.choose` after each harvest; the training thread asks
:meth:`Budget.interval_at` at each step's entry.

In a distributed run (``shared``), the ranks must measure the same steps in full, so that
their exchanged figures line up.  Each rank's choice is only its wish (:attr:`desired`),
sent with each exchange; every rank receives the same rows and adopts the longest interval
asked for, from the step one exchange period after that exchange (:meth:`agreed`).  A rank
whose answer is late measures every step in full from that step until it arrives
(:meth:`awaiting`): a superset of the agreed steps, never a subset.  Until the first answer,
every step is full.  With F the median cost of a full step, L of a light one
and W the median step time, the mean cost over an interval of k steps is
(F + (k - 1) L) / k, which is within ``fraction`` x W when
k >= (F - L) / (fraction x W - L).  The budget holds over the run: what the n measured steps so
far cost beyond n x ``fraction`` x W (the full steps before the first choice) comes off that
room, spread over the next n steps.  Until the first choice the collector harvests every
couple of steps (``Collector.harvest_at``), so that it comes soon after warm-up.
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
        #: Distributed: the interval is agreed through the exchange, not chosen here.
        self.shared = False
        #: The interval this rank's costs call for (what :meth:`choose` found last).
        self.desired = 1
        self._holds: deque[int] = deque()  # steps from which an exchange's answer is due
        self._changes: deque[tuple[int, int]] = deque()  # (from step, interval), agreed
        self._full: deque[float] = deque(maxlen=WINDOW)
        self._light: deque[float] = deque(maxlen=WINDOW)
        self._wall: deque[float] = deque(maxlen=WINDOW)
        self.counts = [0, 0]  # the measured steps' records added: [light, full]
        self._spent_us = 0.0  # their overhead_us, summed
        #: The first choice is made (until then every step is full, and the collector harvests
        #: early to make it soon: ``Collector.harvest_at``).
        self.chosen = False

    def add(self, full: bool, overhead_us: float, wall_ms: float) -> None:
        """A measured step's record (not warm-up, no error): its cost and its time."""
        (self._full if full else self._light).append(overhead_us)
        self._wall.append(wall_ms)
        self.counts[full] += 1
        self._spent_us += overhead_us

    def choose(self) -> int:
        """Choose the interval again from the recent records; return it.

        The budget is kept over the run, not only from here on: the cost already spent over it
        (the full steps before the first choice, a costlier stretch) is repaid over as many
        steps as have run, by a longer interval meanwhile."""
        if len(self._full) < FIRST_CHOICE_AFTER:
            return self.interval
        self.chosen = True
        full = statistics.median(self._full)
        light = statistics.median(self._light) if self._light else 0.0
        allowed = self.fraction * statistics.median(self._wall) * 1e3  # µs per step
        n = self.counts[0] + self.counts[1]
        room = allowed - max(0.0, self._spent_us - allowed * n) / n  # less the debt, repaid over n steps
        if allowed <= light:
            k = MAX_INTERVAL
            self.unmet = (
                f"a step without GPU figures still costs {light:.1f} µs, over "
                f"overhead_budget={self.fraction:g} of the median step ({allowed:.1f} µs)"
            )
        else:
            self.unmet = None
            if room <= light:  # (the debt takes every light step's room: no full step for now)
                k = MAX_INTERVAL
            else:
                need = max(1.0, (full - light) / (room - light))
                k = min(MAX_INTERVAL, 1 << math.ceil(math.log2(need)))
        self.desired = k
        if not self.shared:
            self.interval = k
        return k

    def interval_at(self, index: int) -> int:
        """The interval for step ``index`` (training thread)."""
        changes = self._changes
        while changes and index >= changes[0][0]:
            start, self.interval = changes.popleft()
            if self._holds and self._holds[0] == start:
                self._holds.popleft()
        if self._holds and index >= self._holds[0]:
            return 1  # the ranks' answer for this stretch is not in yet: every step in full
        return self.interval

    def awaiting(self, start: int) -> None:
        """An exchange was sent: its answer applies from step ``start`` (training thread)."""
        self._holds.append(start)

    def agreed(self, start: int, interval: int) -> None:
        """The ranks' answer: ``interval`` from step ``start`` on (collector thread)."""
        self._changes.append((start, max(1, min(MAX_INTERVAL, interval))))

    def verdict(self, overhead_us_mean: float | None, wall_ms_median: float | None) -> str | None:
        """Why the run cost more than the budget, with the figures; None where it kept it (or
        nothing was measured).  ``overhead_us_mean`` and ``wall_ms_median``: the summary's."""
        if self.unmet is not None:
            return self.unmet
        if overhead_us_mean is None or not wall_ms_median or wall_ms_median <= 0:
            return None
        share = overhead_us_mean / (wall_ms_median * 1e3)
        if share <= self.fraction:
            return None
        light, full = self.counts
        return (f"stepprof cost {share:.2%} of the median step ({overhead_us_mean:.1f} µs a step on average, "
                f"the median step {wall_ms_median:.3f} ms), over overhead_budget={self.fraction:g}: {full} of "
                f"{light + full} measured steps were measured in full (every step until the costs of "
                f"{FIRST_CHOICE_AFTER} full ones were harvested, then one in {self.interval})")

    def reason(self, interval: int) -> str:
        """Why a light step has no GPU figures."""
        return f"not sampled (overhead_budget={self.fraction:g}: one step in {interval})"
