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


def run_info(script: str, gpu: str | None = None) -> dict[str, Any]:
    """Date, GPU, torch and Python versions, and the command line: the header of a result."""
    return {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": gpu if gpu is not None else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "command": f"python bench/{script} " + " ".join(sys.argv[1:]),
    }
