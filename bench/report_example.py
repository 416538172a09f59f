"""The H200 example for docs/report.md: a real log, its report and (where matplotlib is) its plot.

Trains bench/overhead.py's compute-bound step (8-layer 4096-wide bf16 MLP, batch 4096,
AdamW) for 300 steps under ``Profiler(flops="auto")`` with a ``loss.item()`` every step,
as a typical loop logs its loss, then writes ``report.txt`` and ``report.json`` (and
``steps.png`` if matplotlib is installed) next to the log.  Run ``stepprof calibrate``
first, or the roofline and MFU are null with the reason.  About 10 s on an H200.

    python -m stepprof calibrate && python bench/report_example.py --out OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
import torch  # noqa: E402

import stepprof  # noqa: E402
from overhead import make_workload  # noqa: E402
from stepprof._report import build_report, render  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    log = os.path.join(args.out, "train.jsonl")
    if os.path.exists(log):
        os.remove(log)
    fwd, bwd, opt = make_workload(4096, 4096)
    state = {}
    with stepprof.Profiler(log, warmup=3, flops="auto", memory_every=100) as prof:
        for _ in range(args.steps):
            with prof.step(batch_size=4096):
                with prof.measure("forward"):
                    fwd()
                with prof.measure("backward"):
                    bwd()
                with prof.measure("optimizer"):
                    opt()
                state["loss"] = float(torch.ones((), device="cuda").item())  # the per-step loss.item()
    torch.cuda.synchronize()
    print(prof.summary)
    report = build_report([log])
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report.to_dict(), f, indent=1)
    text = render(report)
    with open(os.path.join(args.out, "report.txt"), "w") as f:
        f.write(text)
    print(text)
    try:
        from stepprof._plot import plot_log

        plot_log(log, os.path.join(args.out, "steps.png"))
    except stepprof.StepprofError as e:
        print(f"no plot here: {e}")


if __name__ == "__main__":
    main()
