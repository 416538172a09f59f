"""The cross-rank exchange at scale, on paper: a CPU simulation of W gloo ranks, and a cost model.

Three measurements, then the model they feed:

1. **The exchange on the training thread**: W gloo processes on the CPU (default 8) each run
   ``--steps`` near-empty steps with ``ranks_every=--every`` and with ``ranks_every=0``, in
   rounds, every rank in the same order; the CPU a step each adds, median over ranks and rounds.
2. **Rank 0's ``ranks`` record**: ``stepprof._dist.ranks_record`` over W synthetic rows (what
   the ``all_gather`` brings back) at W = 8, 64, 1,024 and 16,384: the CPU it takes on rank 0's
   collector thread and its JSON line's size.
3. **The report over the rank logs**: ``stepprof report --json`` over one log of part 1 and
   over all W, each in a child process: its wall time a line (the difference, without the
   process's start) and its peak RSS.  A log's share of the RSS at 50,000 steps comes from the
   64-rank-log run of docs/benchmarks.md (122 MiB for 64 logs; ``bench/report.py --ranks 64``).

The model: per exchange, each rank sends one float64 vector (``_dist.WIDTH`` values) and
receives W of them in one ``all_gather`` (a ring all_gather takes W - 1 rounds of latency);
rank 0 builds and writes one ``ranks`` record; the report reads every rank's log.

    python bench/dist_scale.py [--world 8] [--steps 2000] [--every 10] [--rounds 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import orjson  # noqa: E402

import stepprof  # noqa: E402
from stepprof import _dist  # noqa: E402
from _common import run_info  # noqa: E402

SCALES = (8, 64, 1024, 16384)
#: A ring all_gather's latency a round, for the model: about 5 µs a hop within a node (NVLink)
#: and 10-20 µs between nodes (InfiniBand); the model takes 10 µs.
HOP_US = 10.0


def _worker(rank: int, world: int, store: str, out: str, steps: int, every: int, rounds: int,
            order: list[int]) -> None:
    """One rank: ``rounds`` rounds of a run with the exchange and one without, in ``order``."""
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    cpu: dict[str, list[float]] = {f"{n}{part}": [] for n in ("exchange", "none") for part in ("", " loop", " open", " close")}
    try:
        for which in order:  # warm-up: stepprof's lazy imports and the first exchange's set-up
            with stepprof.Profiler(os.path.join(out, f"warmup-{which}.jsonl"), ranks_every=every if which else 0,
                                   warmup=1) as prof:
                for _ in range(2 * every):
                    with prof.step():
                        pass
        for r in range(rounds):
            for which in order:
                name = "exchange" if which else "none"
                log = os.path.join(out, f"{name}-{r}.jsonl")
                dist.barrier()
                t0 = time.thread_time_ns()
                prof = stepprof.Profiler(log, ranks_every=every if which else 0, warmup=1)
                t1 = time.thread_time_ns()
                for _ in range(steps):
                    with prof.step(batch_size=8):
                        with prof.measure("forward"):
                            pass
                        with prof.measure("backward"):
                            pass
                t2 = time.thread_time_ns()
                prof.close()
                t3 = time.thread_time_ns()
                cpu[name].append((t3 - t0) / steps / 1e3)
                cpu[f"{name} loop"].append((t2 - t1) / steps / 1e3)
                cpu[f"{name} open"].append((t1 - t0) / 1e6)
                cpu[f"{name} close"].append((t3 - t2) / 1e6)
        with open(os.path.join(out, f"cpu.rank{rank}.json"), "w") as f:
            json.dump(cpu, f)
    finally:
        dist.destroy_process_group()


def simulate(world: int, steps: int, every: int, rounds: int, out: str) -> dict[str, Any]:
    """Part 1: the exchange's CPU a step on each rank, and the ranks records rank 0 wrote."""
    order = [1, 0]
    random.Random(0).shuffle(order)
    store = os.path.join(out, "store")
    mp.start_processes(_worker, args=(world, store, out, steps, every, rounds, order), nprocs=world,
                       start_method="spawn")
    added, in_loop = [], []
    for rank in range(world):
        with open(os.path.join(out, f"cpu.rank{rank}.json")) as f:
            cpu = json.load(f)
        added += [a - b for a, b in zip(cpu["exchange"], cpu["none"])]
        in_loop += [a - b for a, b in zip(cpu["exchange loop"], cpu["none loop"])]
    last = os.path.join(out, f"exchange-{rounds - 1}.jsonl")
    records = list(stepprof.read(_dist.rank_log_path(last, 0), kind="ranks"))
    sizes = [len(orjson.dumps(r)) + 1 for r in records]
    return {
        "world": world, "steps": steps, "every": every, "rounds": rounds,
        "added_us_per_step": statistics.median(added), "added_min_us": min(added), "added_max_us": max(added),
        "added_in_loop_us_per_step": statistics.median(in_loop),
        "ranks_records": len(records), "ranks_record_bytes": statistics.median(sizes) if sizes else None,
        "logs": [_dist.rank_log_path(last, k) for k in range(world)],
    }


