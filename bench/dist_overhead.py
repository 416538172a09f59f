"""stepprof's overhead on a DDP step, with and without the cross-rank exchange.

    torchrun --nproc_per_node 2 bench/dist_overhead.py [--rounds 20] [--steps 30] [--out dist_overhead.json]
    torchrun --nproc_per_node 2 bench/dist_overhead.py --device cpu --rounds 3 --steps 5   # gloo smoke run

Two DDP steps (an 8-layer MLP with AdamW, as bench/overhead.py; bf16 on CUDA):
  compute-bound: 4096 wide, batch 4096;  launch-bound: 256 wide, batch 64.
Variants, interleaved in one shuffled order per round (the same order on every rank):
  bare       the DDP step as is (and bare-again, an A/A noise control);
  single     stepprof with forward/backward/optimizer phases, ranks_every=0: the
             single-GPU instrumentation (rank fields and per-rank logs only);
  exchange   the same with ranks_every=--every (default 10, to stress it).
Each round times K steps of one variant between a barrier plus a synchronisation and a
synchronisation.  Rank 0 prints the median µs/step, the median over rounds of each
variant's ratio to bare, and of exchange to single, with p10-p90.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import stepprof  # noqa: E402
from _common import run_info  # noqa: E402 - bench/ is on sys.path when a script in it runs
from overhead import make_workload, phased_step, quantiles  # noqa: E402


def make_ddp_workload(width: int, batch: int, device: torch.device):
    """bench/overhead.py's MLP step (bf16 on CUDA, fp32 on the CPU), wrapped in DDP."""
    torch.manual_seed(0)
    ids = [device.index] if device.type == "cuda" else None
    return make_workload(
        width, batch, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
        wrap=lambda net: torch.nn.parallel.DistributedDataParallel(net, device_ids=ids),
    )


def run(width, batch, rounds, k, every, device, tmp, name):
    fwd, bwd, opt = make_ddp_workload(width, batch, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    profs = {
        "single": stepprof.Profiler(os.path.join(tmp, f"{name}-single.jsonl"), ranks_every=0),
        "exchange": stepprof.Profiler(os.path.join(tmp, f"{name}-exchange.jsonl"), ranks_every=every),
    }

    def bare():
        fwd(); bwd(); opt()

    def phased(prof):
        return lambda: phased_step(prof, batch, fwd, bwd, opt)

    variants = {"bare": bare, "bare-again": bare, "single": phased(profs["single"]),
                "exchange": phased(profs["exchange"])}
    for fn in variants.values():
        for _ in range(every):  # warm-up; the exchange variant makes its first exchange here
            fn()
    sync()
    for p in profs.values():  # the warm-up's records, before any round
        p.flush()
    per_step = {v: [] for v in variants}
    rng = random.Random(0)  # the same order on every rank: the collectives must match
    for _ in range(rounds):
        order = list(variants)
        rng.shuffle(order)
        for v in order:
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            for _ in range(k):
                variants[v]()
            sync()
            if v in profs:  # this round's last records, before the clock stops (not in the next round)
                profs[v].flush()
            per_step[v].append((time.perf_counter() - t0) / k * 1e6)
    summaries = {v: p.close() for v, p in profs.items()}
    exchanges = len(list(stepprof.read(profs["exchange"].log, kind="ranks"))) if profs["exchange"].log else 0
    out = {"width": width, "batch": batch, "rounds": rounds, "steps_per_round": k, "ranks_every": every,
           "variants": {}}
    for v, xs in per_step.items():
        out["variants"][v] = {
            "us_per_step": quantiles(xs),
            "ratio_to_bare": quantiles([x / b for x, b in zip(xs, per_step["bare"])]),
        }
    out["exchange_over_single"] = quantiles([e / s for e, s in zip(per_step["exchange"], per_step["single"])])
    out["stepprof_overhead_us_median"] = {v: s.overhead_us_median for v, s in summaries.items()}
    out["ranks_records_rank0"] = exchanges
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=30, help="steps per variant per round")
    ap.add_argument("--every", type=int, default=10, help="ranks_every of the exchange variant")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--workloads", default="compute-bound,launch-bound")
    ap.add_argument("--out", default="dist_overhead.json")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    local = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = {"compute-bound": (4096, 4096), "launch-bound": (256, 64)}
    if not cuda:
        sizes = {"compute-bound": (256, 128), "launch-bound": (64, 16)}
    results = {**run_info("dist_overhead.py", gpu=torch.cuda.get_device_name() if cuda else "cpu"),
               "world_size": world, "backend": dist.get_backend(), "workloads": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.workloads.split(","):
            width, batch = sizes[name]
            results["workloads"][name] = run(width, batch, args.rounds, args.steps, args.every, device, tmp, name)
    if rank == 0:
        print(f"{results['gpu']} x{world} ({results['backend']}), torch {results['torch']}, "
              f"{args.rounds} interleaved rounds x {args.steps} steps, exchange every {args.every} steps")
        print(f"{'workload':14s} {'variant':11s} {'µs/step':>9s} {'ratio':>7s} {'p10-p90':>15s}")
        for name, w in results["workloads"].items():
            for v, r in w["variants"].items():
                rt = r["ratio_to_bare"]
                print(f"{name:14s} {v:11s} {r['us_per_step']['median']:9.1f} {rt['median']:7.4f} "
                      f"{rt['p10']:.4f}-{rt['p90']:.4f}")
            e = w["exchange_over_single"]
            print(f"{name:14s} exchange/single {e['median']:.4f} (p10 {e['p10']:.4f}, p90 {e['p90']:.4f}); "
                  f"{w['ranks_records_rank0']} ranks records")
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=2)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
