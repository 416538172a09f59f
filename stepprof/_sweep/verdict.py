"""The :class:`SweepResult` of a finished search: the knee, the boundary, the fit's
prediction, the recommendation and the notes, from the points and how the search ended."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from .result import SweepPoint, SweepResult
from .rules import explain_recommendation, find_knee, find_recommended, find_thrash_zone, memory_fit

__all__ = ["build_result"]


def build_result(
    points: Sequence[SweepPoint],
    fits: Mapping[int, SweepPoint],
    ooms: Mapping[int, SweepPoint],
    *,
    stopped: str,
    device: str,
    capacity: int | None,
    memory_reason: str | None,
    unavailable: Mapping[str, str],
    notes: Sequence[str],
    knee_within: float,
    max_batch: int | None,
    wall_s: float,
) -> SweepResult:
    """The result of a search that measured ``points`` (``fits`` and ``ooms`` by batch size).

    Args:
        stopped: how the search ended (``"boundary"``, ``"plateau"``, ``"time_budget"``...).
        device: the device the trials ran on (``"cpu"`` for the host).
        capacity: the bytes the allocator can hold, or None.
        memory_reason: why the device has no memory figures, or None.
        unavailable: the sweep's missing figures and why.
        notes: the search's notes so far.
    """
    ordered = tuple(sorted(points, key=lambda p: p.batch_size))
    zone = find_thrash_zone(ordered)
    recommended = find_recommended(ordered, zone, knee_within)
    max_fit = max(fits) if fits else None
    first_oom = min(ooms) if ooms else None
    fit = memory_fit(fits)
    predicted = None
    missing = dict(unavailable)
    if fit is not None and capacity is not None:
        predicted = max(0, math.floor((capacity - fit[0]) / fit[1]))
    elif fit is None:
        missing["predicted_max"] = (
            memory_reason if memory_reason else "fewer than two batches ran with a peak that grew with the batch"
        )
    else:
        missing["predicted_max"] = "the allocator's capacity could not be read"
    reason = explain_recommendation(
        ordered, zone, recommended, max_fit=max_fit, first_oom=first_oom, stopped=stopped,
        knee_within=knee_within, max_batch=max_batch, on_host=device == "cpu",
    )
    return SweepResult(
        points=ordered, knee=find_knee(ordered, knee_within), max_fit=max_fit, first_oom=first_oom,
        predicted_max=predicted, thrash_zone=zone, recommended=recommended, reason=reason,
        stopped=stopped, device=device, trials=len(ordered), wall_s=wall_s, capacity_bytes=capacity,
        fit_base_bytes=None if fit is None else fit[0],
        fit_bytes_per_sample=None if fit is None else fit[1],
        knee_within=knee_within, notes=_closing_notes(notes, stopped, max_fit, first_oom), unavailable=missing,
    )


def _closing_notes(notes: Sequence[str], stopped: str, max_fit: int | None, first_oom: int | None) -> tuple[str, ...]:
    """``notes`` and, where the search stopped short, a note on what it left unsearched."""
    out = list(notes)
    if stopped == "plateau":
        out.append(
            "growth stopped at a plateau and there are no memory figures to predict the boundary, "
            "so the largest batch that fits was not searched; pass max_batch to sweep further"
        )
    elif stopped in ("time_budget", "probe_limit") and max_fit is not None:
        out.append(
            f"the search stopped ({stopped}) before max_fit was bracketed within 3%"
            + (f": the bracket is {max_fit:,} (ran) to {first_oom:,} (out of memory)" if first_oom else "")
        )
    return tuple(out)
