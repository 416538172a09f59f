"""``stepprof calibrate``: this GPU's achieved rates, for MFU and the roofline.

Timed by the project's measurement rules (docs/measurement.md): random (non-zero)
operands, warm-up first, CUDA events around a run of back-to-back calls long
enough (about 40 ms) that launch cost and event resolution do not matter, several
runs, the median of the runs.  :func:`stepprof._roofline.save_calibration` stores
the result.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from .._stats import median

__all__ = ["calibrate"]


def _timed_ms(fn: Callable[..., Any], *, target_ms: float, runs: int) -> float:
    """Median device ms of one ``fn()`` call, over ``runs`` runs of back-to-back calls."""
    fn()  # warm-up: cuBLAS heuristics, workspace allocation
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    once = max(start.elapsed_time(end), 1e-3)
    reps = max(1, min(200, int(target_ms / once)))
    per_call = []
    for _ in range(runs):
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / reps)
    return median(per_call)


def calibrate(
    index: int = 0, *, runs: int = 5, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Measure this GPU's achieved dense matmul TFLOP/s (bf16, tf32, fp32), copy GB/s and
    the host µs of one small operation.  Takes a few seconds; restores torch's settings.

    Matmul: ``torch.mm`` of random n×n operands into a preallocated output, n in
    (8192, 16384) (fp32: 8192); the rate is ``2n³ / time``, the best size's median.
    Copy: ``dst.copy_(src)`` of 1 GiB, counting the bytes read and written.
    Host cost: the host time of 2000 in-place adds on a 256-element tensor (the
    queue is kept short, so the host, not the GPU, sets the pace).
    """
    say = progress or (lambda _msg: None)
    dev = torch.device("cuda", index)
    precision = torch.get_float32_matmul_precision()
    gen = torch.Generator(device=dev).manual_seed(0)
    result: dict[str, Any] = {}
    tflops: dict[str, float] = {}
    shapes: dict[str, int] = {}
    try:
        with torch.cuda.device(index):
            for key, dtype, sizes, mode in (
                ("bf16", torch.bfloat16, (8192, 16384), None),
                ("tf32", torch.float32, (8192, 16384), "high"),
                ("fp32", torch.float32, (8192,), "highest"),
            ):
                say(f"matmul {key}")
                if mode is not None:
                    torch.set_float32_matmul_precision(mode)
                best = 0.0
                for n in sizes:
                    a = torch.randn(n, n, device=dev, dtype=dtype, generator=gen)
                    b = torch.randn(n, n, device=dev, dtype=dtype, generator=gen)
                    c = torch.empty(n, n, device=dev, dtype=dtype)
                    ms = _timed_ms(lambda a=a, b=b, c=c: torch.mm(a, b, out=c), target_ms=40, runs=runs)
                    rate = 2 * n**3 / (ms * 1e-3) / 1e12
                    if rate > best:
                        best, shapes[key] = rate, n
                    del a, b, c
                tflops[key] = best
                torch.set_float32_matmul_precision(precision)
            say("copy bandwidth")
            nbytes = 2**30
            src = torch.randn(nbytes // 4, device=dev, generator=gen)
            dst = torch.empty_like(src)
            ms = _timed_ms(lambda src=src, dst=dst: dst.copy_(src), target_ms=40, runs=runs)
            copy_gbps = 2 * nbytes / (ms * 1e-3) / 1e9
            del src, dst
            say("host cost of one operation")
            x = torch.ones(256, device=dev)
            launches = []
            for _ in range(runs):
                torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                for _ in range(2000):
                    x.add_(1.0)
                launches.append((time.perf_counter() - t0) / 2000 * 1e6)
            torch.cuda.synchronize(dev)
            del x
            props = torch.cuda.get_device_properties(index)
            result = {
                "device_name": torch.cuda.get_device_name(index),
                "matmul_tflops": tflops,
                "matmul_n": shapes,
                "copy_gbps": copy_gbps,
                "launch_us": median(launches),
                "runs": runs,
                "multiprocessors": getattr(props, "multi_processor_count", None),
                "total_memory_bytes": getattr(props, "total_memory", None),
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "measured_unix_s": time.time(),
            }
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.cuda.empty_cache()
    return result
