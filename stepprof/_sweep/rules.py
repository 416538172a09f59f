"""Pure decisions over a sweep's points: the knee, the thrash zone, the memory fit,
the 3% certificate on the boundary, where to probe it next, and the recommendation
with its reason."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from .._units import format_bytes
from .result import SweepPoint

__all__ = [
    "AIM",
    "DROP",
    "choose_probe",
    "explain_recommendation",
    "find_knee",
    "find_recommended",
    "find_thrash_zone",
    "largest_certifying_oom",
    "memory_fit",
    "outside_zone",
    "ran_points",
    "smallest_certified_fit",
]

#: ``max_fit`` is certified when the smallest batch that ran out of memory is at
#: most 3% above it: ``first_oom <= floor(max_fit * 103 / 100) + 1``.
_TOL_NUM, _TOL_DEN = 103, 100
#: Samples/s more than 5% below the best of the smaller batches counts as a drop;
#: it is also the noise margin on the bound that decides whether to backfill.
DROP = 0.05
#: Probes aim this far under the boundary the memory fit predicts from the bytes
#: the device can give: the allocator never hands all of them to tensors, and
#: aiming 3% low makes (fit here, out of memory 3% higher) the likely outcome.
AIM = 0.97


def ran_points(points: Sequence[SweepPoint]) -> list[SweepPoint]:
    """The points that ran (no out-of-memory error, a samples/s figure), by batch size."""
    return sorted(
        (p for p in points if not p.oom and p.samples_per_s is not None), key=lambda p: p.batch_size
    )


def find_knee(points: Sequence[SweepPoint], within: float = 0.10) -> int | None:
    """The smallest batch whose samples/s is within ``within`` of the best that ran."""
    ran = ran_points(points)
    if not ran:
        return None
    best = max(p.samples_per_s for p in ran)  # type: ignore[type-var]
    return next(p.batch_size for p in ran if p.samples_per_s >= (1 - within) * best)  # type: ignore[operator]


def find_thrash_zone(points: Sequence[SweepPoint]) -> range | None:
    """Batches from the first sign of thrash up to the largest that ran, or None.

    A sign of thrash is a batch whose timed steps made the allocator retry
    (``alloc_retries > 0``: a cudaMalloc failed, the cache was freed, and the
    allocation retried), or a batch above the fastest clean batch whose samples/s
    fell more than 5% below it, beyond noise: even at its fastest-decile step time
    (``step_ms_p10``) it is more than 5% below the best median.
    """
    ran = ran_points(points)
    if not ran:
        return None
    starts = [p.batch_size for p in ran if p.alloc_retries]
    clean = [p for p in ran if not p.alloc_retries]
    if clean:
        best = max(clean, key=lambda p: p.samples_per_s)  # type: ignore[arg-type,return-value]
        floor = (1 - DROP) * best.samples_per_s  # type: ignore[operator]
        starts += [
            p.batch_size for p in clean
            if p.batch_size > best.batch_size and _fastest_rate(p) < floor
        ]
    if not starts:
        return None
    return range(min(starts), ran[-1].batch_size + 1)


def _fastest_rate(point: SweepPoint) -> float:
    """Samples/s at the point's fastest-decile step time (its median rate without p10)."""
    if point.step_ms_p10:
        return point.batch_size / (point.step_ms_p10 / 1e3)
    return point.samples_per_s or 0.0


def outside_zone(points: Sequence[SweepPoint], zone: range | None) -> list[SweepPoint]:
    """The points whose batch size is not in ``zone`` (all of them when it is None)."""
    return [p for p in points if zone is None or p.batch_size not in zone]


def find_recommended(points: Sequence[SweepPoint], zone: range | None, within: float) -> int | None:
    """The recommended batch: the knee of the points outside the thrash zone."""
    return find_knee(outside_zone(points, zone), within)


def memory_fit(fits: Mapping[int, SweepPoint]) -> tuple[float, float] | None:
    """(base bytes, bytes per sample) from the largest batch that ran and a smaller one.

    The smaller one is the largest at most 2/3 of it (else the next smaller), so
    that allocator rounding between close sizes does not set the slope.
    """
    pts = sorted((n, p.peak_allocated_bytes) for n, p in fits.items() if p.peak_allocated_bytes is not None)
    if len(pts) < 2:
        return None
    na, ma = pts[-1]
    below = [q for q in pts[:-1] if q[0] * 3 <= na * 2] or pts[:-1]
    nb, mb = below[-1]
    slope = (ma - mb) / (na - nb)
    if slope <= 0:
        return None
    return ma - slope * na, slope


def largest_certifying_oom(lo: int) -> int:
    """The largest batch whose out-of-memory error certifies ``lo`` within 3%."""
    return lo * _TOL_NUM // _TOL_DEN + 1


