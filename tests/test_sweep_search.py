"""stepprof._sweep.search on a CPU: synthetic steps with known curves on a fake device and clock."""

from __future__ import annotations

import itertools
import logging
import math

import pytest
import torch

import stepprof
from stepprof._sweep.output import LOGGER
from stepprof._sweep.search import sweep_on
from stepprof._device.backend import HostSweepBackend

from .fakes import FakeGpu, FakeSweepGpu, SyntheticStep
from .sweep_helpers import GB, by_trial, expected_knee, run, setup


# -- the search on a known curve -----------------------------------------------------


def test_knee_max_fit_and_first_oom_on_a_known_curve():
    gpu, step = setup()
    r = run(step, gpu)
    assert r.stopped == "boundary"
    assert r.device == "cuda:0"
    true_max = step.true_max                                   # 3840
    assert r.max_fit <= true_max and (true_max - r.max_fit) / true_max <= 0.03
    assert r.first_oom == min(p.batch_size for p in r.points if p.oom)
    assert r.first_oom <= math.floor(r.max_fit * 1.03) + 1     # the bracket certifies the 3%
    # The memory fit predicted the boundary from the device capacity: refinement took two probes.
    assert r.predicted_max == (40 * GB - GB) // (10**7)
    refine = [p for p in by_trial(r) if p.phase == "refine"]
    assert [p.oom for p in refine] == [False, True]
    assert sum(p.oom for p in r.points) == 1
    ran = [p.batch_size for p in r.points if not p.oom]
    assert r.knee == expected_knee(step, ran) == 2048
    assert r.recommended == r.knee and r.thrash_zone is None
    # Figures of a point: median step time from the fake device's events, peak from its allocator.
    p = r.point(1024)
    assert p.step_ms == pytest.approx(step.ms(1024), rel=0.01)
    assert p.samples_per_s == pytest.approx(1024 / step.ms(1024) * 1e3, rel=0.01)
    assert p.peak_allocated_bytes == GB + 1024 * 10**7
    assert p.alloc_retries == 0 and p.timed_steps >= 3 and p.warmup_steps == 1
    assert p.step_ms_p10 <= p.step_ms <= p.step_ms_p90
    assert "Batch 2,048 gives" in r.reason and "within 10% of the best" in r.reason
    assert gpu.allocated == GB                                  # only the "weights" remain


@pytest.mark.parametrize("usable", [0.999, 0.97, 0.9, 0.8, 0.6])
def test_max_fit_within_3_percent_when_the_fit_is_optimistic(usable):
    gpu, step = setup(usable=usable)
    r = run(step, gpu)
    assert r.stopped == "boundary"
    assert 0 <= step.true_max - r.max_fit <= 0.03 * step.true_max
    refine = [p for p in r.points if p.phase in ("refine", "down")]
    assert len(refine) <= 7        # bisecting (2048, 4096) to 3% alone takes about 5


def test_quadrupling_while_linear_then_doubling_with_a_noisy_curve():
    gpu, step = setup(noise=0.05, seed=3)
    r = run(step, gpu)
    grow = [p.batch_size for p in by_trial(r) if p.phase == "grow"]
    assert grow[:3] == [1, 2, 8]           # 1 -> 2 (x2), then x4 while samples/s ~ linear
    ratios = [b / a for a, b in itertools.pairwise(grow)]
    assert set(ratios) <= {2, 4} and ratios[-1] == 2
    assert 0 <= step.true_max - r.max_fit <= 0.03 * step.true_max


def test_backfill_measures_a_skipped_size_that_could_be_the_knee():
    # Launch-bound up to 270 samples, then flat: the x4 jump from 128 to 512 skips 256,
    # and 256 could be within 10% of the best (2 x samples/s at 128 is), so it is measured
    # afterwards; it is the knee.
    gpu = FakeSweepGpu(capacity=40 * GB)
    step = SyntheticStep(gpu, fixed_ms=4.0, per_sample_ms=0.0005, usable=int(0.985 * 40 * GB))
    step_ms = step.ms

    def ms(n):  # flat until saturation at 270 samples, then linear: a sharp knee
        return max(step_ms(1), 4.0 * n / 270)

    step.ms = ms
    r = run(step, gpu)
    phases = {p.batch_size: p.phase for p in r.points}
    assert phases[128] == phases[512] == "grow" and phases[256] == "backfill"
    assert 64 not in phases and 16 not in phases  # skipped, and never within 10% of the best
    assert r.knee == expected_knee(step, [p.batch_size for p in r.points if not p.oom]) == 256


