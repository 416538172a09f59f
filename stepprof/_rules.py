"""The rules every view of a log applies, written once (no torch).

Which records belong to a run, which step records are *timed* (the steps every figure is
taken over), a step's span, and what a spike is.  The summary and ``stepprof report``
(through :class:`stepprof._aggregate.RunAggregate`), ``stepprof plot``, ``stepprof export``
and the framework callbacks' windows all read them here, so that they name the same runs,
the same timed steps and the same spikes (tests/test_views_agree.py).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "COMPILED", "COUNTED", "ERROR", "EXPLAINED", "MALFORMED", "RUN_KINDS", "SPIKE_FACTOR", "WARMUP",
    "is_spike", "left_out", "number", "span_ms",
]

#: The record kinds that belong to a run (a sweep's records do not).
RUN_KINDS = frozenset(("step", "memory", "summary", "ranks", "flops", "peak"))

#: A timed step is a spike when its span is at least this many times the median span.
SPIKE_FACTOR = 3.0

#: Why a step record is not timed (:func:`left_out`), in the order the checks run.
WARMUP = "a warm-up step"
ERROR = "the step raised"
MALFORMED = "its wall_ms is not a number"
COUNTED = "its FLOPs were counted (its times include FlopCounterMode's)"
EXPLAINED = "explain_peak explained it (its times include the allocator's history)"
COMPILED = "it compiled (its times include torch.compile's work)"


def number(x: Any) -> float | int | None:
    """``x`` if it is an int or a float (not a bool), else None: a log's field may hold anything."""
    t = type(x)
    return x if t is float or t is int else None


def left_out(r: dict[str, Any]) -> str | None:
    """Why step record ``r`` is not a timed step (one of the reasons above), or None when it is."""
    get = r.get
    if get("warmup") is True:
        return WARMUP
    if get("error") is not None:
        return ERROR
    wall = get("wall_ms")
    t = type(wall)
    if t is not float and t is not int:
        return MALFORMED
    if get("flops_counted") is True:
        return COUNTED
    if get("explained") is True:
        return EXPLAINED
    if get("compiled") is True:
        return COMPILED
    return None


def span_ms(wall: float, gpu: Any) -> float:
    """A step's span: the longer of its wall time and its GPU time (when it has one)."""
    t = type(gpu)
    return gpu if (t is float or t is int) and gpu > wall else wall


def is_spike(span: float, median: float | None) -> bool:
    """Whether a timed step of this span is a spike, against the run's median span."""
    return median is not None and span >= SPIKE_FACTOR * median
