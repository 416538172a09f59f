"""What ops cost after an explained step: explain_peak=True against explain_peak=False, in fresh
processes, interleaved.

A RecordFunction callback or an allocator history left on after the explained step would be
process-wide: it would slow every later op, the bare loop's too, so an in-process comparison
(bench/overhead.py) cannot see it, and two stretches of host time in one process drift apart by
tens of percent on a shared machine.  Here each round runs two fresh processes in a shuffled
order: both train 2 steps of a transformer block under a Profiler, one with explain_peak=True
(its second step explained), one without; then each times 2,000 tiny allocating ops in
``record_function`` ranges (the fastest of 11 runs).  The table gives the per-round ratio
explain / plain: its median and its spread.

    python bench/explain_after.py [--rounds 6] [--out explain_after.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys

CHILD = r"""
import sys, time, torch, stepprof
explain = sys.argv[1] == "1"
torch.manual_seed(0)
block = torch.nn.TransformerEncoderLayer(256, 4, batch_first=True).cuda()
opt = torch.optim.SGD(block.parameters(), lr=1e-3)
x = torch.randn(2, 128, 256, device="cuda")
with stepprof.Profiler(None, warmup=1, explain_peak=explain, model=block, optimizer=opt) as prof:
    for _ in range(2):
        with prof.step():
            block(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
if explain:
    assert prof._peak.explanation.bytes_by_category is not None
tiny = torch.zeros(16, device="cuda")
def run(n=2000):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        with torch.autograd.profiler.record_function("tiny"):
            y = tiny + 1
    torch.cuda.synchronize()
    return time.perf_counter() - t0
for _ in range(3):
    run()
print(min(run() for _ in range(11)) * 1e3)
"""


def child(explain: bool) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD, "1" if explain else "0"], capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", default="explain_after.json")
    a = ap.parse_args()
    import torch

    rng = random.Random(0)
    rows = []
    for r in range(a.rounds):
        order = [True, False]
        rng.shuffle(order)
        got = {e: child(e) for e in order}
        rows.append({"round": r, "explain_ms": got[True], "plain_ms": got[False],
                     "ratio": got[True] / got[False]})
        print(f"round {r}: explain {got[True]:.2f} ms, plain {got[False]:.2f} ms, ratio {got[True] / got[False]:.3f}")
    ratios = sorted(row["ratio"] for row in rows)
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rounds": rows,
           "ratio_median": statistics.median(ratios), "ratio_min": ratios[0], "ratio_max": ratios[-1]}
    print(f"ratio explain/plain: median {out['ratio_median']:.3f} (min {ratios[0]:.3f}, max {ratios[-1]:.3f})")
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
