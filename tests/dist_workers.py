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
                            # Steps of 20 ms: the straggler rule's 10 % of the median step (2 ms)
                            # stays above a loaded 2-core machine's scheduling jitter.
                            with prof.measure("forward"):
                                time.sleep(0.01 + (0.03 if rank == planted else 0.0))
                            with prof.measure("backward"):
                                time.sleep(0.01)
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
                        # Long enough that 4 processes sharing 2 cores do not blur the step times.
                        time.sleep(0.02 + (0.04 if rank == slow else 0.0))
                        loss = model(x).square().mean()
                    with prof.measure("backward"):
                        loss.backward()
                    with prof.measure("optimizer"):
                        opt.step()
                        opt.zero_grad()
    finally:
        dist.destroy_process_group()


def nccl_ddp(rank: int, world: int, store: str, out: str, slow: int) -> None:
    """DDP on NCCL, one GPU per rank: ``slow`` does extra matmuls in forward (-1: none).

    Writes ``slow.jsonl``/``none.jsonl`` logs, and ``syncs.rank<R>.json``: the sync
    warnings torch raised over 30 steps with the exchange off and on (ranks_every=5).
    """
    import json
    import warnings

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        dev = torch.device("cuda", rank)
        torch.manual_seed(0)
        net = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(2048, 2048), torch.nn.ReLU())])
        model = torch.nn.parallel.DistributedDataParallel(net.to(dev), device_ids=[rank])
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randn(1024, 2048, device=dev)
        w = torch.randn(2048, 2048, device=dev) / 64

        def step(prof, extra: bool) -> None:
            with prof.step(batch_size=1024):
                with prof.measure("forward"):
                    if extra:
                        y = x
                        for _ in range(40):
                            y = y @ w
                    loss = model(x).pow(2).mean()
                with prof.measure("backward"):
                    loss.backward()
                with prof.measure("optimizer"):
                    opt.step()
                    opt.zero_grad(set_to_none=True)

        for name, planted in (("slow", slow), ("none", -1)):
            with stepprof.Profiler(os.path.join(out, f"{name}.jsonl"), warmup=5, ranks_every=10) as prof:
                for _ in range(60):
                    step(prof, rank == planted)
        counts = {}
        for every in (0, 5, 0, 5):
            with stepprof.Profiler(None, syncs="off", ranks_every=every) as prof:
                for _ in range(5):
                    step(prof, False)  # warm: the exchange's buffers are allocated here
                torch.cuda.synchronize()
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        for _ in range(30):
                            step(prof, False)
                    finally:
                        torch.cuda.set_sync_debug_mode(0)
                counts.setdefault(str(every), []).append(
                    sum("synchroniz" in str(w.message) for w in seen))
        with open(os.path.join(out, f"syncs.rank{rank}.json"), "w") as fh:
            json.dump(counts, fh)
    finally:
        dist.destroy_process_group()


def subgroup(rank: int, world: int, store: str, out: str, slow: int) -> None:
    """Ranks 1 and 2 exchange on a subgroup of their own; rank ``slow`` has longer steps.

    Rank 0 is outside the group and keeps no profiler.  Logs: ``sub``.
    """
    _init(rank, world, store)
    try:
        sub = dist.new_group([1, 2], backend="gloo")
        if rank != 0:
            with stepprof.Profiler(os.path.join(out, "sub.jsonl"), ranks_every=EVERY, group=sub) as prof:
                for _ in range(STEPS):
                    with prof.step():
                        time.sleep(0.004 + (0.012 if rank == slow else 0.0))
        dist.barrier()
    finally:
        dist.destroy_process_group()
