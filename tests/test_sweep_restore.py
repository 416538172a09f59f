"""stepprof._sweep.restore: the user's state put back, and profiling muted during the sweep."""

from __future__ import annotations

import torch

import stepprof
from stepprof._sweep.search import sweep_on

from .sweep_helpers import setup


def test_restore_puts_weights_optimizer_state_and_grads_back():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()                                      # the optimizer has state; grads are set
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}
    grads = [p.grad.clone() for p in model.parameters()]
    rng = torch.get_rng_state()

    def train_step(batch):
        xb, yb = batch
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()

    def make_batch(n):
        return torch.randn(n, 8), torch.randint(0, 3, (n,))

    stepprof.sweep(train_step, make_batch, start=2, max_batch=32, restore=(model, opt),
                   progress=False, min_time_s=0)
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    for i, s in opt.state_dict()["state"].items():
        for k, v in s.items():
            assert torch.equal(v, moments[i][k]), (i, k)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert torch.equal(torch.get_rng_state(), rng)   # the sweep's random draws are undone
    # Without restore the sweep trains the model.
    stepprof.sweep(train_step, make_batch, start=2, max_batch=4, progress=False, min_time_s=0)
    assert not torch.equal(model[0].weight, weights["0.weight"])


def test_profile_step_inside_train_step_records_nothing_during_the_sweep(log):
    gpu, step = setup()

    @stepprof.measure
    def train_step(batch):
        with stepprof.measure("inner"):
            step(batch)

    with stepprof.Profiler(log) as prof:
        sweep_on(gpu, gpu.clock, train_step, step.make_batch, max_batch=64, progress=False)
        train_step(step.make_batch(4))           # after the sweep, recording works again
    assert prof.summary.steps == 1
