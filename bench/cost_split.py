"""Where stepprof's own time per step goes: the training thread's boundaries against the
collector's work per record, inside the launch-bound loop and on empty steps.

For each variant, runs the step of bench/overhead.py (or an empty step) under one profiler and
reads, per step record: the training thread's time at the boundaries (``Step.overhead_ns``),
the collector's CPU time per record (its harvests' thread CPU time over the records they wrote)
and its wall time per record, and the time inside the backend's boundary call and the sync
watch.  Prints medians (µs) and writes JSON.

With ``--features``, each feature's cost per step instead: bench/floor.py's near-empty step
(construction, 3,000 steps and close, all threads' CPU), run with the default settings and
with one feature off, interleaved round by round in a shuffled order; a feature's cost is the
median over rounds of (defaults less the run without it), with its range.  This runs on the
CPU too (where energy and syncs are not measured: their cost there should be nil).

That figure spreads what a feature costs once a run (the energy sampler's NVML set-up and
its last read at close, say) over the run's steps.  ``--long-steps N`` runs every variant a
second time with N steps, in the same rounds, and splits each feature's cost into what one
more step adds (the slope between the two lengths) and what is left once a run.

    python bench/cost_split.py [--steps 400] [--out cost_split.json]
    python bench/cost_split.py --features [--rounds 7] [--device auto|cpu|cuda] [--long-steps 12000] [--out features.json]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
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
from overhead import make_workload, phased_step  # noqa: E402
import floor  # noqa: E402

VARIANTS = {
    "step": ({}, "step"),
    "full": ({}, "full"),
    "full-budget": ({"overhead_budget": 0.01}, "full"),
    "step-python": ({"boundary": "python"}, "step"),
    "empty-step": ({}, "empty"),
    "empty-step-budget": ({"overhead_budget": 0.01}, "empty"),
    # the collector's schedule: its thread every 20 ms (the schedule before 100 ms), or none (the
    # training thread writes the completed steps at each step's exit)
    "step-every-20ms": ({"collect_every_s": 0.02}, "step"),
    "full-every-20ms": ({"collect_every_s": 0.02}, "full"),
    "step-inline": ({"collect_every_s": None}, "step"),
    "full-inline": ({"collect_every_s": None}, "full"),
}


def run(name: str, kw: dict, kind: str, steps: int, tmp: str, work) -> dict:
    fwd, bwd, opt = work
    prof = _make_profiler(os.path.join(tmp, f"{name}.jsonl"), **kw)
    col = prof._collector
    hot: list[tuple[int, bool]] = []
    harvests: list[tuple[int, int, int]] = []  # (cpu ns, wall ns, records)
    harvest = collector_mod.Collector.harvest

    def spy_harvest(*args):  # the steps a harvest wrote: those it took from pending (C or Python)
        before = list(col.pending)
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        try:
            return harvest(col, *args)
        finally:
            c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
            left = {id(s) for s in list(col.pending)}  # (a copy: the training thread appends)
            taken = [(s.overhead_ns, s.sampled != 0) for s in before if id(s) not in left]
            if taken:
                hot.extend(taken)
                harvests.append((c1 - c0, w1 - w0, len(taken)))

    col.harvest = spy_harvest
    parts: dict[str, list[int]] = collections.defaultdict(list)

    def one():
        if kind == "empty":
            with prof.step():
                pass
        elif kind == "step":
            with prof.step(batch_size=64):
                fwd(); bwd(); opt()
        else:
            phased_step(prof, 64, fwd, bwd, opt)

    for _ in range(20):
        one()
    torch.cuda.synchronize()
    prof.flush()
    b = prof._boundaries.backend
    # A boundary's device call, "cross": the compiled boundary's C call where the step core makes
    # it (the core takes its pooled event itself), else Backend.cross.
    device_call = "_boundary" if b.core_plan()[0] == 1 else "cross"
    for attr, name in ((device_call, "cross"), ("watch_syncs", "watch_syncs"), ("unwatch_syncs", "unwatch_syncs")):
        fn = getattr(b, attr)

        def timed(*a, _fn=fn, _name=name, **k):
            t0 = time.perf_counter_ns()
            try:
                return _fn(*a, **k)
            finally:
                parts[_name].append(time.perf_counter_ns() - t0)

        setattr(b, attr, timed)
    prof._bind_core()  # a new step core, which asks the backend for its calls again (the wrapped ones)
    hot.clear()
    harvests.clear()
    t0 = time.perf_counter()
    for _ in range(steps):
        one()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps * 1e6
    prof.close()
    per_rec_cpu = [c / n / 1e3 for c, _, n in harvests]
    per_rec_wall = [w / n / 1e3 for _, w, n in harvests]
    full = [h / 1e3 for h, sampled in hot if sampled]
    light = [h / 1e3 for h, sampled in hot if not sampled]
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return {
        "step_us": wall,
        "hot_full_us": med(full),
        "hot_light_us": med(light),
        "collector_cpu_us_per_record": med(per_rec_cpu),
        "collector_wall_us_per_record": med(per_rec_wall),
        "records_per_harvest": med([n for *_, n in harvests]),
        "boundary": b.boundary,
        "per_step_calls_us": {k: sum(v) / steps / 1e3 for k, v in parts.items()},
        "calls_per_step": {k: len(v) / steps for k, v in parts.items()},
    }


@contextlib.contextmanager
def _no_compile_tracking():
    """torch.compile tracking off: the profiler wires no compile hook (its methods are the
    base hook's, which the boundaries and the collector skip)."""
    from stepprof._recorder.compiles import CompileHook
    from stepprof._recorder.hooks import Hook

    names = ("on_step_begin", "on_harvest", "on_record")
    saved = {n: CompileHook.__dict__[n] for n in names}
    for n in names:
        setattr(CompileHook, n, getattr(Hook, n))
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(CompileHook, n, fn)


@contextlib.contextmanager
def _no_sync_plan():
    """The step core's own sync watch off: every step's watch goes to the backend's
    ``watch_syncs`` (``CudaBackend.sync_plan`` hidden)."""
    from stepprof._device.cuda import CudaBackend

    saved = CudaBackend.__dict__["sync_plan"]
    del CudaBackend.sync_plan
    try:
        yield
    finally:
        CudaBackend.sync_plan = saved  # type: ignore[method-assign]


#: --features: the run without each feature: (its settings, a patch for one with no setting,
#: whether it writes a log).
FEATURES = {
    "energy sampling": ({"energy_every_s": None}, contextlib.nullcontext, True),
    "sync counting": ({"syncs": "off"}, contextlib.nullcontext, True),
    "compile tracking": ({}, _no_compile_tracking, True),
    "log writing": ({}, contextlib.nullcontext, False),
    # Below 0 where the core's own sync watch saves what the backend's watch would cost.
    "sync watch in C": ({}, _no_sync_plan, True),
}
#: What --features cannot switch off, and why.
NOT_SEPARABLE = {
    "data wait": "always on: one subtraction at step entry and one clock read at exit on the training "
                 "thread (the exit's read is the step's own), a division on the collector; no setting "
                 "turns it off to measure against",
}


def features(rounds: int, steps: int, device: str, seed: int, long_steps: int = 0) -> dict:
    """Each feature's CPU per step on the near-empty step: the defaults less the run without it
    (and with ``long_steps``, split into a cost per step and a cost per run)."""
    work, sync = floor.near_empty_step(device == "cuda")
    rng = random.Random(seed)
    lengths = (steps, long_steps) if long_steps > steps else (steps,)
    cost: dict[str, dict[int, list[float]]] = {name: {n: [] for n in lengths} for name in FEATURES}
    defaults_us: list[float] = []
    with tempfile.TemporaryDirectory(prefix="stepprof-features-") as tmp:
        log = os.path.join(tmp, "run.jsonl")

        def one(name: str | None, n: int) -> float:
            settings, patch, logged = FEATURES[name] if name is not None else ({}, contextlib.nullcontext, True)
            path = log if logged else None
            with patch():
                cpu = floor.run_once(n, work, sync, settings, (), path, device)[0]
            if path is not None and os.path.exists(path):
                os.remove(path)
            return cpu

        for name in (None, *FEATURES):  # warm-up
            one(name, 200)
        for _ in range(rounds):
            for n in lengths:
                order = [None, *FEATURES]
                rng.shuffle(order)
                cpu = {name: one(name, n) for name in order}
                if n == steps:
                    bare = floor.run_once(n, work, sync, None, (), None, device)[0]
                    defaults_us.append((cpu[None] - bare) / n * 1e6)
                for name in FEATURES:
                    cost[name][n].append(cpu[None] - cpu[name])  # seconds a run
    out: dict = {}
    for name, by_n in cost.items():
        xs = [c / steps * 1e6 for c in by_n[steps]]
        r = out[name] = {"median_us": statistics.median(xs), "min_us": min(xs), "max_us": max(xs), "rounds_us": xs}
        if len(lengths) == 2:
            slope = [(long_c - c) / (long_steps - steps) * 1e6 for c, long_c in zip(by_n[steps], by_n[long_steps])]
            once = [c * 1e3 - s * steps / 1e3 for c, s in zip(by_n[steps], slope)]
            r.update(per_step_us=statistics.median(slope), per_step_min_us=min(slope),
                     per_step_max_us=max(slope), per_run_ms=statistics.median(once),
                     per_run_min_ms=min(once), per_run_max_ms=max(once))
    return {
        "defaults_us_per_step": statistics.median(defaults_us),
        "defaults_rounds_us": defaults_us,
        "long_steps": long_steps if len(lengths) == 2 else None,
        "features": out,
        "not_separable": NOT_SEPARABLE,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--out", default="cost_split.json")
    ap.add_argument("--no-gc", action="store_true", help="turn Python's cyclic garbage collector off")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    ap.add_argument("--features", action="store_true", help="each feature's cost per step (see the docstring)")
    ap.add_argument("--rounds", type=int, default=7, help="--features: interleaved rounds")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="--features: where")
    ap.add_argument("--feature-steps", type=int, default=3000, help="--features: steps a run")
    ap.add_argument("--long-steps", type=int, default=0,
                    help="--features: also runs of this many steps, to split each cost into per step and per run")
    args = ap.parse_args()
    if args.features:
        cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
        device = "cuda" if cuda else "cpu"
        res = features(args.rounds, args.feature_steps, device, 0, args.long_steps)
        gpu = torch.cuda.get_device_name() if cuda else "none (CPU)"
        print(f"stepprof's features on the near-empty step ({gpu}, {args.feature_steps} steps a run, "
              f"{args.rounds} rounds): defaults {res['defaults_us_per_step']:.1f} µs/step")
        split = res["long_steps"] is not None
        extra = f" | {'µs/step, slope':>15s} {'min':>7s} {'max':>7s} | {'ms/run':>7s}" if split else ""
        print(f"  {'feature':18s} {'µs/step median':>15s} {'min':>8s} {'max':>8s}{extra}")
        for name, r in res["features"].items():
            tail = (f" | {r['per_step_us']:15.2f} {r['per_step_min_us']:7.2f} {r['per_step_max_us']:7.2f} |"
                    f" {r['per_run_ms']:7.2f}" if split else "")
            print(f"  {name:18s} {r['median_us']:15.2f} {r['min_us']:8.2f} {r['max_us']:8.2f}{tail}")
        if split:
            print(f"  (slope: what one more step adds, between {args.feature_steps} and {args.long_steps} steps;"
                  f" ms/run: the rest, once a run)")
        for name, why in NOT_SEPARABLE.items():
            print(f"  {name:18s} not separable: {why}")
        with open(args.out, "w") as fh:
            json.dump({**run_info("cost_split.py", gpu=gpu), "device": device, "steps": args.feature_steps,
                       "rounds": args.rounds, **res}, fh, indent=2)
        return 0
    if args.no_gc:
        import gc

        gc.disable()
    if not torch.cuda.is_available():
        print("bench/cost_split.py needs CUDA; nothing measured")
        return 0
    work = make_workload(256, 64)
    out = {**run_info("cost_split.py"), "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants.split(","):
            kw, kind = VARIANTS[name]
            out["variants"][name] = r = run(name, kw, kind, args.steps, tmp, work)
            calls = ", ".join(f"{k} {v:.1f}" for k, v in r["per_step_calls_us"].items())
            fmt = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
            print(f"{name:18s} step {r['step_us']:8.1f} µs | hot full {fmt(r['hot_full_us'])} light "
                  f"{fmt(r['hot_light_us'])} | collector cpu/rec {fmt(r['collector_cpu_us_per_record'])} "
                  f"wall/rec {fmt(r['collector_wall_us_per_record'])} ({fmt(r['records_per_harvest'])} rec/harvest)"
                  f" | {r['boundary']} | µs/step in: {calls}")
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
