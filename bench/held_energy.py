"""What writing a record that waited for its energy sample costs: ``HeldRecords.write`` over
``--records`` held step records whose spans the samples cover, timed with the thread's CPU clock.

Three ways, each round in a shuffled order: ``c fold`` (``_fold.c``'s ``fill_energy``, the
summary's energy folded in C, as while a run has one step name), ``c add_late`` (the same fill,
the summary told through ``RunAggregate.add_late``, as once a run has several names), and
``python`` (``EnergyHook.fill`` a record at a time, as without the C module).  Every round checks
that the three give the same summary.  The table gives the median µs a record over the rounds,
its range, and the median ratio to ``python``.  Runs on the CPU: no device is involved.

    python bench/held_energy.py [--records 20000] [--rounds 9] [--json PATH]
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
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import orjson  # noqa: E402

from stepprof._recorder import collector  # noqa: E402, F401  (configures the C build of records)
from stepprof._recorder import energy as energy_mod  # noqa: E402
from stepprof._recorder.held import HeldRecords  # noqa: E402
from stepprof._recorder.sinks import LogSink, SummarySink  # noqa: E402
from _common import run_info  # noqa: E402

WAYS = ("c fold", "c add_late", "python")


class _Samples:
    """A sampler's lists, one sample a millisecond, 37 mJ each."""

    def __init__(self, n: int) -> None:
        self.times = [i * 1_000_000 for i in range(n + 2)]
        self.mj = [i * 37 for i in range(n + 2)]
        self.running, self.reason = True, None

    def trim(self, t: int) -> None:
        pass

    def energy_j(self, a: int, b: int) -> float | None:
        return energy_mod.Sampler.energy_j(self, a, b)  # type: ignore[arg-type]


def one(way: str, records: int, tmp: str) -> tuple[float, dict[str, Any]]:
    """µs of CPU a record for one write of ``records`` held records, and the summary's fields."""
    samples = _Samples(records)
    line = orjson.dumps({"kind": "step", "step": 1, "name": "step", "wall_ms": 1.0, "gpu_ms": 0.9,
                         "unavailable": {}}) + b"\n"
    entries = [(line, "step", 8, True, b"", 0, i * 1_000_000 + 10, (i + 1) * 1_000_000 - 10)
               for i in range(records)]
    log, summary = LogSink(os.path.join(tmp, "held.jsonl"), None, "r"), SummarySink("r")
    if way != "c fold":
        summary.fold_plan = lambda: None  # type: ignore[method-assign]
    held = HeldRecords(log, summary)
    hook = energy_mod.EnergyHook(0.5, lambda: samples.times[-1])
    hook.sampler = samples  # type: ignore[assignment]
    held.late = hook
    held.entries.extend(entries)
    fill = energy_mod._NATIVE.fill
    if way == "python":
        energy_mod._NATIVE.fill = None
    try:
        t0 = time.thread_time_ns()
        held.write(True)
        ns = time.thread_time_ns() - t0
    finally:
        energy_mod._NATIVE.fill = fill
        log.close()
    return ns / records / 1e3, summary.aggregate.summary_fields()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args(argv)
    if energy_mod._NATIVE.fill is None:
        print("the C module is not built (python -m stepprof build): nothing to compare")
        return 0
    rng = random.Random(args.seed)
    us: dict[str, list[float]] = {w: [] for w in WAYS}
    with tempfile.TemporaryDirectory(prefix="stepprof-held-") as tmp:
        for _ in range(args.rounds):
            order = list(WAYS)
            rng.shuffle(order)
            fields = {}
            for way in order:
                t, fields[way] = one(way, args.records, tmp)
                us[way].append(t)
            if not fields["c fold"] == fields["c add_late"] == fields["python"]:
                raise SystemExit("the three ways gave different summaries")
    print(f"held records written, {args.records} a round, {args.rounds} rounds, µs a record (thread CPU)")
    print(f"  {'way':11s} {'median':>7s} {'min':>7s} {'max':>7s} {'ratio to python':>16s}")
    results = {}
    for way in WAYS:
        ratios = [a / b for a, b in zip(us[way], us["python"])]
        results[way] = {"median_us": statistics.median(us[way]), "rounds_us": us[way],
                        "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
        print(f"  {way:11s} {statistics.median(us[way]):7.2f} {min(us[way]):7.2f} {max(us[way]):7.2f} "
              f"{statistics.median(ratios):7.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**run_info("held_energy.py", gpu="none (the CPU only)"), "records": args.records, "rounds": args.rounds,
                       "ways": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
