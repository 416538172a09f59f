"""The collector's CPU a record: the C harvest (``_fold.c``'s ``harvest_steps``) against the
Python harvest, on the same kind of steps.

Each run makes a profiler whose collector thread never wakes, runs ``--pending`` near-empty
steps (bench/floor.py's: one tiny kernel on CUDA, nothing on the CPU), waits for their events,
and times one harvest of them all with the thread's CPU clock (``time.thread_time_ns``): reading
the events, building the records, the hooks, the summary's fold, encoding and writing the lines.
Every round runs both ways in a shuffled order; the table gives the median over rounds of µs a
record, its range, and the median of the per-round ratio (C over Python).

    python bench/harvest.py [--pending 300] [--phases 0,3] [--rounds 15] [--device auto|cpu|cuda] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import random
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
from floor import PHASES, near_empty_step, run_steps  # noqa: E402


def harvest_us(pending: int, phases: int, device: str, c_loop: bool, tmp: str) -> float:
    """µs of the harvesting thread's CPU a record, for one harvest of ``pending`` steps."""
    native = collector_mod._NATIVE
    fast = native.harvest
    native.harvest = fast if c_loop else None
    work, sync = near_empty_step(device == "cuda")
    names = PHASES[:phases]
    try:
        prof = _make_profiler(os.path.join(tmp, f"run-{c_loop}.jsonl"), device=device, collect_every_s=3600.0)
        col = prof._collector
        col.harvest_at = 2**62  # (the training thread never takes a harvest over)
        with prof.step():  # the first step chooses the backend
            work()
        run_steps(prof, pending, names, work)
        sync()
        with col.lock:
            n = len(col.pending)
            t0 = time.thread_time_ns()
            col.harvest()
            ns = time.thread_time_ns() - t0
            assert not col.pending, "a step was not written"
        prof.close()
    finally:
        native.harvest = fast
    return ns / n / 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pending", type=int, default=300)
    ap.add_argument("--phases", default="0,3")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if collector_mod._NATIVE.harvest is None:
        print("stepprof's C module is not built here (`python -m stepprof build`): nothing to compare")
        return 1
    info = run_info("harvest.py", gpu=None if device == "cuda" else "cpu")
    print(f"the collector's CPU a record on {info['gpu']}, torch {info['torch']}: one harvest of "
          f"{args.pending} steps, {args.rounds} interleaved rounds")
    print(f"  {'phases':>6}  {'C µs':>6} {'range':>11}  {'Python µs':>9} {'range':>11}  {'C/Python':>8} {'range':>11}")
    out = []
    with tempfile.TemporaryDirectory(prefix="stepprof-harvest-") as tmp:
        for phases in (int(p) for p in args.phases.split(",")):
            got: dict[bool, list[float]] = {True: [], False: []}
            ratios = []
            for _ in range(args.rounds):
                this = {}
                for c_loop in random.sample([True, False], 2):
                    this[c_loop] = harvest_us(args.pending, phases, device, c_loop, tmp)
                    got[c_loop].append(this[c_loop])
                ratios.append(this[True] / this[False])
            c, py = got[True], got[False]
            print(f"  {phases:>6}  {statistics.median(c):6.2f} {min(c):5.2f}-{max(c):5.2f}  "
                  f"{statistics.median(py):9.2f} {min(py):5.2f}-{max(py):5.2f}  "
                  f"{statistics.median(ratios):8.3f} {min(ratios):5.3f}-{max(ratios):5.3f}")
            out.append({"phases": phases, "c_us": c, "python_us": py, "ratios": ratios})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**info, "pending": args.pending, "rounds": args.rounds, "device": device, "results": out}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
