"""Every reader tool against mutated logs: crashes, the slowest call, and peak memory.

Each case is a log of every record kind (tests/readerlogs.py) with two or three fields replaced
by a hostile value: every field of every kind (from the record declaration, stepprof/_fields.py)
meets every class of tests/fuzzlogs.CLASSES, dealt round robin.  The cases are written in batches
of 100 logs and every tool (read, frame, report, report --json, export --chrome and
--tensorboard) runs on each batch in-process; each plot (plot, --peak, --sweep) runs on cases of
its own, one log each, whose mutations hit the kinds it draws.  A crash is any exception out of
a tool (a refusal with exit status 2, such as "no step records to export", is not one); it is
traced back to its case.

    python bench/fuzz.py [--cases 20000] [--seed 0] [--plot-cases 1000] [--tools plot,...] [--out FILE.json]

Exits 1 if any tool crashed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests import fuzzlogs  # noqa: E402
from tests.readerlogs import TOOLS  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=20_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot-cases", type=int, default=None, help="cases per plot (default: cases / 20)")
    ap.add_argument("--tools", default=",".join(TOOLS), help=f"the tools to run, by comma (default: {','.join(TOOLS)})")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", f"fuzz-cpu-{time.strftime('%Y-%m-%d')}.json"),
                    help="write the results as JSON here (default: bench/results/fuzz-cpu-<date>.json)")
    args = ap.parse_args(argv)
    plot_n = args.plot_cases if args.plot_cases is not None else max(30, args.cases // 20)
    tools = tuple(t.strip() for t in args.tools.split(","))
    if not set(tools) <= set(TOOLS):
        ap.error(f"--tools: {sorted(set(tools) - set(TOOLS))} are not among {', '.join(TOOLS)}")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result = fuzzlogs.fuzz(tmp, args.cases, args.seed, plot_n=plot_n, tools=tools)
    result.update(
        bench="fuzz", wall_s=time.perf_counter() - t0, python=platform.python_version(), cpus=os.cpu_count(),
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )
    crashes = sum(len(t["crashes"]) for t in result["tools"].values())
    print(f"{args.cases:,} mutated logs (seed {args.seed}), {plot_n} per plot; "
          f"{result['combos_covered']:,} of {result['combos']:,} (kind, field, value class) combinations; "
          f"{result['wall_s']:.0f} s, peak RSS {result['peak_rss_mib']:.0f} MiB")
    print(f"{'tool':<22} {'calls':>6} {'cases':>7} {'crashes':>8} {'refused':>8} {'max s':>7} {'total s':>8}")
    for tool, t in result["tools"].items():
        print(f"{tool:<22} {t['calls']:>6,} {t['cases']:>7,} {len(t['crashes']):>8,} {t['refused']:>8,} "
              f"{t['max_s']:>7.2f} {t['total_s']:>8.1f}")
    for tool, t in result["tools"].items():
        for c in t["crashes"][:5]:
            print(f"\n{tool}: case {c['case']} at {c['site']}: {c['error']}\n  " + "\n  ".join(c["mutations"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 1 if crashes else 0


if __name__ == "__main__":
    sys.exit(main())
