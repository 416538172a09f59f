"""stepprof's floor: the CPU it spends per step on a near-empty step, all threads counted.

The step is one tiny kernel on CUDA (an in-place add on 16 floats), nothing on the CPU.  Each
variant is a whole run as a user pays it: ``Profiler`` construction, ``--steps`` steps, and
``close()`` (which writes every record and the summary), timed with the process's CPU clock
(every thread: the training thread and the collector's), between two synchronisations.  Every
round runs the bare loop and each variant once, in a shuffled order; a variant's figure for a
round is its CPU time less the bare loop's of that round, over the steps.  The table gives the
median over rounds and the range (min-max).

Two more columns split it: the part spent in ``close()``, which writes the records still
waiting (each waits for the energy sample after it, every 0.5 s; it is built once its events
have completed); and the training thread's own CPU in the loop, less the bare loop's (its
boundaries, and any harvest it took over).  ``--steps`` past ``energy_every_s`` of steps (the
default 3,000 near-empty steps take less) shows a long run's steady state.

Variants:
  step        ``prof.step(batch_size=8)``, the default settings;
  3 phases    the same with three ``prof.measure`` phases inside, the step's one kernel in the
              first (the bare loop's work: each phase with a kernel of its own would add two
              launches, 12 µs on an H100's host, that are not stepprof's);
  python      ``step`` with ``boundary="python"``: the Python boundaries, without the step core
              (and on CUDA without the compiled device boundary), as where nothing could be built;
  no log      ``step`` with ``log=None`` (what writing the lines costs, by difference).

With ``--long-steps N`` every round also runs each variant (and the bare loop) for N steps,
and a further table splits each variant's figure into what one more step adds (the slope between
the two lengths: a long run's steady cost) and what is left once a run (construction, the
threads' start, the last records and the summary at close).

    python bench/floor.py [--steps 3000] [--rounds 7] [--device auto|cpu|cuda] [--long-steps N] [--json PATH]
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
from collections.abc import Callable, Sequence
from typing import Any

import torch

# STEPPROF_BENCH_TREE: another tree's stepprof (bench/floor_ab.py's base) under this loop.
sys.path.insert(0, os.environ.get("STEPPROF_BENCH_TREE") or os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when a test imports this file
import stepprof  # noqa: E402
from _common import run_info  # noqa: E402

PHASES = ("forward", "backward", "optimizer")


def variants(cuda: bool) -> dict[str, tuple[dict, tuple[str, ...], bool]]:
    """name -> (Profiler settings, phase names, whether it writes a log)."""
    return {
        "step": ({}, (), True),
        "3 phases": ({}, PHASES, True),
        "no log": ({}, (), False),
        "python": ({"boundary": "python"}, (), True),
    }


def near_empty_step(cuda: bool) -> tuple[Callable[[], None], Callable[[], None]]:
    """(the step's work, the synchronisation at a run's ends): one in-place add on 16 floats on
    CUDA; nothing on the CPU."""
    if cuda:
        x = torch.zeros(16, device="cuda")
        return (lambda: x.add_(1.0)), torch.cuda.synchronize
    return (lambda: None), (lambda: None)


def run_steps(prof: Any, steps: int, phases: Sequence[str], work: Callable[[], None]) -> None:
    """``steps`` steps of ``work``, bare or in ``phases``: the step's one ``work`` in the first
    phase, the others empty, so that every variant's step launches what the bare loop's does."""
    step, measure = prof.step, prof.measure
    if phases:
        first, rest = phases[0], phases[1:]
        for _ in range(steps):
            with step(batch_size=8):
                with measure(first):
                    work()
                for name in rest:
                    with measure(name):
                        pass
    else:
        for _ in range(steps):
            with step(batch_size=8):
                work()


def run_once(steps: int, work: Callable[[], None], sync: Callable[[], None], settings: dict | None,
             phases: tuple[str, ...], log: str | None, device: str) -> tuple[float, float, float]:
    """Process CPU seconds of one whole run (``settings`` None: the bare loop), of its
    ``close()`` (which writes the records still held: most of a short run's), and the training
    thread's own CPU seconds in the loop (the boundaries, and any harvest it takes over)."""
    sync()
    c_close = 0.0
    c0 = time.process_time()
    t0 = time.thread_time()
    if settings is None:
        for _ in range(steps):
            work()
        sync()
        t_loop = time.thread_time() - t0
    else:
        prof = stepprof.Profiler(log, device=device, **settings)
        run_steps(prof, steps, phases, work)
        sync()
        t_loop = time.thread_time() - t0
        c1 = time.process_time()
        prof.close()
        c_close = time.process_time() - c1
    sync()
    return time.process_time() - c0, c_close, t_loop


def run_round(steps: int, order: list[str], table: dict, tmp: str, work: Callable[[], None],
              sync: Callable[[], None], device: str) -> dict[str, tuple[float, float, float]]:
    """One round: each variant (and ``"bare"``, the bare loop) run for ``steps`` steps, in
    ``order``; name -> :func:`run_once`'s figures."""
    out: dict[str, tuple[float, float, float]] = {}
    for name in order:
        if name == "bare":
            out[name] = run_once(steps, work, sync, None, (), None, device)
            continue
        settings, phases, logged = table[name]
        log = os.path.join(tmp, f"{name.replace(' ', '_')}.jsonl") if logged else None
        out[name] = run_once(steps, work, sync, settings, phases, log, device)
        if log is not None:
            os.remove(log)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--long-steps", type=int, default=0,
                    help="also runs of this many steps: each figure split into per step and per run")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the results here (bench/results/...)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    device = "cuda" if cuda else "cpu"
    work, sync = near_empty_step(cuda)
    table = variants(cuda)
    rng = random.Random(args.seed)
    per_step: dict[str, list[float]] = {name: [] for name in table}
    close_us: dict[str, list[float]] = {name: [] for name in table}
    main_us: dict[str, list[float]] = {name: [] for name in table}
    bare_us: list[float] = []
    slopes: dict[str, list[tuple[float, float]]] = {name: [] for name in table}  # (µs a step, ms a run)
    with tempfile.TemporaryDirectory(prefix="stepprof-floor-") as tmp:
        # Warm-up: imports, the backend, the first compile of anything lazy.
        for name, (settings, phases, logged) in table.items():
            run_once(200, work, sync, settings, phases, os.path.join(tmp, "warm.jsonl") if logged else None, device)
        for _ in range(args.rounds):
            order = ["bare", *table]
            rng.shuffle(order)
            runs = run_round(args.steps, order, table, tmp, work, sync, device)
            cpu = {name: run[0] for name, run in runs.items()}
            closing = {name: run[1] for name, run in runs.items()}
            training = {name: run[2] for name, run in runs.items()}
            if args.long_steps > args.steps:  # the same order again, at the long length: each variant's slope
                long_cpu = {name: run[0] for name, run in
                            run_round(args.long_steps, order, table, tmp, work, sync, device).items()}
                for name in table:
                    short, long_ = cpu[name] - cpu["bare"], long_cpu[name] - long_cpu["bare"]
                    slope = (long_ - short) / (args.long_steps - args.steps)
                    slopes[name].append((slope * 1e6, (short - slope * args.steps) * 1e3))
            bare_us.append(cpu["bare"] / args.steps * 1e6)
            for name in table:
                per_step[name].append((cpu[name] - cpu["bare"]) / args.steps * 1e6)
                close_us[name].append(closing[name] / args.steps * 1e6)
                main_us[name].append((training[name] - training["bare"]) / args.steps * 1e6)
    gpu = torch.cuda.get_device_name() if cuda else "none (CPU)"
    print(f"stepprof floor on {gpu}: {args.steps} steps a run, {args.rounds} rounds, construction and "
          f"close included, process CPU (all threads) less the bare loop's")
    print(f"  bare loop: {statistics.median(bare_us):.2f} µs/step")
    print(f"  {'variant':10s} {'µs/step median':>15s} {'min':>8s} {'max':>8s} {'of it in close()':>17s} "
          f"{'training thread':>16s}")
    results = {}
    for name, xs in per_step.items():
        med = statistics.median(xs)
        closed = statistics.median(close_us[name])
        main = statistics.median(main_us[name])
        results[name] = {"median_us": med, "min_us": min(xs), "max_us": max(xs), "rounds_us": xs,
                         "close_median_us": closed, "close_rounds_us": close_us[name],
                         "training_median_us": main, "training_rounds_us": main_us[name]}
        print(f"  {name:10s} {med:15.1f} {min(xs):8.1f} {max(xs):8.1f} {closed:17.1f} {main:16.1f}")
    if args.long_steps > args.steps:
        print(f"  split, between {args.steps} and {args.long_steps} steps: what a step adds (µs) and what a run "
              f"costs once (ms), medians (min-max)")
        for name, pairs in slopes.items():
            step_us, run_ms = [p[0] for p in pairs], [p[1] for p in pairs]
            results[name].update(per_step_us=statistics.median(step_us), per_step_rounds_us=step_us,
                                 per_run_ms=statistics.median(run_ms), per_run_rounds_ms=run_ms)
            print(f"  {name:10s} {statistics.median(step_us):8.1f} µs a step ({min(step_us):.1f}-{max(step_us):.1f})"
                  f" {statistics.median(run_ms):8.1f} ms a run ({min(run_ms):.1f}-{max(run_ms):.1f})")
    if args.json:
        out = {**run_info("floor.py", gpu=gpu), "steps": args.steps, "rounds": args.rounds,
               "long_steps": args.long_steps or None,
               "device": device, "bare_us_per_step": bare_us, "variants": results}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