# -- thrash ---------------------------------------------------------------------------------


def test_thrash_zone_from_alloc_retries_is_never_recommended():
    # From batch 2,048 on, every step makes the allocator retry and runs 60% slower.
    gpu, step = setup(thrash_from=2048, thrash_factor=1.6)
    r = run(step, gpu)
    assert r.thrash_zone is not None and r.thrash_zone.start == 2048
    assert r.thrash_zone[-1] == r.max_fit
    assert r.recommended not in r.thrash_zone and r.recommended < 2048
    assert r.point(2048).alloc_retries > 0 and r.point(1024).alloc_retries == 0
    assert "thrash zone" in r.reason and "retried" in r.reason
    assert 0 <= step.true_max - r.max_fit <= 0.03 * step.true_max


def test_thrash_zone_from_a_throughput_drop_without_retries():
    gpu, step = setup()
    step_ms = step.ms
    step.ms = lambda n: step_ms(n) * (1.5 if n > 3000 else 1.0)   # slower near the limit
    r = run(step, gpu)
    assert r.thrash_zone is not None and r.thrash_zone.start > 3000
    assert r.knee == r.recommended and r.recommended not in r.thrash_zone
    assert "samples/s fell" in r.reason


# -- plateau, budget, max_batch, too large a start -------------------------------------------


def test_plateau_jumps_to_the_predicted_boundary():
    # Saturated from the start: the step time grows in proportion to the batch.
    gpu, step = setup(fixed_ms=0.0, per_sample_ms=0.01)
    r = run(step, gpu)
    grow = [p.batch_size for p in by_trial(r) if p.phase == "grow"]
    assert grow == [1, 2, 4]                  # two doublings without a 5% gain: a plateau
    assert r.stopped == "boundary" and r.first_oom is not None
    assert 0 <= step.true_max - r.max_fit <= 0.03 * step.true_max
    assert r.trials <= 6
    assert r.knee == 1 and r.recommended == 1


def test_plateau_without_memory_figures_stops_growth_and_says_so():
    gpu = FakeGpu()
    step = SyntheticStep(gpu, fixed_ms=0.0, per_sample_ms=0.01, usable=40 * GB)
    r = sweep_on(HostSweepBackend("fake host"), gpu.clock, step, step.make_batch, progress=False)
    assert r.stopped == "plateau" and r.first_oom is None and r.max_fit == 4
    assert r.predicted_max is None and "predicted_max" in r.unavailable
    assert any("was not searched" in n for n in r.notes)
    p = r.point(4)
    assert p.peak_allocated_bytes is None and "peak_allocated_bytes" in p.unavailable
    assert p.step_ms == pytest.approx(step.ms(4), rel=0.02)   # host clock spans


def test_plateau_without_memory_figures_grows_on_to_max_batch_when_given():
    # The plateau note says "pass max_batch to sweep further": with max_batch, growth goes on.
    gpu = FakeGpu()
    step = SyntheticStep(gpu, fixed_ms=0.0, per_sample_ms=0.01, usable=40 * GB)
    r = sweep_on(HostSweepBackend("fake host"), gpu.clock, step, step.make_batch, progress=False, max_batch=64)
    assert r.stopped == "max_batch" and r.max_fit == 64
    assert not any("was not searched" in n for n in r.notes)


def test_without_memory_figures_an_oom_is_bisected_to_3_percent():
    gpu = FakeGpu()
    step = SyntheticStep(gpu, usable=int(0.985 * 40 * GB))
    r = sweep_on(HostSweepBackend("fake host"), gpu.clock, step, step.make_batch, progress=False)
    assert r.stopped == "boundary"
    assert 0 <= step.true_max - r.max_fit <= 0.03 * step.true_max
    assert all(p.leaked_bytes is None for p in r.points if p.oom)


