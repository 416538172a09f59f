"""Where stepprof's own time per step goes: the training thread's boundaries against the
collector's work per record, inside the launch-bound loop and on empty steps.

For each variant, runs the step of bench/overhead.py (or an empty step) under one profiler and
reads, per step record: the training thread's time at the boundaries (``Step.overhead_ns``),
the collector's CPU time per record (its harvests' thread CPU time over the records they wrote)
and its wall time per record, and the time inside the backend's boundary call and the sync
watch.  Prints medians (µs) and writes JSON.

    python bench/cost_split.py [--steps 400] [--out cost_split.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stepprof._recorder import collector as collector_mod  # noqa: E402
from stepprof._recorder.profiler import _make_profiler  # noqa: E402
from _common import run_info  # noqa: E402
from overhead import make_workload, phased_step  # noqa: E402

VARIANTS = {
    "step": ({}, "step"),
    "full": ({}, "full"),
    "full-budget": ({"overhead_budget": 0.01}, "full"),
    "step-python": ({"boundary": "python"}, "step"),
    "empty-step": ({}, "empty"),
    "empty-step-budget": ({"overhead_budget": 0.01}, "empty"),
}


def run(name: str, kw: dict, kind: str, steps: int, tmp: str, work) -> dict:
    fwd, bwd, opt = work
    prof = _make_profiler(os.path.join(tmp, f"{name}.jsonl"), **kw)
    col = prof._collector
    hot: list[tuple[int, bool]] = []
    harvests: list[tuple[int, int, int]] = []  # (cpu ns, wall ns, records)
    build = col._build

    def spy_build(s):
        hot.append((s.overhead_ns, s.sampled != 0))
        return build(s)

    col._build = spy_build
    harvest = collector_mod.Collector.harvest

    def spy_harvest():
        n0 = len(hot)
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        harvest(col)
        if len(hot) > n0:
            harvests.append((time.thread_time_ns() - c0, time.perf_counter_ns() - w0, len(hot) - n0))

    col.harvest = spy_harvest
    parts: dict[str, list[int]] = collections.defaultdict(list)

    def one():
        if kind == "empty":
            with prof.step():
                pass
        elif kind == "step":
            with prof.step(batch_size=64):
                fwd(); bwd(); opt()
        else:
            phased_step(prof, 64, fwd, bwd, opt)

    for _ in range(20):
        one()
    torch.cuda.synchronize()
    prof.flush()
    b = prof._boundaries.backend
    for attr in ("cross", "watch_syncs", "unwatch_syncs"):
        fn = getattr(b, attr)

        def timed(*a, _fn=fn, _name=attr, **k):
            t0 = time.perf_counter_ns()
            try:
                return _fn(*a, **k)
            finally:
                parts[_name].append(time.perf_counter_ns() - t0)

        setattr(b, attr, timed)
    hot.clear()
    harvests.clear()
    t0 = time.perf_counter()
    for _ in range(steps):
        one()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps * 1e6
    prof.close()
    per_rec_cpu = [c / n for c, _, n in harvests]
    per_rec_wall = [w / n for _, w, n in harvests]
    full = [h / 1e3 for h, sampled in hot if sampled]
    light = [h / 1e3 for h, sampled in hot if not sampled]
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return {
        "step_us": wall,
        "hot_full_us": med(full),
        "hot_light_us": med(light),
        "collector_cpu_us_per_record": med(per_rec_cpu),
        "collector_wall_us_per_record": med(per_rec_wall),
        "records_per_harvest": med([n for *_, n in harvests]),
        "boundary": b.boundary,
        "per_step_calls_us": {k: sum(v) / steps / 1e3 for k, v in parts.items()},
        "calls_per_step": {k: len(v) / steps for k, v in parts.items()},
    }


def _us(ns: float | None) -> float | None:
    return None if ns is None else ns / 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--out", default="cost_split.json")
    ap.add_argument("--no-gc", action="store_true", help="turn Python's cyclic garbage collector off")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    args = ap.parse_args()
    if args.no_gc:
        import gc

        gc.disable()
    if not torch.cuda.is_available():
        print("bench/cost_split.py needs CUDA; nothing measured")
        return 0
    work = make_workload(256, 64)
    out = {**run_info("cost_split.py"), "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants.split(","):
            kw, kind = VARIANTS[name]
            out["variants"][name] = r = run(name, kw, kind, args.steps, tmp, work)
            r["collector_cpu_us_per_record"] = _us(r["collector_cpu_us_per_record"])
            r["collector_wall_us_per_record"] = _us(r["collector_wall_us_per_record"])
            calls = ", ".join(f"{k} {v:.1f}" for k, v in r["per_step_calls_us"].items())
            fmt = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
            print(f"{name:18s} step {r['step_us']:8.1f} µs | hot full {fmt(r['hot_full_us'])} light "
                  f"{fmt(r['hot_light_us'])} | collector cpu/rec {fmt(r['collector_cpu_us_per_record'])} "
                  f"wall/rec {fmt(r['collector_wall_us_per_record'])} ({fmt(r['records_per_harvest'])} rec/harvest)"
                  f" | {r['boundary']} | µs/step in: {calls}")
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
