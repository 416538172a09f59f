"""What counting sync points costs: per step without syncs, and per sync.

Three parts, on the launch-bound step of bench/overhead.py (8-layer 256-wide bf16
MLP, batch 64, AdamW) inside the README's phased loop:

  1. sync tracking off vs on ("warn", the default), interleaved rounds, with an
     A/A control (off vs off again): the per-step cost of a route installed once per
     profiler session (its check and the step's tracker);
  2. the added cost per sync: steps of 50 ``.item()`` calls and of none (40 steps a round), off vs
     "warn"; (added with 50 - added with none) / 50, so that the per-step cost of
     the tracking is not counted per sync.  And its floor: the same with only
     torch's sync warning and Python's warnings machinery (a hook that does nothing);

The "warn" route stays installed while its profiler is open, and an installed route
counts every sync of the process (those between steps too), so in parts 1 and 2 each
variant's round has a profiler of its own, opened before the round and closed after it
(untimed, with one untimed step first): no variant runs under another's route.
  3. the opt-in "trace" mechanism.  Activating torch's GPU trace cannot be undone
     and makes every allocation and free call into Python, whoever allocates, so it
     runs last: the per-allocation cost before and after activation, the
     allocations per step, and the step off vs "trace" after activation (where
     "off" pays the per-allocation cost too).

    python bench/syncs.py [--rounds 40] [--steps 50] [--out syncs.json]
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
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import stepprof  # noqa: E402
from stepprof import _syncs  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import run_info, timed_round  # noqa: E402
from overhead import make_workload, median_ci, phased_step, quantiles  # noqa: E402


def interleave(variants: dict, rounds: int, k: int, base: str, profs: dict) -> dict:
    """Median µs per call of each variant and its ratio to ``base`` in the same round.

    ``profs`` maps each variant to its profiler, whose pending records are written at the
    end of the variant's round (inside its timing), not during the next variant's round.
    """
    for fn in variants.values():
        for _ in range(5):
            fn()
    torch.cuda.synchronize()
    for p in profs.values():
        p.flush()
    per = {v: [] for v in variants}
    rng = random.Random(0)
    for _ in range(rounds):
        order = list(variants)
        rng.shuffle(order)
        for v in order:
            wall_us, _ = timed_round(variants[v], k, torch.cuda.synchronize, profs[v].flush)
            per[v].append(wall_us)
    return _figures(per, base)


def _figures(per: dict, base: str) -> dict:
    """Each variant's per-step µs, its ratio to ``base`` round by round, and the added µs."""
    out = {}
    for v, xs in per.items():
        ratios = [x / b for x, b in zip(xs, per[base])]
        out[v] = {
            "us": quantiles(xs),
            "ratio": {**quantiles(ratios), "median_ci95": median_ci(ratios)},
            "added_us": quantiles([x - b for x, b in zip(xs, per[base])]),
            "rounds_us": xs,
        }
    return out


def interleave_sessions(variants: dict, rounds: int, k: int, base: str) -> tuple[dict, dict]:
    """:func:`interleave` with a fresh profiler per variant and round: ``variants`` maps a
    name to (make a profiler, the step of that profiler).  Each round opens the profiler,
    runs one step untimed (the backend is chosen and the sync session opened there), times
    ``k`` steps, and closes it untimed.  Returns the figures and each variant's last summary.
    """
    per: dict = {v: [] for v in variants}
    last: dict = {}
    rng = random.Random(0)
    for r in range(rounds + 1):  # the first round warms up, untimed
        order = list(variants)
        rng.shuffle(order)
        for v in order:
            make, step_of = variants[v]
            p = make()
            step = step_of(p)
            step()
            torch.cuda.synchronize()
            p.flush()
            wall_us, _ = timed_round(step, k, torch.cuda.synchronize, p.flush)
            last[v] = p.close()
            if r:
                per[v].append(wall_us)
    return _figures(per, base), last


