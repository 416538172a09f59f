"""stepprof's share of the training thread in a host-bound training loop, by sampling (py-spy).

On a host-bound (launch-bound) loop the training thread is the critical path: every µs it spends
in stepprof's code delays the next launch.  The wall-time ratio of bench/overhead.py measures
the whole cost, but on a shared host its rounds spread by ±15 %, so it cannot tell 1 % from
3 %.  This script measures the training thread's part another way: py-spy samples the process
at ``--rate`` Hz without pausing it (``--nonblocking``), and the share of the training thread's
samples inside the loop whose stack is in stepprof's code (a C++ boundary call counts: its
Python caller is stepprof's) is stepprof's share of that thread's time, with a binomial 95 %
interval; times the step time, it is µs a step.  stepprof's own threads (collector, energy) are
given as their samples over the training thread's: roughly their CPU a step.

What it does not see: the training thread waiting for the GIL that stepprof's threads hold
(torch lets go of the GIL inside each op, so those threads mostly run in between; py-spy counts
such a wait as idle), and indirect effects (caches stepprof evicts).  So the training thread's
share is a lower bound of what the loop loses; bench/overhead.py's ratio includes the rest.

Each variant runs the launch-bound step (8-layer bf16 MLP, 256 wide, batch 64, AdamW) for
``--seconds`` in a child process of its own, under ``py-spy record``; only the samples inside
the loop count (not the imports, the model's construction or close()).  Needs CUDA and
py-spy (``pip install py-spy``).

    python bench/inloop_share.py [--seconds 8] [--rate 199] [--variants 'step,3 phases,...'] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

#: Profiler settings and phases per variant.
VARIANTS = {
    "step": ({}, False),
    "3 phases": ({}, True),
    "step budget=0.01": ({"overhead_budget": 0.01}, False),
    "3 phases budget=0.01": ({"overhead_budget": 0.01}, True),
    "step python": ({"boundary": "python"}, False),
    "step energy off": ({"energy_every_s": None}, False),
}
#: The function the child's loop runs in: only samples under it count.
LOOP = "timed_loop"
STEPPROF_DIR = os.sep + "stepprof" + os.sep


def child(variant: str, seconds: float, out: str) -> None:
    """The loop, in the sampled process: warm up, then ``seconds`` of steps; write the step time."""
    import torch

    from overhead import any_step, make_workload
    from stepprof._recorder.profiler import _make_profiler

    settings, phased = VARIANTS[variant]
    fwd, bwd, opt = make_workload(256, 64)
    log = os.path.join(os.path.dirname(out), "run.jsonl")
    prof = _make_profiler(log, **settings) if variant != "bare" else None

    def step() -> None:
        any_step(prof, phased, 64, fwd, bwd, opt)

    def timed_loop() -> tuple[int, float]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        n = 0
        while time.perf_counter() - t0 < seconds:
            step()
            n += 1
        torch.cuda.synchronize()
        return n, time.perf_counter() - t0

    for _ in range(200):
        step()
    n, elapsed = timed_loop()
    summary = prof.close() if prof is not None else None
    with open(out, "w") as f:
        json.dump({"steps": n, "step_us": elapsed / n * 1e6,
                   "overhead_us_mean": getattr(summary, "overhead_us_mean", None),
                   "boundary": getattr(summary, "boundary", None)}, f)


def _wilson(k: int, n: int) -> tuple[float, float]:
    """The 95 % Wilson interval of a proportion k/n."""
    if n == 0:
        return (math.nan, math.nan)
    z, p = 1.96, k / n
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (mid - half, mid + half)


def shares(raw: str) -> dict:
    """From py-spy's raw output: the training thread's samples in the loop, how many of them
    are in stepprof's code, and the samples of each of stepprof's own threads."""
    total = ours = 0
    others: dict[str, int] = {}
    for line in open(raw):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        frames = stack.split(";")
        n = int(count)
        if "MainThread" in frames[0]:
            if not any(f.split(" (")[0].endswith(LOOP) for f in frames):
                continue  # outside the timed loop
            total += n
            if any("(stepprof/" in f or STEPPROF_DIR in f for f in frames[1:]):
                ours += n
        elif any("(stepprof/" in f or STEPPROF_DIR in f for f in frames):
            name = frames[0].split(": ", 1)[-1]
            others[name] = others.get(name, 0) + n
    return {"samples": total, "stepprof": ours, "threads": others}


def run(variant: str, seconds: float, rate: int, spy: str, tmp: str) -> dict:
    raw, out = os.path.join(tmp, "raw.txt"), os.path.join(tmp, "child.json")
    cmd = [spy, "record", "--threads", "--nonblocking", "--rate", str(rate), "--format", "raw", "--output", raw,
           "--", sys.executable, os.path.abspath(__file__), "--child", variant, "--seconds", str(seconds),
           "--child-out", out]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    with open(out) as f:
        result = json.load(f)
    result.update(shares(raw))
    k, n = result["stepprof"], result["samples"]
    lo, hi = _wilson(k, n)
    result["share"], result["share_95"] = (k / n if n else math.nan), [lo, hi]
    result["stepprof_us_per_step"] = result["share"] * result["step_us"]
    result["threads_us_per_step"] = {t: c / n * result["step_us"] for t, c in result["threads"].items()} if n else {}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rate", type=int, default=199, help="samples a second (a prime: no beat with the step)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", default=None)
    ap.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.child, args.seconds, args.child_out)
        return
    from _common import run_info

    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        sys.exit(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    results = {}
    print(f"{'variant':22s} {'step µs':>8s} {'training thread in stepprof':>29s} {'µs/step':>8s} "
          f"{'overhead_us_mean':>16s}  stepprof's threads, µs/step")
    for v in names:
        with tempfile.TemporaryDirectory() as tmp:
            r = results[v] = run(v, args.seconds, args.rate, args.py_spy, tmp)
        lo, hi = r["share_95"]
        mean = r["overhead_us_mean"]
        print(f"{v:22s} {r['step_us']:8.0f} {r['share']:14.2%} ({lo:.2%}-{hi:.2%}) "
              f"{r['stepprof_us_per_step']:8.1f} {mean if mean is None else round(mean, 1)!s:>16s}  "
              + ", ".join(f"{t} {us:.1f}" for t, us in sorted(r["threads_us_per_step"].items())))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**run_info("inloop_share.py"), "seconds": args.seconds, "rate": args.rate,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
