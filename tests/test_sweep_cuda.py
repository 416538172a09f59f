"""stepprof.sweep on a real GPU: real out-of-memory errors, memory back to the byte, event timing."""

from __future__ import annotations

import contextlib
import gc
import time

import pytest
import torch

import stepprof

pytestmark = pytest.mark.cuda


@contextlib.contextmanager
def usable_memory(gib: float):
    """Cap torch's allocator at ``gib`` GiB for the block (the OOMs stay real allocator OOMs)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    old = get() if get is not None else 1.0
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total))
    try:
        yield
    finally:
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(old)


def mlp_classifier(width=1024, depth=6, classes=100):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, classes)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train_step(batch):
        x, y = batch
        opt.zero_grad()                      # at the start: the gradients stay allocated after
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    def make_batch(n):                       # realistic: random features, random labels
        return torch.randn(n, width, device="cuda"), torch.randint(0, classes, (n,), device="cuda")

    return model, opt, train_step, make_batch


def test_real_model_sweeps_into_real_ooms_and_memory_returns_to_the_byte(tmp_path):
    model, opt, train_step, make_batch = mlp_classifier()
    train_step(make_batch(64))               # optimizer state, gradients, cuBLAS workspaces exist
    torch.cuda.synchronize()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    # Garbage of earlier tests in this process (a Trainer's reference cycles holding a model on
    # the GPU) would be collected by the sweep's own gc.collect() and count as memory it freed.
    gc.collect()
    with usable_memory(3.0):
        before = torch.cuda.memory_allocated()
        ooms_before = torch.cuda.memory_stats()["num_ooms"]
        t0 = time.perf_counter()
        r = stepprof.sweep(train_step, make_batch, restore=(model, opt), log=tmp_path / "sweep.jsonl")
        wall = time.perf_counter() - t0
        after = torch.cuda.memory_allocated()
        ooms = torch.cuda.memory_stats()["num_ooms"] - ooms_before
    print(r, f"\nwall {wall:.1f} s")
    assert r.device.startswith("cuda")
    assert after == before, f"memory_allocated {after} after the sweep, {before} before"
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    # Real allocator OOMs, each cleaned up to the pre-trial baseline.
    oom_points = [p for p in r.points if p.oom]
    assert oom_points and ooms >= len(oom_points)
    assert all(p.leaked_bytes == 0 for p in oom_points), [p.leaked_bytes for p in oom_points]
    assert all("out of memory" in p.error for p in oom_points)
    # max_fit ran and a batch at most 3% larger did not.
    assert r.stopped == "boundary"
    assert r.first_oom <= r.max_fit * 103 // 100 + 1
    assert r.predicted_max is not None and r.knee is not None and r.recommended is not None
    assert len([p for p in r.points if p.phase == "refine"]) <= 10   # a performance bound, loosely
    assert len(list(stepprof.read(tmp_path / "sweep.jsonl", kind="sweep_point"))) == r.trials
    # The event-timed median agrees with an independent synchronised span at the recommended batch.
    n = r.recommended
    batch = make_batch(n)
    for _ in range(2):
        train_step(batch)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        train_step(batch)
    torch.cuda.synchronize()
    independent_ms = (time.perf_counter() - t0) / 10 * 1e3
    assert r.point(n).step_ms == pytest.approx(independent_ms, rel=0.15)


def test_twenty_forced_ooms_in_a_row_leak_nothing():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256)).cuda()

    def train_step(x):
        hidden = model(x).relu()             # real activations, saved for backward, held by this frame
        torch.empty(2**50, dtype=torch.uint8, device="cuda")   # 1 PiB: always out of memory
        hidden.sum().backward()              # never reached

    model(torch.randn(4, 256, device="cuda")).sum().backward()   # cuBLAS workspaces, gradients
    torch.cuda.synchronize()
    # Earlier tests' reference cycles may still hold CUDA tensors; the sweep's OOM clean-up
    # collects them, so collect them first, or they would count as memory the sweep freed.
    gc.collect()
    before = torch.cuda.memory_allocated()
    ooms_before = torch.cuda.memory_stats()["num_ooms"]
    # start=2**19 and every batch failing: 2**19, 2**18, ..., 1 is twenty OOMs in a row.
    r = stepprof.sweep(train_step, lambda n: torch.randn(n, 256, device="cuda"), start=2**19,
                       progress=False)
    assert [p.batch_size for p in sorted(r.points, key=lambda p: p.trial)] == [2**k for k in range(19, -1, -1)]
    assert all(p.oom for p in r.points) and r.trials == 20
    assert torch.cuda.memory_stats()["num_ooms"] - ooms_before == 20
    assert all(p.leaked_bytes == 0 for p in r.points), [p.leaked_bytes for p in r.points]
    assert r.stopped == "no_fit" and r.max_fit is None and r.recommended is None
    assert torch.cuda.memory_allocated() == before
