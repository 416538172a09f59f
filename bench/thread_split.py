"""Which thread pays stepprof's floor: each thread's CPU a step on the near-empty step.

The step is bench/floor.py's (one tiny kernel on CUDA, nothing on the CPU).  For each variant,
a whole run (construction, ``--steps`` steps, close) is timed per thread: the training thread's
CPU in the loop (its boundaries, and the harvests it takes over), the collector thread's and the
energy sampler's (read from /proc before close), and the CPU ``close()`` takes.  Every round
runs the bare loop and each variant in a shuffled order; the table gives medians over rounds,
and "added" is the total less the bare loop's.  Linux only (/proc/self/task).

    python bench/thread_split.py [--steps 30000] [--rounds 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stepprof  # noqa: E402
from _common import run_info  # noqa: E402
from floor import PHASES, run_steps  # noqa: E402 - floor.py's loop: the kernel in the first phase
VARIANTS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "step": ({}, ()),
    "step, no energy": ({"energy_every_s": None}, ()),
    "3 phases": ({}, PHASES),
    "3 phases, no energy": ({"energy_every_s": None}, PHASES),
    "step, no energy or syncs": ({"energy_every_s": None, "syncs": "off"}, ()),
}
COLUMNS = ("training", "stepprof-collector", "stepprof-energy", "close", "total")


def _thread_cpu_ns(tid: int) -> int:
    """A thread's CPU time so far (0 once it has ended)."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[0])
    except OSError:
        return 0


def one_run(path: str, settings: dict[str, Any], phases: tuple[str, ...], steps: int, x: torch.Tensor,
            cuda: bool) -> dict[str, float]:
    """µs of CPU a step, by thread, of one whole run."""
    t0, m0 = time.process_time_ns(), time.thread_time_ns()
    prof = stepprof.Profiler(path, **settings)
    run_steps(prof, steps, phases, lambda: x.add_(1.0))
    if cuda:
        torch.cuda.synchronize()
    m1 = time.thread_time_ns()
    threads = {t.name: _thread_cpu_ns(t.native_id) for t in threading.enumerate()
               if t.name.startswith("stepprof") and t.native_id is not None}
    c0 = time.process_time_ns()
    prof.close()
    t1 = time.process_time_ns()
    out = {"training": (m1 - m0) / steps / 1e3, "close": (t1 - c0) / steps / 1e3, "total": (t1 - t0) / steps / 1e3}
    out.update((name, ns / steps / 1e3) for name, ns in threads.items() if name in COLUMNS)
    return out


def bare(steps: int, x: torch.Tensor, cuda: bool) -> float:
    t0 = time.process_time_ns()
    for _ in range(steps):
        x.add_(1.0)
    if cuda:
        torch.cuda.synchronize()
    return (time.process_time_ns() - t0) / steps / 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    x = torch.zeros(16, device="cuda" if cuda else "cpu")
    rng = random.Random(0)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    bares: list[float] = []
    with tempfile.TemporaryDirectory(prefix="stepprof-threads-") as tmp:
        path = os.path.join(tmp, "run.jsonl")
        for settings, phases in VARIANTS.values():  # warm-up
            one_run(path, settings, phases, 500, x, cuda)
        for _ in range(args.rounds):
            order = list(VARIANTS)
            rng.shuffle(order)
            bares.append(bare(args.steps, x, cuda))
            for name in order:
                results[name].append(one_run(path, *VARIANTS[name], args.steps, x, cuda))
    base = statistics.median(bares)
    info = run_info("thread_split.py", None if cuda else "none (CPU)")
    print(f"thread split on {info['gpu']}, torch {info['torch']}: {args.rounds} rounds of "
          f"{args.steps} steps, bare loop {base:.2f} µs a step; medians, µs of CPU a step")
    print(f"  {'variant':26s}" + "".join(f"{c.replace('stepprof-', ''):>11s}" for c in COLUMNS) + "      added")
    table = {}
    for name, runs in results.items():
        med = {c: statistics.median(r.get(c, 0.0) for r in runs) for c in COLUMNS}
        table[name] = {**med, "added": med["total"] - base}
        print(f"  {name:26s}" + "".join(f"{med[c]:11.2f}" for c in COLUMNS) + f"{med['total'] - base:11.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**info, "steps": args.steps, "rounds": args.rounds, "bare_us": base, "us": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