def test_max_batch_stops_growth_without_an_oom():
    gpu, step = setup()
    r = run(step, gpu, max_batch=100)
    assert r.stopped == "max_batch" and r.max_fit == 100 and r.first_oom is None
    assert [p.batch_size for p in r.points] == [1, 2, 8, 32, 64, 100]
    assert r.predicted_max == (40 * GB - GB) // 10**7
    assert r.recommended == 100
    assert "still rising" in r.reason and "max_batch=100" in r.reason


def test_time_budget_stops_the_search():
    gpu, step = setup()
    r = run(step, gpu, time_budget_s=0.3)      # fake seconds
    assert r.stopped == "time_budget"
    assert r.wall_s < 0.5 and r.first_oom is None
    assert r.max_fit == max(p.batch_size for p in r.points)


def test_too_large_a_start_searches_down():
    gpu, step = setup(usable=0.5)
    r = run(step, gpu, start=10_000)
    assert [p.phase for p in by_trial(r)][:3] == ["grow", "down", "down"]
    assert r.stopped == "boundary"
    assert 0 <= step.true_max - r.max_fit <= 0.03 * step.true_max


def test_nothing_fits():
    gpu, step = setup(usable=0.02)        # not even the weights and one sample
    r = run(step, gpu, start=4)
    assert r.stopped == "no_fit" and r.max_fit is None and r.recommended is None
    assert [p.batch_size for p in r.points] == [1, 2, 4]
    assert "even batch 1 ran out of memory" in r.reason
    assert r.first_oom == 1


def test_progress_prints_a_line_per_trial_and_can_be_silenced(capsys, monkeypatch):
    monkeypatch.setattr(LOGGER, "propagate", False)  # no logging set up: progress goes to stderr
    gpu, step = setup()
    lines = []
    r = run(step, gpu, progress=lines.append)
    trial_lines = [x for x in lines if x.startswith("stepprof.sweep: [")]
    assert len(trial_lines) == r.trials
    assert lines[-1].startswith("stepprof.sweep: recommended batch")
    assert any("memory back to the pre-trial baseline" in x for x in trial_lines)
    gpu, step = setup()
    run(step, gpu, progress=False, max_batch=8)
    assert capsys.readouterr().err == ""
    gpu, step = setup()
    run(step, gpu, progress=True, max_batch=8)
    assert capsys.readouterr().err.count("stepprof.sweep: [") == 3


def test_progress_goes_to_the_stepprof_logger_when_logging_is_set_up(capsys, caplog):
    """With a handler (here pytest's, on the root), progress=True logs each line at INFO on
    'stepprof.sweep', a child of 'stepprof', and writes nothing to stderr itself."""
    gpu, step = setup()
    with caplog.at_level(logging.INFO, logger="stepprof"):
        r = run(step, gpu, progress=True, max_batch=8)
    ours = [rec for rec in caplog.records if rec.name == "stepprof.sweep"]
    assert [rec.levelno for rec in ours] == [logging.INFO] * len(ours)
    assert sum(rec.getMessage().startswith("stepprof.sweep: [") for rec in ours) == r.trials == 3
    assert "stepprof.sweep" not in capsys.readouterr().err
    caplog.clear()
    gpu, step = setup()
    with caplog.at_level(logging.WARNING, logger="stepprof"):  # the user's level decides
        run(step, gpu, progress=True, max_batch=8)
    assert not [rec for rec in caplog.records if rec.name == "stepprof.sweep"]
    assert "stepprof.sweep" not in capsys.readouterr().err


def test_sweep_on_a_real_cpu_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def train_step(batch):
        x, y = batch
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    r = stepprof.sweep(train_step, lambda n: (torch.randn(n, 32), torch.randint(0, 4, (n,))),
                       max_batch=64, restore=(model, opt), progress=False, min_time_s=0.01,
                       device="cpu")
    assert r.device == "cpu" and r.stopped in ("max_batch", "plateau")
    assert all(p.samples_per_s > 0 and p.step_ms > 0 for p in r.points)
    assert r.recommended is not None and r.knee is not None
    assert r.unavailable.get("predicted_max")
