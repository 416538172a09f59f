"""Distributed on real GPUs: 2 NCCL processes with DDP (skipped without 2 CUDA devices)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp

import stepprof

from . import dist_workers

pytestmark = pytest.mark.cuda

needs_two = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"
)


@pytest.fixture(scope="module")
def nccl_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nccl")
    mp.spawn(dist_workers.nccl_ddp, args=(2, str(tmp / "store"), str(tmp), 1), nprocs=2)
    return tmp


@needs_two
def test_extra_gpu_work_in_forward_is_named(nccl_run):
    for rank in (0, 1):
        recs = list(stepprof.read(str(nccl_run / f"slow.rank{rank}.jsonl")))
        assert all((r["rank"], r["world_size"]) == (rank, 2) for r in recs)
    ranks = list(stepprof.read(str(nccl_run / "slow.rank0.jsonl"), kind="ranks"))
    assert len(ranks) == 6
    # The first window may hold no measured step yet (warm-up, events still pending).
    named = [(r["straggler_rank"], r["straggler_basis"]) for r in ranks[1:]]
    assert named == [(1, "forward")] * len(named), [r["unavailable"] for r in ranks]
    assert all(r["step_basis"] == "gpu_ms" for r in ranks[1:])


@needs_two
def test_no_straggler_without_planted_work(nccl_run):
    ranks = list(stepprof.read(str(nccl_run / "none.rank0.jsonl"), kind="ranks"))
    assert [r["straggler_rank"] for r in ranks] == [None] * len(ranks), [r["unavailable"] for r in ranks]


@needs_two
def test_the_exchange_adds_no_host_sync(nccl_run):
    # DDP itself may sync (it does not in this loop, but a torch version could), so the
    # exchange is judged by the difference: torch's sync-debug warnings over the same 30
    # steps with ranks_every=0 and ranks_every=5 (6 exchanges), twice each.
    for rank in (0, 1):
        counts = json.loads((nccl_run / f"syncs.rank{rank}.json").read_text())
        assert counts["5"] == counts["0"], counts
