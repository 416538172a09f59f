"""What the bench scripts share: the per-call timer and the header of each JSON result."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch


def per_call_us(fn: Callable[[], Any], n: int = 2000, rounds: int = 7, warmup: int = 200) -> dict:
    """Median, min and max over ``rounds`` of the mean host µs per call of ``fn`` (``n`` calls)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter_ns() - t0) / n / 1e3)
    return {"median_us": statistics.median(samples), "min_us": min(samples), "max_us": max(samples)}


def timed_round(fn: Callable[[], Any], k: int, sync: Callable[[], Any],
                settle: Callable[[], Any] | None = None,
                wait: Callable[[], Any] | None = None) -> tuple[float, float]:
    """Wall and process-CPU µs per call of ``k`` calls of ``fn``, between two ``sync()``.

    ``settle`` runs after the closing ``sync()`` and inside the timing: it finishes the work
    the round's calls left behind (a stepprof profiler's ``flush``: the records its
    collector thread has not written yet), so that each round pays for its own ``k`` steps
    and none of that work runs during the next variant's round.  ``wait`` runs before it and
    outside the timing (wall and CPU): waiting for something that comes by the clock, not
    by the work (the energy sample a profiler's held records wait for).
    """
    sync()
    c0 = time.process_time()
    t0 = time.perf_counter()
    for _ in range(k):
        fn()
    sync()
    paused_s = paused_cpu_s = 0.0
    if wait is not None:
        w0, wc0 = time.perf_counter(), time.process_time()
        wait()
        paused_s, paused_cpu_s = time.perf_counter() - w0, time.process_time() - wc0
    if settle is not None:
        settle()
    t1 = time.perf_counter() - paused_s
    c1 = time.process_time() - paused_cpu_s
    return (t1 - t0) / k * 1e6, (c1 - c0) / k * 1e6


def run_info(script: str, gpu: str | None = None) -> dict[str, Any]:
    """Date, GPU, torch and Python versions, and the command line: the header of a result."""
    return {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": gpu if gpu is not None else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "command": f"python bench/{script} " + " ".join(sys.argv[1:]),
    }
