"""stepprof's CPU a step in a long loop, per thread, and what Python's GC collections cost it.

bench/floor.py runs 3,000 steps; a long run also pays full garbage collections of the steps
waiting to be written (see ``HARVEST_AT`` in stepprof/_recorder/collector.py).  The child runs a
loop (``--work empty``: one tiny kernel on CUDA, nothing on the CPU; ``launch``: bench/overhead.py's
launch-bound MLP) under one profiler variant for ``--seconds``, and prints each thread's on-CPU
time a step (``/proc/self/task/*/schedstat``) in the loop and in ``close()``, and each GC
generation's collections and their time a step (``gc.callbacks``).  With ``--spy`` it runs under
``py-spy record`` and adds each thread's busiest frames (``--native``: C frames too).
``BENCH_ROOT=DIR`` imports stepprof from another tree (a base, for an A/B).  Linux only.

    python bench/long_loop.py [--variant step] [--work empty|launch] [--seconds 6] [--spy PATH] [--json PATH]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.environ.get("BENCH_ROOT") or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))

VARIANTS = {
    "bare": (None, False),
    "step": ({}, False),
    "3 phases": ({}, True),
    "step syncs off": ({"syncs": "off"}, False),
    "step energy off": ({"energy_every_s": None}, False),
    "step all off": ({"syncs": "off", "energy_every_s": None, "nvtx": False}, False),
    "step python": ({"boundary": "python"}, False),
    "3 phases energy off": ({"energy_every_s": None}, True),
    "step every 20ms": ({"collect_every_s": 0.02}, False),
    "3 phases every 20ms": ({"collect_every_s": 0.02}, True),
}


def threads_ns() -> dict[str, int]:
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        out[f"{names.get(int(tid), comm)}#{tid}"] = ns
    return out


def diff(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: b[k] - a.get(k, 0) for k in b if b[k] - a.get(k, 0) > 0}


def child(variant: str, work: str, seconds: float, out: str) -> None:
    import torch
    from overhead import any_step
    from stepprof._recorder.profiler import _make_profiler

    settings, phased = VARIANTS[variant]
    cuda = torch.cuda.is_available()
    from floor import near_empty_step

    empty, sync = near_empty_step(cuda)
    if work == "empty":
        fwd = bwd = opt = empty
    else:
        from overhead import make_workload
        fwd, bwd, opt = make_workload(256, 64)
    log = os.path.join(os.path.dirname(out), "run.jsonl")
    prof = _make_profiler(log, **settings) if settings is not None else None

    def step() -> None:
        any_step(prof, phased, 64, fwd, bwd, opt)

    def timed_loop() -> tuple[int, float]:
        sync()
        t0 = time.perf_counter()
        n = 0
        while time.perf_counter() - t0 < seconds:
            for _ in range(100):
                step()
            n += 100
        sync()
        return n, time.perf_counter() - t0

    for _ in range(300):
        step()
    time.sleep(0.1)
    import gc
    gcs = {0: [0, 0], 1: [0, 0], 2: [0, 0]}
    t_gc = [0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            t_gc[0] = time.perf_counter_ns()
        else:
            g = gcs[info["generation"]]
            g[0] += 1
            g[1] += time.perf_counter_ns() - t_gc[0]

    gc.callbacks.append(on_gc)
    objs = len(gc.get_objects())
    a = threads_ns()
    n, elapsed = timed_loop()
    b = threads_ns()
    gc.callbacks.remove(on_gc)
    summary = prof.close() if prof is not None else None
    c = threads_ns()
    loop = {k: v / n for k, v in diff(a, b).items()}
    close = {k: v / n for k, v in diff(b, c).items()}
    with open(out, "w") as f:
        json.dump({"steps": n, "step_us": elapsed / n * 1e6, "loop_ns_per_step": loop,
                   "close_ns_per_step": close, "gc_objects": objs,
                   "gc": {g: {"count": v[0], "ns_per_step": v[1] / n} for g, v in gcs.items()},
                   "overhead_us_mean": getattr(summary, "overhead_us_mean", None),
                   "boundary": getattr(summary, "boundary", None)}, f)


def fn(frame: str) -> str:
    """A frame without its line number: 'func (file:123)' -> 'func (file)'."""
    head, sep, tail = frame.rpartition(":")
    if sep and tail.rstrip(")").isdigit():
        return head + ")"
    return frame


def aggregate(raw: str, top: int = 30) -> dict:
    per_thread: dict[str, int] = collections.Counter()
    selfc: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    incl: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in open(raw):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")
        n = int(count)
        th = frames[0]
        per_thread[th] += n
        if len(frames) > 1:
            selfc[th][fn(frames[-1])] += n
        seen = set()
        for f in frames[1:]:
            key = fn(f)
            if key in seen:
                continue
            seen.add(key)
            if "stepprof" in f or "timed_loop" in f:
                incl[th][key] += n
    out = {}
    for th, tot in per_thread.most_common():
        out[th] = {"samples": tot,
                   "self": selfc[th].most_common(top),
                   "incl": incl[th].most_common(top)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", default="step", choices=list(VARIANTS))
    ap.add_argument("--work", default="empty", choices=("empty", "launch"))
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--spy", default=None)
    ap.add_argument("--native", action="store_true")
    ap.add_argument("--rate", type=int, default=997)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None)
    ap.add_argument("--child-out", default=None)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.work, args.seconds, args.child_out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "c.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", args.variant, "--work", args.work,
               "--seconds", str(args.seconds), "--child-out", out]
        raw = os.path.join(tmp, "raw.txt")
        if args.spy:
            cmd = [args.spy, "record", "--threads", "--rate", str(args.rate), "--format", "raw", "--output", raw,
                   *(["--native"] if args.native else []), "--", *cmd]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL if args.spy else None, cwd=ROOT)
        res = json.load(open(out))
        if args.spy:
            res["spy"] = aggregate(raw)
    print(f"== {args.variant} / {args.work}: {res['steps']} steps, {res['step_us']:.1f} µs/step, "
          f"overhead_us_mean {res['overhead_us_mean']}, boundary {res['boundary']}")
    print(f"   gc: {res['gc_objects']} objects; " + ", ".join(
        f"gen{g} {v['count']}x {v['ns_per_step'] / 1e3:.2f} µs/step" for g, v in res["gc"].items()))
    for k, v in sorted(res["loop_ns_per_step"].items(), key=lambda kv: -kv[1]):
        if v > 50:
            print(f"   loop  {k:40s} {v / 1e3:9.2f} µs/step")
    for k, v in sorted(res["close_ns_per_step"].items(), key=lambda kv: -kv[1]):
        if v > 50:
            print(f"   close {k:40s} {v / 1e3:9.2f} µs/step")
    for th, d in res.get("spy", {}).items():
        print(f"  -- {th}: {d['samples']} samples")
        print("     self:")
        for f, n in d["self"][:18]:
            print(f"      {n:7d} {f[:150]}")
        print("     inclusive (stepprof):")
        for f, n in d["incl"][:25]:
            print(f"      {n:7d} {f[:150]}")
    if args.json:
        import torch
        from _common import run_info

        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)"
        with open(args.json, "w") as f:
            json.dump({**run_info("long_loop.py", gpu=gpu), "variant": args.variant, "work": args.work, **res}, f, indent=1)


if __name__ == "__main__":
    main()
