"""Where stepprof's per-step host time goes, inside a real training loop.

Wraps each backend method and the collector's harvest with timers, runs the launch-bound
step (8 x 256 bf16 MLP, batch 64, AdamW) under the full instrumentation
(step + three phases), and prints the mean µs per step spent in each (total / steps).
Each row is its own time: a timed call inside another (a backend read-back inside the
harvest) counts in its own row, not its caller's.  With the compiled boundary the
boundaries do not call the backend, so only the harvest's rows show.

    python bench/boundary_costs.py [--steps 300] [--log-dir DIR] [--out costs.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from stepprof._recorder.collector import Collector  # noqa: E402
from stepprof._device.cuda import CudaBackend  # noqa: E402
from stepprof._recorder.profiler import _make_profiler  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import make_workload, phased_step  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--out", default="boundary_costs.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 0
    fwd, bwd, opt = make_workload(256, 64)
    for _ in range(10):
        fwd(); bwd(); opt()
    torch.cuda.synchronize()

    spent: dict[str, int] = collections.defaultdict(int)
    calls: dict[str, int] = collections.defaultdict(int)
    backend = CudaBackend(torch.cuda.current_device())

    inner: list[int] = []  # per open timed call: the time of the timed calls inside it

    def timed(name, fn):
        def wrapper(*a, **k):
            inner.append(0)
            t0 = time.perf_counter_ns()
            try:
                return fn(*a, **k)
            finally:
                took = time.perf_counter_ns() - t0
                spent[name] += took - inner.pop()
                calls[name] += 1
                if inner:
                    inner[-1] += took
        return wrapper

    for name in ("mark", "is_done", "elapsed_ms", "release", "reset_peak", "read_memory",
                 "range_push", "range_pop"):
        setattr(backend, name, timed(name, getattr(backend, name)))
    # Every step record is read back, built, encoded and written in a harvest (in C for the
    # common steps, each record's orjson included), the lines in one write() at its end.
    orig_harvest = Collector.harvest
    Collector.harvest = timed("collector harvest (read-back, build, orjson, write)", orig_harvest)

    tmp = args.log_dir or tempfile.mkdtemp()
    prof = _make_profiler(os.path.join(tmp, "costs.jsonl"), backend=backend)
    wall0 = time.perf_counter_ns()
    for _ in range(args.steps):
        phased_step(prof, 64, fwd, bwd, opt)
    torch.cuda.synchronize()
    wall = (time.perf_counter_ns() - wall0) / args.steps / 1e3
    s = prof.close()
    Collector.harvest = orig_harvest
    n = args.steps
    rows = {k: {"us_per_step": v / n / 1e3, "calls_per_step": calls[k] / n, "us_per_call": v / calls[k] / 1e3}
            for k, v in sorted(spent.items(), key=lambda kv: -kv[1])}
    total = sum(r["us_per_step"] for r in rows.values())
    w = max(map(len, [*rows, "sum of the above"]))
    print(f"{'where':{w}s} {'µs/step':>9s} {'calls':>6s} {'µs/call':>8s}")
    for k, r in rows.items():
        print(f"{k:{w}s} {r['us_per_step']:9.1f} {r['calls_per_step']:6.1f} {r['us_per_call']:8.2f}")
    print(f"{'sum of the above':{w}s} {total:9.1f}")
    print(f"overhead_us median {s.overhead_us_median:.1f}; step wall {wall:.0f} µs; log dir {tmp}")
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "overhead_us_median": s.overhead_us_median, "step_us": wall}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
