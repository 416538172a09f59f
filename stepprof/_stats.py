"""Order statistics: the one quantile and median that every figure uses, and a bounded sketch of them."""

from __future__ import annotations

import bisect
import math
from array import array
from collections.abc import Iterable, Sequence
from typing import Any, cast

__all__ = ["QuantileSketch", "median", "quantile"]


def quantile(sorted_xs: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile of an already sorted, non-empty sequence (numpy's default)."""
    pos = (len(sorted_xs) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def median(xs: Iterable[float]) -> float:
    """The median of a non-empty collection (the mean of the two middle values for an even count)."""
    return quantile(sorted(xs), 0.5)


def _sorted_every_other(xs: array[float], start: int) -> array[float]:
    """Every other value of ``xs`` sorted, from index ``start`` (0 or 1): numpy's stable sort of
    the C doubles (half of ``sorted``'s time on 65,536 of them, bench/sketch.py; the same values:
    both sorts are stable)."""
    import numpy as np

    kept = np.sort(np.frombuffer(xs, dtype=np.float64), kind="stable")[start::2]
    out = array("d")
    out.frombytes(kept.tobytes())
    return out


class QuantileSketch:
    """Quantiles of a stream in bounded memory.

    Exact (:func:`quantile`, numpy's linear interpolation, as in the summary) up to
    :attr:`EXACT` values.  Beyond, the buffer is sorted and every other value kept at
    twice the weight (a Munro-Paterson compactor), level by level; all the work is
    C-level sorting and slicing.  Memory stays O(EXACT x log(n / EXACT)) and the rank
    error below 0.1%.

    Values go in with ``add`` (or straight onto ``buf``, in a hot loop); call
    :meth:`settle` now and then to fold a full buffer into the compactor.

    Example:
        >>> sketch = QuantileSketch()
        >>> for x in (3.0, 1.0, 2.0):
        ...     sketch.add(x)
        >>> sketch.quantile(0.5), sketch.count, sketch.exact
        (2.0, 3, True)
    """

    EXACT = 32768
    __slots__ = ("buf", "levels", "n", "lo", "hi", "_flip", "_cache")

    def __init__(self) -> None:
        self.buf: list[float] = []
        # Level i holds values of weight 2**i, as C doubles (8 bytes a value, not a float
        # object's 32): the levels are what grows, with log(n).
        self.levels: list[array[float]] = []
        self.n = 0  # values folded into the levels
        self.lo = math.inf
        self.hi = -math.inf
        self._flip = 0
        self._cache: tuple[int, list[float], list[int] | None] | None = None

    def add(self, x: float) -> None:
        self.buf.append(x)

    def settle(self) -> None:
        """Fold the buffer into the compactor once it is full (call now and then)."""
        if len(self.buf) < self.EXACT:
            return
        self._account(self.buf)
        self._push(0, array("d", self.buf))
        self.buf = []

    def merge(self, other: QuantileSketch) -> None:
        """Fold in the values of ``other`` (a later stretch of the same stream).

        ``other`` may have compacted to a deeper level than this sketch: each of its
        levels goes into the level of the same weight, created as needed.
        """
        self.n += other.n
        self.lo = min(self.lo, other.lo)
        self.hi = max(self.hi, other.hi)
        for level, xs in enumerate(other.levels):
            if xs:
                self._push(level, array("d", xs))
        self.buf.extend(other.buf)
        self._cache = None
        self.settle()

    def __getstate__(self) -> tuple[Any, ...]:
        return (self.buf, self.levels, self.n, self.lo, self.hi, self._flip)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.buf, self.levels, self.n, self.lo, self.hi, self._flip = state
        self._cache = None

    def _account(self, xs: list[float]) -> None:
        self.n += len(xs)
        if xs:
            self.lo = min(self.lo, min(xs))
            self.hi = max(self.hi, max(xs))

    def _push(self, level: int, xs: array[float]) -> None:
        while True:
            while len(self.levels) <= level:
                self.levels.append(array("d"))
            merged = self.levels[level] + xs if self.levels[level] else xs
            if len(merged) < self.EXACT:
                self.levels[level] = merged
                return
            self._flip ^= 1
            self.levels[level] = array("d")
            xs, level = _sorted_every_other(merged, self._flip), level + 1

    @property
    def count(self) -> int:
        """How many values went in."""
        return self.n + len(self.buf)

    @property
    def exact(self) -> bool:
        """True while every value is kept (no compaction yet)."""
        return not any(self.levels)

    def _sorted(self) -> tuple[list[float], list[int] | None]:
        """The values, sorted, and the cumulative weight up to each, None while every weight
        is 1 (cached until the next add).  C-level work only: ``sorted``, or numpy's argsort."""
        key = self.count + 1_000_003 * len(self.levels)
        if self._cache is None or self._cache[0] != key:
            if self.exact:
                self._cache = (key, sorted(self.buf), None)
            else:
                import numpy as np

                parts = [np.asarray(self.buf, dtype=np.float64)]
                weights = [np.ones(len(self.buf), dtype=np.int64)]
                for i, level in enumerate(self.levels):
                    parts.append(np.frombuffer(level, dtype=np.float64))
                    weights.append(np.full(len(level), 2**i, dtype=np.int64))
                values = np.concatenate(parts)
                order = np.argsort(values, kind="stable")
                self._cache = (key, values[order].tolist(), np.cumsum(np.concatenate(weights)[order]).tolist())
        return self._cache[1], self._cache[2]

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile, or None for an empty stream."""
        if self.count == 0:
            return None
        xs, cum = self._sorted()
        if cum is None:
            return quantile(xs, q)
        i = bisect.bisect_right(cum, q * (cum[-1] - 1))
        return xs[min(i, len(xs) - 1)]

    def max(self) -> float | None:
        """The largest value (exact), or None for an empty stream."""
        if self.count == 0:
            return None
        return max(self.hi, max(self.buf)) if self.buf else self.hi

    def count_above(self, threshold: float) -> int:
        """About how many values exceed ``threshold`` (exact while :attr:`exact`)."""
        xs, cum = self._sorted()
        if not xs:
            return 0
        i = bisect.bisect_right(xs, threshold)
        if cum is None:
            return len(xs) - i
        return cum[-1] - (cum[i - 1] if i else 0)

    def percentiles(self) -> dict[str, float] | None:
        """``{"median", "p10", "p90"}``, or None for an empty stream."""
        if self.count == 0:
            return None
        # (floats: the stream is not empty)
        return cast("dict[str, float]",
                    {"median": self.quantile(0.5), "p10": self.quantile(0.1), "p90": self.quantile(0.9)})
