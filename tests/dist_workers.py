"""Worker processes for tests/test_dist.py: small CPU step loops on the gloo backend.

Kept apart from the test module so that a spawned child imports only this file.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import stepprof

STEPS = 15
EVERY = 5
WARMUP = 2


def _init(rank: int, world: int, store: str) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def independent(rank: int, world: int, store: str, out: str, slow: int) -> None:
    """No collective inside the step: rank ``slow`` sleeps longer, so its steps are longer.

    Logs: ``slow`` (rank ``slow`` planted; rank 1 also raises in step 7), ``none`` (no
    planted delay) and ``zero`` (log_ranks="zero").
    """
    _init(rank, world, store)
    try:
        for name, planted in (("slow", slow), ("none", -1)):
            with stepprof.Profiler(os.path.join(out, f"{name}.jsonl"), warmup=WARMUP,
                                   ranks_every=EVERY) as prof:
                for i in range(STEPS):
                    try:
                        with prof.step(batch_size=4):
                            with prof.measure("forward"):
                                time.sleep(0.004 + (0.012 if rank == planted else 0.0))
                            with prof.measure("backward"):
                                time.sleep(0.004)
                            if name == "slow" and rank == 1 and i == 7:
                                raise ValueError("planted")
                    except ValueError:
                        pass
        with stepprof.Profiler(os.path.join(out, "zero.jsonl"), ranks_every=EVERY,
                               log_ranks="zero") as prof:
            for _ in range(EVERY):
                with prof.step():
                    time.sleep(0.001)
    finally:
        dist.destroy_process_group()


def lockstep(rank: int, world: int, store: str, out: str, slow: int) -> None:
    """DDP on gloo: the allreduce in backward aligns the ranks; rank ``slow`` sleeps in forward."""
    _init(rank, world, store)
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        model = torch.nn.parallel.DistributedDataParallel(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(8, 16)
        with stepprof.Profiler(os.path.join(out, "ddp.jsonl"), warmup=WARMUP, ranks_every=EVERY) as prof:
            for _ in range(STEPS):
                with prof.step(batch_size=8):
                    with prof.measure("forward"):
                        time.sleep(0.004 + (0.016 if rank == slow else 0.0))
                        loss = model(x).square().mean()
                    with prof.measure("backward"):
                        loss.backward()
                    with prof.measure("optimizer"):
                        opt.step()
                        opt.zero_grad()
    finally:
        dist.destroy_process_group()
