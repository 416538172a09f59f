"""stepprof under DDP: per-rank logs and the straggler check.

    torchrun --nproc_per_node 2 examples/ddp_torchrun.py                 # NCCL on GPUs, else gloo on CPU
    torchrun --nproc_per_node 2 examples/ddp_torchrun.py --straggler 1   # rank 1 does extra work
    stepprof report ddp-example.rank*.jsonl                               # per-rank table, straggler

Each rank writes ``ddp-example.rank<R>.jsonl``; rank 0's log also holds the
``kind: "ranks"`` records (every ``--ranks-every`` steps).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import stepprof


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--ranks-every", type=int, default=10)
    ap.add_argument("--straggler", type=int, default=None, help="rank that does extra work in forward")
    ap.add_argument("--jsonl", default="ddp-example.jsonl",
                    help="log path (each rank writes <stem>.rank<R>.jsonl); not --log, which torchrun takes")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, local_rank = dist.get_rank(), int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    width, batch = (2048, 512) if cuda else (256, 64)
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())])
    model = torch.nn.parallel.DistributedDataParallel(net.to(device), device_ids=[local_rank] if cuda else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, width, device=device)
    w = torch.randn(width, width, device=device)
    slow = args.straggler == rank

    with stepprof.Profiler(args.jsonl, warmup=5, ranks_every=args.ranks_every) as prof:
        for _ in range(args.steps):
            with prof.step(batch_size=batch):
                with prof.measure("forward"):
                    if slow:  # the planted straggler: extra work before DDP's allreduce
                        if cuda:
                            y = x
                            for _ in range(20):
                                y = y @ w
                        else:
                            time.sleep(0.01)
                    loss = model(x).float().pow(2).mean()
                with prof.measure("backward"):
                    loss.backward()
                with prof.measure("optimizer"):
                    opt.step()
                    opt.zero_grad(set_to_none=True)
    if rank == 0:
        print(prof.summary)
        # The log is appended to: this run's records are the ones with its run_id.
        ours = (r for r in stepprof.read(prof.log, kind="ranks") if r.get("run_id") == prof.summary.run_id)
        for rec in ours:
            print(f"step {rec['step']}: straggler_rank={rec['straggler_rank']} "
                  f"basis={rec['straggler_basis']} excess_ms={rec['straggler_excess_ms']}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