def alloc_pair_us(n: int = 20000) -> float:
    """Host µs to allocate and free a small CUDA tensor (the caching allocator's fast path)."""
    for _ in range(1000):
        torch.empty(256, device="cuda")
    best = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            torch.empty(256, device="cuda")
        best.append((time.perf_counter() - t0) / n * 1e6)
    return sorted(best)[2]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--steps", type=int, default=50, help="steps per variant per round")
    ap.add_argument("--out", default="syncs.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/syncs.py needs CUDA; nothing measured")
        return 0
    res = run_info("syncs.py")
    fwd, bwd, opt = make_workload(256, 64)
    tmp = tempfile.mkdtemp()

    def prof(tag, **kw):
        return stepprof.Profiler(os.path.join(tmp, f"{tag}.jsonl"), **kw)

    # 1. the launch-bound step, sync tracking off vs on
    def maker(tag, **kw):
        return lambda: prof(tag, **kw)

    def phased(p):
        return lambda: phased_step(p, 64, fwd, bwd, opt)

    res["launch_bound"], _ = interleave_sessions(
        {"off": (maker("off", syncs="off"), phased), "off-again": (maker("off2", syncs="off"), phased),
         "warn": (maker("warn"), phased)},
        args.rounds, args.steps, "off",
    )

    # 2. the added cost per sync
    s = torch.ones(8, device="cuda").sum()
    n_syncs = 50

    def syncing(n):
        def step_of(p):
            def step():
                with p.step():
                    for _ in range(n):
                        s.item()
            return step
        return step_of

    # The floor: what torch and Python's warnings cost per sync before any counting --
    # sync-debug mode "warn", a front "always" filter for the message, and a hook in place
    # of warnings._showwarnmsg that does nothing (stepprof's own route minus its counting).
    front = _syncs.WarningTap()._filter  # the same front filter as stepprof's, not its hook

    def floor(n):
        def step_of(p):
            def step():
                with p.step():
                    torch._C._cuda_set_sync_debug_mode(1)
                    warnings.filters.insert(0, front)
                    shown, warnings._showwarnmsg = warnings._showwarnmsg, lambda msg: None
                    try:
                        for _ in range(n):
                            s.item()
                    finally:
                        warnings._showwarnmsg = shown
                        warnings.filters.remove(front)
                        torch._C._cuda_set_sync_debug_mode(0)
            return step
        return step_of

    variants = {v: (maker("s-" + v, syncs=v.split("-")[0]), syncing(int(v.split("-")[1])))
                for v in ("off-0", "warn-0", "off-50", "warn-50")}
    variants.update({v: (maker("s-" + v, syncs="off"), floor(int(v.split("-")[1])))
                     for v in ("floor-0", "floor-50")})
    per_sync, summaries = interleave_sessions(variants, args.rounds, 40, "off-0")
    counted = summaries["warn-50"].syncs_per_step_median
    med = {v: r["us"]["median"] for v, r in per_sync.items()}
    # Per round, from that round's four variants (a paired estimate: drift between rounds
    # cancels), then the median over rounds and its 95% bootstrap interval.
    r = {v: per_sync[v]["rounds_us"] for v in per_sync}
    did = [(w50 - o50 - w0 + o0) / n_syncs
           for w50, o50, w0, o0 in zip(r["warn-50"], r["off-50"], r["warn-0"], r["off-0"])]
    added = {
        "median": statistics.median(did),
        "median_ci95": median_ci(did),
        "from_variant_medians": (med["warn-50"] - med["off-50"] - med["warn-0"] + med["off-0"]) / n_syncs,
    }
    fl = [(f50 - o50 - f0 + o0) / n_syncs
          for f50, o50, f0, o0 in zip(r["floor-50"], r["off-50"], r["floor-0"], r["off-0"])]
    res["per_sync"] = {
        "floor_us_per_sync": {"median": statistics.median(fl), "median_ci95": median_ci(fl),
                              "note": "torch's sync warning and Python's warnings machinery, "
                                      "with a hook that does nothing"},
        "syncs_per_step": n_syncs,
        "counted_per_step": counted,
        "item_us_untracked": (per_sync["off-50"]["us"]["median"] - per_sync["off-0"]["us"]["median"])
        / n_syncs,
        "added_us_per_sync": added,
        "route_per_empty_step_us": per_sync["warn-0"]["added_us"],
        "note": "median over rounds of each round's (warn-50 - off-50 - warn-0 + off-0) / syncs",
        "variants": per_sync,
    }

    # 3. the "trace" mechanism, last: its activation cannot be undone
    stats = torch._C._cuda_memoryStats
    a0 = stats(0)["allocation"]["all"]["allocated"]
    for _ in range(10):
        fwd(); bwd(); opt()  # noqa: E702
    allocs_per_step = (stats(0)["allocation"]["all"]["allocated"] - a0) / 10
    before = alloc_pair_us()
    p_off, p_trace = prof("t-off", syncs="off"), prof("t-trace", syncs="trace")
    with p_trace.step():  # activates the GPU trace (and self-tests it)
        pass
    after = alloc_pair_us()
    trace = interleave(
        {"off (trace active)": lambda: phased_step(p_off, 64, fwd, bwd, opt),
         "trace": lambda: phased_step(p_trace, 64, fwd, bwd, opt)},
        args.rounds, args.steps, "off (trace active)", {"off (trace active)": p_off, "trace": p_trace},
    )
    p_off.close()
    mechanism = p_trace.close().sync_mechanism
    step_us = res["launch_bound"]["off"]["us"]["median"]
    res["trace"] = {
        "mechanism": mechanism,
        "allocations_per_step": allocs_per_step,
        "alloc_free_pair_us_before": before,
        "alloc_free_pair_us_after": after,
        "activation_cost_us_per_step": allocs_per_step * (after - before),
        "activation_cost_fraction": allocs_per_step * (after - before) / step_us,
        "interleaved_after_activation": trace,
    }

    print(f"{res['gpu']}, torch {res['torch']}, {args.rounds} interleaved rounds x {args.steps} steps")
    print("1. launch-bound phased step, sync tracking off vs on")
    for v, r in res["launch_bound"].items():
        print(f"   {v:10s} {r['us']['median']:8.1f} µs/step  ratio {r['ratio']['median']:.4f} "
              f"(95% CI {r['ratio']['median_ci95'][0]:.4f}-{r['ratio']['median_ci95'][1]:.4f}) "
              f"[p10 {r['ratio']['p10']:.4f}, p90 {r['ratio']['p90']:.4f}]  "
              f"added {r['added_us']['median']:+.1f} µs")
    ps = res["per_sync"]
    a = ps["added_us_per_sync"]
    print(f"2. per sync: .item() {ps['item_us_untracked']:.1f} µs untracked; tracking adds "
          f"{a['median']:.2f} µs per sync (95% CI {a['median_ci95'][0]:.2f}-{a['median_ci95'][1]:.2f}; "
          f"{a['from_variant_medians']:.2f} from the variants' medians); "
          f"counted {ps['counted_per_step']} of {n_syncs} per step")
    e = ps["route_per_empty_step_us"]
    print(f"   the route per empty step (warn-0 - off-0): {e['median']:+.2f} µs "
          f"(p10 {e['p10']:+.2f}, p90 {e['p90']:+.2f})")
    f = ps["floor_us_per_sync"]
    print(f"   the floor (torch's warning + Python's warnings, a hook that does nothing): "
          f"{f['median']:.2f} µs per sync (95% CI {f['median_ci95'][0]:.2f}-{f['median_ci95'][1]:.2f})")
    t = res["trace"]
    print(f"3. trace ({t['mechanism']}): {t['allocations_per_step']:.0f} allocations/step; alloc+free "
          f"{t['alloc_free_pair_us_before']:.2f} -> {t['alloc_free_pair_us_after']:.2f} µs once active: "
          f"+{t['activation_cost_us_per_step']:.0f} µs/step ({t['activation_cost_fraction']:.1%}) "
          f"for every step of the process")
    for v, r in trace.items():
        print(f"   {v:18s} {r['us']['median']:8.1f} µs/step  ratio {r['ratio']['median']:.4f} "
              f"[p10 {r['ratio']['p10']:.4f}, p90 {r['ratio']['p90']:.4f}]")
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
