"""Order statistics: the one quantile and median that every figure uses."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

__all__ = ["median", "quantile"]


def quantile(sorted_xs: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile of an already sorted, non-empty sequence (numpy's default)."""
    pos = (len(sorted_xs) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def median(xs: Iterable[float]) -> float:
    """The median of a non-empty collection (the mean of the two middle values for an even count)."""
    return quantile(sorted(xs), 0.5)
