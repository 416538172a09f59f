"""Shared helpers of the sweep tests: a synthetic step on a fake device and clock."""

from __future__ import annotations

from stepprof._sweep.search import sweep_on

from .fakes import FakeSweepGpu, SyntheticStep

GB = 10**9


def run(step, gpu, **kw):
    kw.setdefault("progress", False)
    return sweep_on(gpu, gpu.clock, step, step.make_batch, **kw)


def setup(capacity=40 * GB, usable=0.985, **kw):
    gpu = FakeSweepGpu(capacity=capacity)
    step = SyntheticStep(gpu, usable=int(usable * capacity), **kw)
    return gpu, step


def by_trial(result):
    return sorted(result.points, key=lambda p: p.trial)


def expected_knee(step, sizes, within=0.10):
    sps = {n: n / step.ms(n) for n in sizes}
    best = max(sps.values())
    return min(n for n in sizes if sps[n] >= (1 - within) * best)