def smallest_certified_fit(hi: int) -> int:
    """The smallest batch whose fit certifies it within 3% of ``hi`` (which ran out of memory)."""
    return -(-(hi - 1) * _TOL_DEN // _TOL_NUM)


def choose_probe(
    lo: int,
    hi: int | None,
    *,
    last_miss: bool,
    boundary: float | None,
    floor_guess: float | None,
    max_batch: int | None,
) -> tuple[int, str | None]:
    """The next probe of the refine phase, and the outcome the memory fit expects
    ("fit", "oom" or None).

    Args:
        lo: the largest batch that ran.
        hi: the smallest batch that ran out of memory, or None.
        last_miss: the previous probe's outcome contradicted the fit.
        boundary: the largest batch the memory fit says fits the allocator's capacity, or None.
        floor_guess: the largest batch the fit says fits in the most bytes held at once, or None.
        max_batch: the user's bound, or None.
    """
    up = largest_certifying_oom(lo)
    if boundary is not None and boundary <= lo:
        boundary = None  # a batch above the predicted boundary ran: the fit is off here
    goal = None if boundary is None else AIM * boundary
    expect: str | None
    if hi is None:
        if goal is None or last_miss:
            probe, expect = 2 * lo, None
        elif goal <= up:
            probe, expect = up, "oom"
        else:
            probe, expect = int(goal), "fit"
    else:
        down = smallest_certified_fit(hi)
        # After an out-of-memory error, the bytes it held at once bound the limit from
        # below: if that bound says a batch past the certifying point fits, aim there.
        # The optimistic fit is not trusted again right after it was wrong; the bound is.
        if last_miss:
            goal = None
        if floor_guess is not None and floor_guess > up:
            goal = floor_guess
        if goal is None:
            probe, expect = round(math.sqrt(lo * hi)), None
        elif goal >= down:
            probe, expect = down, "fit"
        elif goal <= up:
            probe, expect = up, "oom"
        else:
            probe, expect = int(goal), "fit"
        probe = min(max(probe, lo + 1), hi - 1)
    if max_batch is not None and probe > max_batch:
        probe, expect = max_batch, None
    return probe, expect


def explain_recommendation(
    points: Sequence[SweepPoint],
    zone: range | None,
    recommended: int | None,
    *,
    max_fit: int | None,
    first_oom: int | None,
    stopped: str,
    knee_within: float,
    max_batch: int | None,
    on_host: bool = False,
) -> str:
    """One paragraph on why ``recommended`` was chosen (or why none was).

    ``on_host``: the sweep ran on the CPU, where a slower batch is no allocator thrash.
    """
    ran = ran_points(points)
    if not ran:
        if stopped == "time_budget":
            return "The time budget ran out before any batch size finished a trial."
        return f"No batch ran: even batch {first_oom:,} ran out of memory." if first_oom is not None else "No batch ran."
    zone_text = ""
    if zone is not None:
        retried = [p.batch_size for p in ran if p.alloc_retries and p.batch_size in zone]
        why = "the allocator retried (cudaFree and cudaMalloc) every step" if retried else "samples/s fell"
        zone_text = f" Batches from {zone.start:,} up are in the thrash zone: {why}."
        if on_host:
            zone_text = (
                f" Batches from {zone.start:,} up ran slower (samples/s fell more than 5% below the best): "
                f"on the CPU that is no memory thrash but the cores' limit (the thread pool shares them "
                f"with other processes; larger batches outgrow the caches)."
            )
    if recommended is None and on_host:
        return f"Every batch that ran was slower than a smaller one, so none is recommended.{zone_text}"
    if recommended is None:
        return (
            f"Every batch that ran is in the thrash zone, so none is recommended; try smaller "
            f"batches or PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.{zone_text}"
        )
    best = max(outside_zone(ran, zone), key=lambda p: p.samples_per_s)  # type: ignore[arg-type,return-value]
    rec = next(p for p in ran if p.batch_size == recommended)
    pct = f"{knee_within:.0%}"
    if recommended == best.batch_size:
        text = f"Batch {recommended:,} gave the most samples/s ({rec.samples_per_s:,.0f})"
        if recommended == max_fit and len(ran) > 1:
            text += ", and samples/s was still rising at the largest batch that ran"
            if stopped == "max_batch":
                text += f" (max_batch={max_batch:,}), so a larger batch may be faster"
            elif stopped == "boundary":
                text += ", the largest that fits in memory"
        text += "."
    else:
        text = (
            f"Batch {recommended:,} gives {rec.samples_per_s:,.0f} samples/s, within {pct} of the best "
            f"({best.samples_per_s:,.0f} at batch {best.batch_size:,})"
        )
        if rec.peak_allocated_bytes is not None and best.peak_allocated_bytes:
            text += (
                f", at {format_bytes(rec.peak_allocated_bytes)} peak memory against "
                f"{format_bytes(best.peak_allocated_bytes)}"
            )
        text += "."
    if max_fit is not None and stopped == "boundary":
        text += f" The largest batch that fits is {max_fit:,}."
    elif on_host and stopped == "plateau":
        text += " The CPU has no memory limit to search: the sweep stopped where samples/s stopped growing."
    return text + zone_text
