"""µs of the calling thread's CPU a call of each compiled-boundary crossing, of a phase scope's
enter and exit inside an open step (a step with 8 runs of a phase, less one without: the harvest the
training thread takes over included), and of the near-empty step's own kernel launch, on CUDA.

Each row is the median over 5 repeats of N calls (thread CPU clock), after 200 calls to warm up;
the GPU is drained between repeats.  What a phase costs the training thread, split into its parts.

    python bench/crossings.py [--calls 20000] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stepprof  # noqa: E402
from stepprof._device import compiled  # noqa: E402
from stepprof._device.backend import MARK, POP, PUSH, READ, RESET  # noqa: E402
from _common import run_info  # noqa: E402


def per_call_us(fn: Callable[[], object], n: int) -> float:
    """Median µs of thread CPU a call of ``fn``."""
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(5):
        t0 = time.thread_time_ns()
        for _ in range(n):
            fn()
        out.append((time.thread_time_ns() - t0) / n / 1e3)
        torch.cuda.synchronize()
    return statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/crossings.py needs CUDA; nothing measured")
        return 0
    m, why = compiled.load()
    if m is None:
        print(f"bench/crossings.py needs the compiled boundary ({why}): run `stepprof build`")
        return 0
    dev = torch.cuda.current_device()
    x = torch.zeros(16, device="cuda")
    a, b = m.event_create(dev), m.event_create(dev)
    m.boundary(dev, b, MARK, None)
    torch.cuda.synchronize()
    n = args.calls
    rows = {
        "x.add_(1) (the near-empty step's kernel)": lambda: x.add_(1.0),
        "boundary: event record (MARK)": lambda: m.boundary(dev, a, MARK, None),
        "boundary: NVTX push, then pop (2 calls)": lambda: (m.boundary(dev, 0, PUSH, "a"), m.boundary(dev, 0, POP, None)),
        "boundary: allocator read (READ)": lambda: m.boundary(dev, 0, READ, None),
        "boundary: peak reset (RESET)": lambda: m.boundary(dev, 0, RESET, None),
        "event_query": lambda: m.event_query(a),
        "event_elapsed_ms": lambda: m.event_elapsed_ms(a, b),
        "read_marks, 1 pair": lambda: m.read_marks((a, b)),
        "read_marks, 4 pairs": lambda: m.read_marks((a, b) * 4),
    }
    out = {name: per_call_us(fn, n) for name, fn in rows.items()}
    with tempfile.TemporaryDirectory(prefix="stepprof-crossings-") as tmp:
        prof = stepprof.Profiler(os.path.join(tmp, "run.jsonl"))
        with prof.step():
            x.add_(1.0)
        measure = prof.measure

        def step_with(runs: int) -> Callable[[], None]:
            def one() -> None:
                with prof.step():
                    for _ in range(runs):
                        with measure("a"):
                            pass
            return one

        steps = n // 8  # a phase's enter and exit: a step with 8 runs of it, less one without
        with8, with0 = per_call_us(step_with(8), steps), per_call_us(step_with(0), steps)
        out["phase scope enter+exit, in an open step"] = (with8 - with0) / 8
        prof.close()
    m.event_destroy(a)
    m.event_destroy(b)
    info = run_info("crossings.py")
    print(f"crossings on {info['gpu']}, torch {info['torch']}: µs of thread CPU a call, median of 5 x {n}")
    for name, us in out.items():
        print(f"  {name:44s} {us:7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**info, "calls": n, "us": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
