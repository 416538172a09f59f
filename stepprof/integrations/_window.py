"""The figures a framework callback logs: medians over the steps finished since it last logged.

Step records reach a :class:`Window` as the profiler writes them (``Profiler.watch``), on
its collector thread or on the training thread.  At each of the framework's logging steps
the callback has the profiler write the steps whose CUDA events have completed, then
drains the window: it holds the steps finished by then, which lag the training loop by a
step or two on a GPU (never a wait).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from .._rules import left_out
from .._stats import median

#: The prefix of every logged name (``stepprof/gpu_ms``).
PREFIX = "stepprof/"
#: Records a window keeps between two drains (the oldest go first).
WINDOW_CAP = 4096
#: Per-step figures logged as their median over the window (``tflops_per_s`` and the MFUs
#: only when FLOPs are counted: a figure no step had is left out).
_MEDIANS = ("gpu_ms", "wall_ms", "gpu_busy", "samples_per_s", "tokens_per_s", "data_wait_ms", "syncs", "energy_j",
            "tflops_per_s", "mfu", "mfu_datasheet")
#: Per-step figures logged as their highest over the window (memory: the window's worst).
_MAXIMA = ("peak_allocated_bytes", "reserved_bytes", "host_rss_bytes")
#: Per-phase figures logged as their median (``stepprof/phases/forward/gpu_ms``).
_PHASE_MEDIANS = ("gpu_ms", "wall_ms")


class Window:
    """Step records since the last :meth:`drain`, kept light and bounded."""

    def __init__(self, cap: int = WINDOW_CAP) -> None:
        self._records: deque[dict[str, Any]] = deque(maxlen=cap)
        self._lock = threading.Lock()

    def __call__(self, record: dict[str, Any]) -> None:
        """Take one finished step record (the collector thread)."""
        if record.get("kind") != "step" or left_out(record) is not None:
            return  # not a timed step: left out of the run's figures too (stepprof._rules)
        kept = {k: record.get(k) for k in (*_MEDIANS, *_MAXIMA, "step")}
        allocator = record.get("allocator")
        if isinstance(allocator, dict):
            kept["alloc_retries"] = allocator.get("num_alloc_retries")
        phases = record.get("phases")
        if phases:
            kept["phases"] = {n: {k: p.get(k) for k in _PHASE_MEDIANS} for n, p in phases.items()}
        with self._lock:
            self._records.append(kept)

    def drain(self) -> list[dict[str, Any]]:
        """The records since the last drain, oldest first; the window is then empty."""
        with self._lock:
            records = list(self._records)
            self._records.clear()
        return records


def figures(records: list[dict[str, Any]]) -> dict[str, float | int]:
    """The logged names and values of a drained window: each per-step figure's median over the
    steps that have it (MFU and TFLOP/s when FLOPs are counted), the highest peak, reserved and
    host RSS bytes, ``stepprof/alloc_retries`` (the cudaMalloc retries in these steps),
    each phase's median times, and ``stepprof/steps`` (an int: the steps the window held).
    A figure no step had is left out."""
    out: dict[str, float | int] = {}
    if not records:
        return out
    out[PREFIX + "steps"] = len(records)
    for key in _MEDIANS:
        values = [float(v) for r in records if isinstance(v := r.get(key), (int, float))]
        if values:
            out[PREFIX + key] = median(values)
    for key in _MAXIMA:
        ints = [v for r in records if type(v := r.get(key)) is int]
        if ints:
            out[PREFIX + key] = max(ints)
    retries = [v for r in records if type(v := r.get("alloc_retries")) is int]
    if retries:
        out[PREFIX + "alloc_retries"] = sum(retries)
    names: dict[str, None] = {}
    for r in records:
        names.update(dict.fromkeys(r.get("phases") or ()))
    for name in names:
        for key in _PHASE_MEDIANS:
            values = [
                float(v) for r in records
                if isinstance(v := ((r.get("phases") or {}).get(name) or {}).get(key), (int, float))
            ]
            if values:
                out[f"{PREFIX}phases/{name}/{key}"] = median(values)
    return out


def named(figs: dict[str, float | int], sep: str) -> dict[str, float | int]:
    """``figs`` with a logger's group separator between the parts of each name
    (``stepprof.phases.forward.gpu_ms`` for ``"."``; a phase's own ``/``, for nested ones, stays)."""
    out: dict[str, float | int] = {}
    for name, value in figs.items():
        rest = name[len(PREFIX):]
        if rest.startswith("phases/"):
            phase, _, figure = rest[len("phases/"):].rpartition("/")
            out[sep.join(("stepprof", "phases", phase, figure))] = value
        else:
            out["stepprof" + sep + rest] = value
    return out