def record_cost(world: int, reps: int) -> dict[str, float]:
    """Part 2: rank 0's ranks_record over ``world`` synthetic rows: ms of CPU, bytes of its line."""
    rng = random.Random(world)
    names = ["forward", "backward", "optimizer"]
    rows = []
    for rank in range(world):
        row = [float("nan")] * _dist.WIDTH
        row[:11] = [1.0, 10.0, 20 + rng.random(), 21 + rng.random(), 2**33 + rank, 0.0, 0.1 * rng.random(),
                    123.0, 1.0, 3.0, 1.0]
        row[11:14] = [8 + rng.random(), 10 + rng.random(), 2 + rng.random()]
        rows.append(row)
    times, size = [], 0
    for _ in range(reps):
        t0 = time.process_time_ns()
        record = _dist.ranks_record(rows, names, 100)
        line = orjson.dumps(record)
        times.append((time.process_time_ns() - t0) / 1e6)
        size = len(line) + 1
    return {"ms": statistics.median(times), "bytes": size}


def report_cost(logs: list[str]) -> dict[str, float]:
    """Part 3: ``stepprof report --json`` over the logs, in a child: wall s and peak RSS (MiB)."""
    code = ("import resource, subprocess, sys, time\n"
            "t0 = time.perf_counter()\n"
            "subprocess.run([sys.executable, '-m', 'stepprof', 'report', '--json', *sys.argv[1:]],"
            " stdout=subprocess.DEVNULL, check=True)\n"
            "print(time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n")
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    out = subprocess.run([sys.executable, "-c", code, *logs], capture_output=True, text=True, check=True, env=env)
    wall_s, rss_kib = out.stdout.split()
    lines = 0
    for path in logs:
        with open(path, "rb") as f:
            lines += sum(1 for _ in f)
    return {"wall_s": float(wall_s), "rss_mib": int(rss_kib) / 1024, "lines": lines}


#: The report's peak RSS over 64 rank logs of 50,000 steps, and over none (its base): MiB.
RSS_64_LOGS_MIB, RSS_BASE_MIB = 122.0, 25.0


def model(sim: dict[str, Any], records: dict[int, dict[str, float]], report: dict[str, float],
          steps_per_log: int) -> dict[int, dict[str, float]]:
    """The cost at each scale, from the measured constants."""
    vec = _dist.WIDTH * 8
    per_line_s = report["per_line_s"]
    per_log_mib = (RSS_64_LOGS_MIB - RSS_BASE_MIB) / 64
    out = {}
    for w in SCALES:
        out[w] = {
            "sent_bytes": vec, "received_bytes": vec * w,
            "ring_latency_ms": (w - 1) * HOP_US / 1e3,
            "collectives_per_step": 1 / sim["every"],
            "record_ms": records[w]["ms"], "record_bytes": records[w]["bytes"],
            "report_s": per_line_s * w * (steps_per_log + 2),
            "report_rss_gib": (RSS_BASE_MIB + per_log_mib * w) / 1024,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--report-steps", type=int, default=50000, help="steps a rank's log holds, for the model")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="stepprof-dist-scale-") as tmp:
        sim = simulate(args.world, args.steps, args.every, args.rounds, tmp)
        logs = sim.pop("logs")
        one, report = report_cost(logs[:1]), report_cost(logs)
        report["per_line_s"] = (report["wall_s"] - one["wall_s"]) / max(report["lines"] - one["lines"], 1)
    records = {w: record_cost(w, 5 if w <= 1024 else 2) for w in SCALES}
    costs = model(sim, records, report, args.report_steps)
    info = run_info("dist_scale.py", "none (CPU)")
    print(f"dist scale, {args.world} gloo ranks on the CPU, torch {info['torch']}, {args.rounds} rounds of "
          f"{args.steps} steps with 2 phases")
    print(f"  the exchange every {args.every} steps adds {sim['added_us_per_step']:.2f} µs of the training "
          f"thread's CPU a step (median over ranks and rounds; {sim['added_min_us']:.2f} to "
          f"{sim['added_max_us']:.2f}), {sim['added_in_loop_us_per_step']:.2f} of it in the loop (the rest at "
          f"construction and close); rank 0 wrote {sim['ranks_records']} ranks records of "
          f"{sim['ranks_record_bytes']} bytes")
    print(f"  report --json over the {args.world} logs ({report['lines']} lines): {report['wall_s']:.2f} s, "
          f"{report['per_line_s'] * 1e6:.1f} µs a line past the first log's, peak RSS {report['rss_mib']:.0f} MiB")
    print(f"  {'ranks':>6s} {'sent B':>7s} {'recv B':>9s} {'ring ms':>8s} {'record ms':>10s} {'record KB':>10s} "
          f"{'report h':>9s} {'report GiB':>11s}   (logs of {args.report_steps} steps)")
    for w, c in costs.items():
        print(f"  {w:6d} {c['sent_bytes']:7d} {c['received_bytes']:9d} {c['ring_latency_ms']:8.2f} "
              f"{c['record_ms']:10.2f} {c['record_bytes'] / 1e3:10.1f} {c['report_s'] / 3600:9.2f} "
              f"{c['report_rss_gib']:11.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**info, "simulation": sim, "report": report, "records": records, "model": costs,
                       "hop_us": HOP_US}, f, indent=1)
    return 0


if __name__ == "__main__":
    if not dist.is_available():
        print("bench/dist_scale.py needs torch.distributed; nothing measured")
        raise SystemExit(0)
    raise SystemExit(main())
