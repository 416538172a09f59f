"""What the energy sampler costs the step it runs beside: the compute-bound step of
bench/overhead.py, bare, in blocks with stepprof's energy sampler thread running (reading NVML's
total-energy counter every ``--every-s``) and blocks without it, alternated in a shuffled order.
Each block is long enough for several reads.  Prints the median ratio of the blocks with the
sampler to the next block without it, with its 95% interval, and writes JSON.

    python bench/energy_cost.py [--blocks 12] [--steps 200] [--every-s 0.5] [--out energy_cost.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stepprof._device.cuda import CudaBackend  # noqa: E402
from stepprof._recorder.energy import Sampler, open_counter  # noqa: E402
from _common import run_info  # noqa: E402
from overhead import make_workload, median_ci  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=12, help="blocks of each kind")
    ap.add_argument("--steps", type=int, default=200, help="steps per block")
    ap.add_argument("--every-s", type=float, default=0.5)
    ap.add_argument("--out", default="energy_cost.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/energy_cost.py needs CUDA; nothing measured")
        return 0
    fwd, bwd, opt = make_workload(4096, 4096)
    backend = CudaBackend(torch.cuda.current_device(), nvtx=False, syncs="off")

    def block(sampling: bool) -> tuple[float, int]:
        sampler = Sampler(backend, args.every_s, time.perf_counter_ns, open_counter) if sampling else None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            fwd(); bwd(); opt()
        torch.cuda.synchronize()
        us = (time.perf_counter() - t0) / args.steps * 1e6
        reads = 0
        if sampler is not None:
            sampler._stop.set()
            sampler.thread.join()
            reads = len(sampler.times)
            if sampler.reason:
                print(f"sampler: {sampler.reason}")
        return us, reads

    for _ in range(30):
        fwd(); bwd(); opt()
    order = [True, False] * args.blocks
    random.Random(0).shuffle(order)
    with_s: list[float] = []
    without: list[float] = []
    reads: list[int] = []
    ratios: list[float] = []
    last_without: float | None = None
    pending: list[float] = []
    for sampling in order:
        us, n = block(sampling)
        if sampling:
            with_s.append(us)
            reads.append(n)
            pending.append(us)
        else:
            without.append(us)
            last_without = us
            ratios.extend(x / us for x in pending)  # each sampled block against the next bare one
            pending = []
    if pending and last_without is not None:
        ratios.extend(x / last_without for x in pending)
    out = {
        **run_info("energy_cost.py"),
        "steps_per_block": args.steps,
        "every_s": args.every_s,
        "us_per_step_with": statistics.median(with_s),
        "us_per_step_without": statistics.median(without),
        "reads_per_block": statistics.median(reads),
        "ratio_median": statistics.median(ratios),
        "ratio_ci95": median_ci(ratios),
    }
    print(f"{out['gpu']}, torch {out['torch']}: compute-bound step {out['us_per_step_without']:.1f} µs; "
          f"with the sampler {out['us_per_step_with']:.1f} µs ({out['reads_per_block']:g} reads a block); "
          f"ratio {out['ratio_median']:.4f} (95% CI {out['ratio_ci95'][0]:.4f}-{out['ratio_ci95'][1]:.4f})")
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
