"""bench/floor.py for two versions of stepprof, interleaved: one round of each in turn.

Each round runs this tree's ``bench/floor.py --rounds 1`` in a fresh process, first on the base
tree's stepprof (``STEPPROF_BENCH_TREE``), then on this one's, so that both meet the same stretch of a shared host's noise.  The table gives,
per variant, each version's median µs per step over the rounds (and its range) and the median
of the per-round ratios (this tree over the base), with its range.

The base is a git revision (exported into a temporary directory with ``git archive``), or a
directory that holds a copy of its ``stepprof/`` and ``bench/`` (where there is no git, such as
a device machine's copy of the working tree).

    python bench/floor_ab.py --base b330aee [--rounds 9] [--steps 3000] [--device auto|cpu|cuda] [--json PATH]
    python bench/floor_ab.py --base-dir /path/to/base/tree ...
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ("step", "3 phases", "no log", "python")


def export(rev: str, into: str) -> str:
    """``rev``'s stepprof/ and bench/, extracted under ``into``."""
    archive = subprocess.run(
        ["git", "-C", HERE, "archive", "--format=tar", rev, "stepprof", "bench"],
        check=True, capture_output=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as t:
        t.extractall(into, filter="data")
    return into


def one_round(tree: str, seed: int, device: str, out: str, steps: int) -> dict:
    """One round of this tree's bench/floor.py, with ``tree``'s stepprof (the same loop for both:
    a base's own floor.py may run another)."""
    subprocess.run(
        [sys.executable, os.path.join(HERE, "bench", "floor.py"), "--rounds", "1", "--seed", str(seed),
         "--device", device, "--steps", str(steps), "--json", out],
        check=True, capture_output=True, env={**os.environ, "STEPPROF_BENCH_TREE": tree},
    )
    with open(out) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    base = ap.add_mutually_exclusive_group(required=True)
    base.add_argument("--base", help="a git revision of this repository")
    base.add_argument("--base-dir", help="a directory holding the base's stepprof/ and bench/")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--steps", type=int, default=3000, help="steps a run (floor.py's --steps)")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="stepprof-floor-ab-") as tmp:
        base_tree = args.base_dir or export(args.base, os.path.join(tmp, "base"))
        runs: dict[str, list[dict]] = {"base": [], "head": []}
        for i in range(1, args.rounds + 1):
            for name, tree in (("base", base_tree), ("head", HERE)):
                runs[name].append(one_round(tree, i, args.device, os.path.join(tmp, f"{name}-{i}.json"), args.steps))
    info = runs["head"][0]
    print(f"stepprof floor A/B on {info['gpu']}, torch {info['torch']}: {args.rounds} interleaved rounds "
          f"of {info['steps']} steps, base {args.base or args.base_dir}")
    print(f"  {'variant':10s} {'base µs':>8s} {'range':>13s} {'head µs':>8s} {'range':>13s} {'ratio':>6s} {'range':>13s}")
    table = {}
    for v in VARIANTS:
        if any(v not in r["variants"] for r in runs["base"] + runs["head"]):
            continue  # (a variant one of the two versions does not run: the base's CPU had no "python")
        b = [r["variants"][v]["median_us"] for r in runs["base"]]
        h = [r["variants"][v]["median_us"] for r in runs["head"]]
        ratio = [y / x for x, y in zip(b, h)]
        table[v] = {"base_us": b, "head_us": h, "ratio": ratio,
                    "base_median_us": statistics.median(b), "head_median_us": statistics.median(h),
                    "ratio_median": statistics.median(ratio)}
        print(f"  {v:10s} {statistics.median(b):8.1f} {min(b):6.1f}-{max(b):<6.1f} {statistics.median(h):8.1f} "
              f"{min(h):6.1f}-{max(h):<6.1f} {statistics.median(ratio):6.3f} {min(ratio):.3f}-{max(ratio):.3f}")
    for part, title in (("close", "of it in close() (the records still waiting, written there)"),
                        ("training", "the training thread's own, in the loop")):
        key = f"{part}_median_us"
        have = [v for v in table if all(key in r["variants"][v] for r in runs["base"] + runs["head"])]
        if have:
            print(f"  {title}:")
        for v in have:
            b = [r["variants"][v][key] for r in runs["base"]]
            h = [r["variants"][v][key] for r in runs["head"]]
            ratio = [y / x if x else float("nan") for x, y in zip(b, h)]
            table[v].update({f"{part}_base_us": b, f"{part}_head_us": h, f"{part}_ratio": ratio,
                             f"{part}_ratio_median": statistics.median(ratio)})
            print(f"  {v:10s} {statistics.median(b):8.1f} {min(b):6.1f}-{max(b):<6.1f} {statistics.median(h):8.1f} "
                  f"{min(h):6.1f}-{max(h):<6.1f} {statistics.median(ratio):6.3f} {min(ratio):.3f}-{max(ratio):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": info["date"], "gpu": info["gpu"], "torch": info["torch"], "python": info["python"],
                       "command": "python " + " ".join([os.path.relpath(__file__, HERE), *(argv or sys.argv[1:])]),
                       "base": args.base or args.base_dir, "rounds": args.rounds, "variants": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
