"""How fast ``stepprof report`` streams a large log, and whether its memory stays bounded.

Writes step logs of 100k and 1M lines (realistic records: three phases, a sync site,
allocator deltas, FLOPs; memory records every 1000 steps), then reports each in a
fresh process (``python -m stepprof report --json``) and reads its wall time and
peak RSS.  Issue 27's bar, on the 2-core CPU: 1M lines in 2 s, 64 rank logs of 50k
steps in 15 s, under 1 GiB.

    python bench/report.py [--lines 1000000] [--out bench/results/report.json]
    python bench/report.py --ranks 64 [--rank-lines 50000]   (64 rank logs in one report)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import orjson  # noqa: E402

from tests import logfixtures as fx  # noqa: E402


def write_log(path: str, lines: int, seed: int = 0, rank: tuple[int, int] | None = None) -> int:
    """``lines`` records; ``rank``: (rank, world size), on every step record."""
    rng = random.Random(seed)
    base = fx.step_record(0, warmup=False, wall=7.0, gpu=7.0, flops=True)
    if rank is not None:
        base.update(rank=rank[0], local_rank=rank[0] % 8, world_size=rank[1])
    written = 0
    with open(path, "wb") as f:
        buf = []
        for i in range(lines):
            if i and i % 1000 == 0:
                buf.append(orjson.dumps(fx.memory_record(i, "periodic")))
            else:
                r = dict(base)
                gpu = 7.0 * (1 + rng.gauss(0, 0.02)) * (5 if rng.random() < 1e-4 else 1)
                r["step"] = i
                r["warmup"] = i < 3
                r["wall_ms"] = gpu * 1.001 + 0.02
                r["gpu_ms"] = gpu
                r["gpu_busy"] = gpu / r["wall_ms"]
                r["samples_per_s"] = 4096 / (r["wall_ms"] / 1e3)
                buf.append(orjson.dumps(r))
            written += 1
            if len(buf) >= 10_000:
                f.write(b"\n".join(buf) + b"\n")
                buf = []
        if buf:
            f.write(b"\n".join(buf) + b"\n")
    return written


def report_in_child(*paths: str) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "stepprof", "report", "--json", *paths], cwd=ROOT, capture_output=True
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(proc.stderr.decode())
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    rep = json.loads(proc.stdout)
    run = rep["logs"][0]["runs"][0]
    return {
        "wall_s": wall,
        "peak_rss_mib": peak_kib / 1024,
        "rss_grew": peak_kib > before,
        "measured_steps": run["measured_steps"],
        "approximate": run["approximate_quantiles"],
    }


def baseline_in_child() -> float:
    """Peak RSS of a child that imports stepprof and torch and reports nothing."""
    subprocess.run([sys.executable, "-c", "import stepprof._report, stepprof._cli"], cwd=ROOT, check=True)
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--ranks", type=int, default=0,
                    help="instead: this many rank logs of --rank-lines each, in one report")
    ap.add_argument("--rank-lines", type=int, default=50_000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    base = baseline_in_child()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.ranks:
            paths = [os.path.join(tmp, f"rank{k}.jsonl") for k in range(args.ranks)]
            t0 = time.perf_counter()
            for k, path in enumerate(paths):
                write_log(path, args.rank_lines, seed=k, rank=(k, args.ranks))
            gen_s = time.perf_counter() - t0
            res = report_in_child(*paths)
            res.update(lines=args.ranks * args.rank_lines, logs=args.ranks,
                       mib=sum(os.path.getsize(p) for p in paths) / 2**20, generate_s=gen_s)
            rows.append(res)
        for lines in sorted({args.lines // 10, args.lines}) if not args.ranks else ():
            path = os.path.join(tmp, f"log-{lines}.jsonl")
            t0 = time.perf_counter()
            write_log(path, lines)
            gen_s = time.perf_counter() - t0
            res = report_in_child(path)
            res.update(lines=lines, logs=1, mib=os.path.getsize(path) / 2**20, generate_s=gen_s)
            rows.append(res)
    print(
        f"baseline (import only) peak RSS {base:.0f} MiB   [{platform.processor() or platform.machine()}, "
        f"Python {platform.python_version()}]"
    )
    print(f"{'logs':>5} {'lines':>10} {'log MiB':>8} {'report s':>9} {'lines/s':>11} {'peak RSS MiB':>13} {'approx':>7}")
    for r in rows:
        print(
            f"{r['logs']:>5} {r['lines']:>10,} {r['mib']:>8.0f} {r['wall_s']:>9.2f} {r['lines'] / r['wall_s']:>11,.0f} "
            f"{r['peak_rss_mib']:>13.0f} {str(r['approximate']):>7}"
        )
    out = {
        "bench": "report",
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "baseline_peak_rss_mib": base,
        "rows": rows,
        "command": " ".join(["python", "bench/report.py", *sys.argv[1:]]),
        "note": "peak RSS is ru_maxrss of the child; it is monotonic across children, so only the "
        "largest run's figure is exact and the others are upper bounds; a parallel read's "
        "workers are counted one at a time (the largest process), not summed",
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
