"""Energy per step on a real GPU (an H200), alone on it: the steps' energy_j against NVML's
counter read directly, and the figures' plausibility.

Over a window of compute-bound steps (bench/overhead.py's 4096-wide MLP), the sum of energy_j
against the counter's own difference read directly around the window.  The window's two ends are
interpolated between samples 0.5 s apart, so the loop runs before and after it at the same load
(warm-up, and 40 steps after), where the interpolation holds.
"""

from __future__ import annotations

import importlib
import os
import statistics
import threading
import time

import pytest
import torch

import stepprof
from stepprof._device import nvml as _nvml
from stepprof._device.cuda import CudaBackend

pytestmark = pytest.mark.cuda

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def _workload(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)
    return importlib.import_module("overhead").make_workload(4096, 4096)


def _counter():
    """NVML's energy counter of torch's current device, read directly (mJ)."""
    uuid, pci = CudaBackend(torch.cuda.current_device(), nvtx=False).identity()
    read, why = _nvml.energy_counter(uuid, pci)
    assert read is not None, why
    return read


def _refresh_s(read, fwd, bwd, opt) -> float:
    """How often the driver refreshes the energy counter under this load: the median time
    between two changes of the value, over about 0.6 s of direct reads."""
    changes, last = [], None
    t_end = time.perf_counter() + 0.6
    while time.perf_counter() < t_end:
        fwd(), bwd(), opt()
        value, _ = read()
        now = time.perf_counter()
        if value != last:
            changes.append(now)
            last = value
    torch.cuda.synchronize()
    gaps = [b - a for a, b in zip(changes[1:], changes[2:])]  # (the first change is the first read)
    return statistics.median(gaps) if gaps else 0.6


def _step(prof, fwd, bwd, opt):
    with prof.step(batch_size=4096):
        fwd()
        bwd()
        opt()


@pytest.mark.parametrize("n", [200, 1000])
def test_a_window_of_steps_sums_to_the_counter(tmp_path, monkeypatch, n):
    """200 steps (1.4 s on an H200) is the issue's window.  The driver refreshes the counter in
    jumps, which the direct reads see too, so each end of the window can be off by up to one
    refresh's energy: the check allows 2 % plus two refresh periods over the window (measured on
    an H200: -0.3 %, -0.8 %, -5.3 %, -5.5 %; on an H100: +7.2 %, +0.6 %, -6.2 %)."""
    fwd, bwd, opt = _workload(monkeypatch)
    read = _counter()
    refresh_s = _refresh_s(read, fwd, bwd, opt)
    log = str(tmp_path / "energy.jsonl")
    with stepprof.Profiler(log, warmup=80) as prof:
        for _ in range(80):  # NVML is already up (_counter): the sampler's first sample comes early
            _step(prof, fwd, bwd, opt)
        torch.cuda.synchronize()
        e0, why = read()
        assert e0 is not None, why
        t0 = time.perf_counter()
        first = prof._boundaries.next_index
        for _ in range(n):
            _step(prof, fwd, bwd, opt)
        torch.cuda.synchronize()
        e1, why = read()
        assert e1 is not None, why
        window_s = time.perf_counter() - t0
        for _ in range(40):  # the load goes on past the window's end, as before its start
            _step(prof, fwd, bwd, opt)
        sampler = prof._energy.sampler
    assert sampler is not None and sampler.thread.name == "stepprof-energy"
    assert threading.current_thread().name != "stepprof-energy"
    recs = {r["step"]: r for r in stepprof.read(log, kind="step")}
    window = [recs[i] for i in range(first, first + n)]
    assert all(r["energy_j"] is not None for r in window), window[0]["unavailable"]
    total = sum(r["energy_j"] for r in window)
    direct = (e1 - e0) / 1e3
    rel = 0.02 + 2 * refresh_s / window_s
    print(f"{n} steps: energy_j sum {total:.1f} J, NVML directly {direct:.1f} J ({total / direct - 1:+.2%}); "
          f"the counter refreshes every {refresh_s * 1e3:.0f} ms: allowed {rel:.1%}")
    assert rel < 0.15, f"the counter refreshes every {refresh_s:.3f} s: a {window_s:.1f} s window cannot tell"
    assert total == pytest.approx(direct, rel=rel)


def test_energy_is_positive_and_the_power_within_the_limit(tmp_path, monkeypatch):
    fwd, bwd, opt = _workload(monkeypatch)
    log = str(tmp_path / "energy.jsonl")
    with stepprof.Profiler(log, warmup=10, energy_every_s=0.1) as prof:
        for _ in range(150):
            _step(prof, fwd, bwd, opt)
    memory = [r for r in stepprof.read(log) if r["kind"] == "memory"]
    limit = memory[-1]["power_limit_w"]
    assert limit is not None and 100 <= limit <= 1500, memory[-1]["unavailable"]
    measured = [r for r in stepprof.read(log, kind="step") if not r["warmup"] and r["energy_j"] is not None]
    assert len(measured) >= 100
    # One step's figure is an interpolation between the driver's refreshes of the counter: a
    # step inside a stretch it had not refreshed gets 0 J, the step where it catches up gets the
    # rest (docs/figures.md, "Energy"). Windows are exact: the run's power is within the limit.
    assert all(r["energy_j"] >= 0 and r["energy_span_ms"] >= 0 for r in measured)
    assert sum(r["energy_j"] > 0 for r in measured) >= len(measured) // 2
    span_s = sum(r["energy_span_ms"] for r in measured) / 1e3
    assert 30 <= sum(r["energy_j"] for r in measured) / span_s <= 1.1 * limit
    s = prof.summary
    assert 30 <= s.power_w_mean <= 1.1 * limit
    assert s.energy_j_per_step == pytest.approx(sum(r["energy_j"] for r in measured) / len(measured))
    assert s.samples_per_j == pytest.approx(4096 * len(measured) / sum(r["energy_j"] for r in measured))
    print(f"{s.energy_j_per_step:.3f} J/step, {s.power_w_mean:.0f} W (limit {limit:.0f} W), "
          f"{s.samples_per_j:.0f} samples/J")
