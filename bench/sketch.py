"""What the summary's quantile sketch costs per value on a long run, and what its compaction sort costs.

Every step record feeds about ten sketches (wall, GPU, span, busy, samples/s, syncs, overhead,
data wait, and each phase's); past :attr:`QuantileSketch.EXACT` values a sketch compacts, and
that is the part of a record's cost that grows with a run.  The figure is the best of
``--rounds`` of feeding ``--values`` uniform values in batches of 64 (the collector's chunk),
``settle()`` after each, as ``RunAggregate`` does; the compaction's sort is timed alone too,
numpy's stable sort (what the sketch uses) against Python's ``sorted`` on the same doubles.

    python bench/sketch.py [--values 400000] [--rounds 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from array import array

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np  # noqa: E402

from _common import run_info  # noqa: E402
from stepprof._stats import QuantileSketch  # noqa: E402


def feed_us(values: list[float], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        s = QuantileSketch()
        t0 = time.perf_counter()
        for i in range(0, len(values), 64):
            s.buf.extend(values[i:i + 64])
            s.settle()
        best = min(best, (time.perf_counter() - t0) / len(values) * 1e6)
    return best


def sort_ms(xs: array, rounds: int, numpy_sort: bool) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        if numpy_sort:
            np.sort(np.frombuffer(xs, dtype=np.float64), kind="stable")
        else:
            array("d", sorted(xs))
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--values", type=int, default=400_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args(argv)
    rng = random.Random(0)
    values = [rng.random() for _ in range(args.values)]
    merged = array("d", values[: 2 * QuantileSketch.EXACT])
    out = {
        "feed_us_per_value": feed_us(values, args.rounds),
        "sort_ms_numpy": sort_ms(merged, args.rounds, True),
        "sort_ms_sorted": sort_ms(merged, args.rounds, False),
    }
    print(f"QuantileSketch, {args.values:,} values in batches of 64, best of {args.rounds}")
    print(f"  feed and settle: {out['feed_us_per_value']:.3f} µs a value")
    print(f"  one compaction's sort of {len(merged):,} doubles: numpy {out['sort_ms_numpy']:.2f} ms, "
          f"sorted() {out['sort_ms_sorted']:.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**run_info("sketch.py", gpu="none (CPU work)"), "values": args.values, "rounds": args.rounds, **out}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
