"""stepprof.sweep on a CPU: synthetic steps with known curves on a fake device and clock."""

from __future__ import annotations

import itertools
import math
import traceback

import pytest
import torch

import stepprof
from stepprof._device.backend import HostSweepBackend
from stepprof._sweep import find_knee, find_thrash_zone, is_oom

from .fakes import FakeGpu, FakeSweepGpu, SyntheticStep

GB = 10**9


def run(step, gpu, **kw):
    kw.setdefault("progress", False)
    return stepprof.sweep(step, step.make_batch, _backend=gpu, _clock=gpu.clock, **kw)


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


def test_a_noisy_dip_is_not_a_drop():
    pts = [
        _pt(1, 100.0, 10.0, p10=9.0), _pt(2, 190.0, 10.5, p10=10.0), _pt(4, 200.0, 20.0, p10=19.0),
        # 5% below the best at the median, but its fastest steps are as fast as the best's
        _pt(8, 185.0, 43.2, p10=39.0),
    ]
    assert find_thrash_zone(pts) is None
    pts[-1] = _pt(8, 150.0, 53.0, p10=52.0)
    assert find_thrash_zone(pts) == range(8, 9)


def _pt(n, sps, ms, *, p10=None, retries=0, oom=False):
    return stepprof.SweepPoint(
        trial=n, phase="grow", batch_size=n, oom=oom, samples_per_s=None if oom else sps,
        step_ms=None if oom else ms, step_ms_p10=p10, step_ms_p90=None, timed_steps=3,
        warmup_steps=1, peak_allocated_bytes=None, alloc_retries=retries, device_allocs=0,
        leaked_bytes=None, error=None, wall_s=0.1,
    )


def test_knee_is_the_smallest_batch_within_10_percent_of_the_best():
    pts = [_pt(1, 10.0, 1), _pt(2, 50.0, 1), _pt(4, 91.0, 1), _pt(8, 100.0, 1), _pt(16, 0, 0, oom=True)]
    assert find_knee(pts) == 4
    assert find_knee(pts, within=0.05) == 8
    assert find_knee([_pt(1, 0, 0, oom=True)]) is None


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
    r = stepprof.sweep(step, step.make_batch, _backend=HostSweepBackend("fake host"),
                       _clock=gpu.clock, progress=False)
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
    r = stepprof.sweep(step, step.make_batch, _backend=HostSweepBackend("fake host"),
                       _clock=gpu.clock, progress=False, max_batch=64)
    assert r.stopped == "max_batch" and r.max_fit == 64
    assert not any("was not searched" in n for n in r.notes)


def test_without_memory_figures_an_oom_is_bisected_to_3_percent():
    gpu = FakeGpu()
    step = SyntheticStep(gpu, usable=int(0.985 * 40 * GB))
    r = stepprof.sweep(step, step.make_batch, _backend=HostSweepBackend("fake host"),
                       _clock=gpu.clock, progress=False)
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


def test_without_cuda_events_the_fallback_span_starts_after_the_warm_up(monkeypatch):
    # An event that cannot be recorded falls back to the synchronised span / steps; the
    # warm-up's queued GPU work must not be in that span.
    from stepprof._device.cuda import CudaSweepBackend

    class NoEventGpu(FakeSweepGpu, CudaSweepBackend):
        def mark(self):
            return None

    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda i: None)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, i: None)
    gpu = NoEventGpu(capacity=40 * GB)

    def train_step(batch):
        gpu.launch(10.0)                # asynchronous: the host does not wait for the GPU

    r = stepprof.sweep(train_step, lambda n: torch.randn(n, 1), max_batch=1, steps=3, max_steps=3,
                       _backend=gpu, _clock=gpu.clock, progress=False)
    p = r.point(1)
    assert "step_ms" in p.unavailable and p.timed_steps == 3
    assert p.step_ms == pytest.approx(10.0)


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


# -- out-of-memory handling -------------------------------------------------------------------


def test_memory_is_freed_after_oom_only_outside_the_except_block():
    gpu, step = setup()
    r = run(step, gpu)
    ooms = [p for p in r.points if p.oom]
    assert ooms and all(p.leaked_bytes == 0 for p in ooms)
    assert all(p.error.startswith("OutOfMemoryError: CUDA out of memory") for p in ooms)
    # Once before each trial (a clean allocator), and once more after each OOM.
    assert gpu.empty_cache_calls == len(r.points) + len(ooms)
    assert all(p.samples_per_s is None and p.step_ms is None for p in ooms)
    # The OOM point's peak is what was held when the failing request came.
    assert all(GB < p.peak_allocated_bytes <= step.usable for p in ooms)


def test_a_step_that_keeps_tensors_after_oom_is_reported_as_a_leak():
    gpu, step = setup(leak_on_oom=True)
    r = run(step, gpu)
    leaked = sum(h.nbytes for h in step.leaked)
    assert leaked > 0
    assert sum(p.leaked_bytes for p in r.points if p.oom) == leaked
    assert any("stayed allocated" in n for n in r.notes)
    assert "not freed" in str(r)


def test_a_peak_that_could_not_be_reset_is_null_with_a_reason():
    # Without the reset, the counter holds an earlier trial's (or the user's) peak: not this trial's.
    gpu, step = setup()
    gpu.fail_on = "reset_peak"
    r = run(step, gpu)
    assert all(p.peak_allocated_bytes is None for p in r.points)
    assert all("reset_peak" in p.unavailable["peak_allocated_bytes"] for p in r.points)
    assert r.stopped == "boundary" and 0 <= step.true_max - r.max_fit <= 0.03 * step.true_max


OOM_MESSAGES = [
    "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total capacity)",
    "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported",
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    "cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED",
    "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes",
]


@pytest.mark.parametrize("message", OOM_MESSAGES)
def test_runtime_error_oom_messages_count_as_oom(message):
    gpu, step = setup()
    inner = step.__call__

    def train_step(batch):
        if batch.shape[0] > 1000:
            raise RuntimeError(message)
        inner(batch)

    r = stepprof.sweep(train_step, step.make_batch, _backend=gpu, _clock=gpu.clock, progress=False)
    assert r.max_fit >= 970 and r.max_fit <= 1000 and r.stopped == "boundary"
    assert all(p.error.startswith("RuntimeError: ") for p in r.points if p.oom)


@pytest.mark.parametrize("message", [
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input.",
    "cuDNN error: CUDNN_STATUS_INTERNAL_ERROR",
])
def test_ambiguous_cudnn_errors_are_oom_only_after_a_smaller_batch_ran(message):
    gpu, step = setup()
    inner = step.__call__

    def train_step(batch):
        if batch.shape[0] > 100:
            raise RuntimeError(message)
        inner(batch)

    r = stepprof.sweep(train_step, step.make_batch, _backend=gpu, _clock=gpu.clock, progress=False)
    assert 97 <= r.max_fit <= 100
    with pytest.raises(RuntimeError, match="CUDNN_STATUS") as info:
        stepprof.sweep(train_step, step.make_batch, start=128, _backend=gpu, _clock=gpu.clock,
                       progress=False)
    assert "batch size 128" in "".join(getattr(info.value, "__notes__", []))


def test_is_oom_classification():
    assert is_oom(torch.OutOfMemoryError("x"))
    assert is_oom(MemoryError())
    assert not is_oom(RuntimeError("shape '[2, 3]' is invalid for input of size 7"))
    assert not is_oom(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not is_oom(ValueError("CUDA out of memory"))       # not a RuntimeError
    assert not is_oom(RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED"))
    assert is_oom(RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED"), smaller_batch_ran=True)


# -- other errors propagate, annotated, and state is restored ---------------------------------------


def test_other_errors_propagate_unchanged_with_the_batch_size():
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    planted = ValueError("planted")
    raised_at = []

    def train_step(x):
        model(x).sum().backward()
        opt.step()
        if x.shape[0] >= 8:  # growth may skip 8 (it quadruples while throughput keeps up)
            raised_at.append(x.shape[0])
            raise planted

    with pytest.raises(ValueError) as info:
        stepprof.sweep(train_step, lambda n: torch.randn(n, 4), restore=(model, opt),
                       progress=False, min_time_s=0)
    (n,) = raised_at
    assert info.value is planted and str(planted) == "planted"
    assert any(f"train_step raised at batch size {n}" in note for note in planted.__notes__)
    assert f"batch size {n}" in "".join(traceback.format_exception(planted))
    for k, v in model.state_dict().items():      # restored although the sweep raised
        assert torch.equal(v, before[k])


def test_make_batch_errors_propagate_with_the_batch_size():
    raised_at = []

    def make_batch(n):
        if n >= 2:  # the second size tried, whatever growth picks
            raised_at.append(n)
            raise KeyError("sample 17")
        return torch.randn(n, 2)

    with pytest.raises(KeyError) as info:
        stepprof.sweep(lambda b: None, make_batch, progress=False, min_time_s=0)
    (n,) = raised_at
    assert info.value.args == ("sample 17",)
    assert any(f"make_batch({n}) raised" in note for note in info.value.__notes__)


def test_oom_in_make_batch_counts_as_oom():
    gpu, step = setup()

    def make_batch(n):
        if n > 500:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
        return step.make_batch(n)

    r = stepprof.sweep(step, make_batch, _backend=gpu, _clock=gpu.clock, progress=False)
    assert 485 <= r.max_fit <= 500 and r.stopped == "boundary"


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
        stepprof.sweep(train_step, step.make_batch, max_batch=64, _backend=gpu, _clock=gpu.clock,
                       progress=False)
        train_step(step.make_batch(4))           # after the sweep, recording works again
    assert prof.summary.steps == 1


# -- bad input ------------------------------------------------------------------------------


def _ok_step(batch):
    pass


def _ok_batch(n):
    return torch.zeros(n, 1)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"start": 0}, stepprof.ConfigError, r"'start' must be >= 1 \(got 0\)"),
    ({"start": 2.5}, stepprof.ConfigError, r"'start' must be an int >= 1 \(got 2.5\)"),
    ({"start": True}, stepprof.ConfigError, r"'start' must be an int"),
    ({"start": 64, "max_batch": 32}, stepprof.ConfigError, r"'max_batch' must be >= 'start' \(64\) \(got 32\)"),
    ({"max_batch": 0}, stepprof.ConfigError, r"'max_batch' must be >= 1 \(got 0\)"),
    ({"time_budget_s": -1}, stepprof.ConfigError, r"'time_budget_s' must be a finite number of seconds > 0 \(got -1\)"),
    ({"time_budget_s": 0}, stepprof.ConfigError, r"'time_budget_s'.*\(got 0\)"),
    ({"time_budget_s": float("nan")}, stepprof.ConfigError, r"'time_budget_s'.*\(got nan\)"),
    ({"warmup": -1}, stepprof.ConfigError, r"'warmup' must be >= 0 \(got -1\)"),
    ({"steps": 0}, stepprof.ConfigError, r"'steps' must be >= 1 \(got 0\)"),
    ({"steps": 5, "max_steps": 4}, stepprof.ConfigError, r"'max_steps' must be >= 5 \(got 4\)"),
    ({"min_time_s": -0.1}, stepprof.ConfigError, r"'min_time_s'.*\(got -0.1\)"),
    ({"knee_within": 1.5}, stepprof.ConfigError, r"'knee_within'.*\(got 1.5\)"),
    ({"progress": "yes"}, stepprof.ConfigError, r"'progress'.*\(got 'yes'\)"),
    ({"restore": (object(),)}, stepprof.ConfigError, r"'restore' takes objects with state_dict"),
    ({"device": "gpu0"}, stepprof.ConfigError, r"'device'.*\(got 'gpu0'\)"),
])
def test_bad_arguments_name_the_value(kwargs, error, match):
    kwargs.setdefault("progress", False)
    with pytest.raises(error, match=match):
        stepprof.sweep(_ok_step, _ok_batch, **kwargs)


def test_non_callables_are_usage_errors():
    with pytest.raises(stepprof.UsageError, match=r"'train_step' must be callable \(got None\) \(did you call it"):
        stepprof.sweep(None, _ok_batch)
    with pytest.raises(stepprof.UsageError, match=r"'make_batch' must be callable \(got tensor"):
        stepprof.sweep(_ok_step, torch.zeros(3, 1))
    with pytest.raises(TypeError):                  # UsageError is a TypeError
        stepprof.sweep(_ok_step, 5)


@pytest.mark.parametrize(("make_batch", "match"), [
    (lambda n: torch.zeros(2 * n, 3), r"make_batch\(1\) returned a batch of 2 samples"),
    (lambda n: (torch.zeros(n + 1, 3), torch.zeros(n + 1)), r"make_batch\(1\) returned a batch of 2 samples"),
    (lambda n: {"x": torch.zeros(7, 3)}, r"make_batch\(1\) returned a batch of 7 samples"),
    (lambda n: ["a"] * (n + 2), r"make_batch\(1\) returned a list of 3 items, not 1"),
    (lambda n: {"text": ["a"] * 5}, r"make_batch\(1\) returned a dict whose lists hold \[5\] items"),
    (lambda n: None, r"make_batch\(1\) returned None"),
])
def test_a_batch_of_the_wrong_size_is_rejected(make_batch, match):
    with pytest.raises(stepprof.ConfigError, match=match):
        stepprof.sweep(_ok_step, make_batch, progress=False)


def test_batches_whose_size_cannot_be_known_are_accepted():
    r = stepprof.sweep(_ok_step, lambda n: object(), max_batch=2, progress=False, min_time_s=0)
    assert r.max_fit == 2
    # A tuple of tensors where some other tensor has another leading size is fine.
    r = stepprof.sweep(_ok_step, lambda n: (torch.zeros(n, 3), torch.zeros(5)), max_batch=2,
                       progress=False, min_time_s=0)
    assert r.max_fit == 2


def test_a_list_of_n_samples_is_a_batch_of_n():
    # torchvision's detection models take a list of n images and a list of n target dicts.
    def make_batch(n):
        images = [torch.randn(3, 8, 8) for _ in range(n)]
        targets = [{"boxes": torch.rand(2, 4), "labels": torch.ones(2)} for _ in range(n)]
        return images, targets

    r = stepprof.sweep(_ok_step, make_batch, max_batch=4, progress=False, min_time_s=0)
    assert r.max_fit == 4
    r = stepprof.sweep(_ok_step, lambda n: [torch.randn(5) for _ in range(n)], max_batch=4,
                       progress=False, min_time_s=0)
    assert r.max_fit == 4
    with pytest.raises(stepprof.ConfigError, match=r"make_batch\(1\) returned a batch of 3 samples"):
        stepprof.sweep(_ok_step, lambda n: [torch.randn(3, 8, 8) for _ in range(n + 1)], progress=False)


def test_an_unwritable_log_fails_before_any_trial(tmp_path):
    calls = []
    with pytest.raises(stepprof.ConfigError, match="'log' cannot be written"):
        stepprof.sweep(calls.append, _ok_batch, log=tmp_path / "missing" / "x.jsonl", progress=False)
    assert calls == []


# -- output: log, table, progress, plot ------------------------------------------------------------


def test_log_has_a_point_per_trial_then_the_result(log):
    gpu, step = setup(thrash_from=3000, thrash_factor=1.3)
    r = run(step, gpu, log=log)
    recs = list(stepprof.read(log))
    assert [x["kind"] for x in recs] == ["sweep_point"] * r.trials + ["sweep_result"]
    assert all(x["schema_version"] == stepprof.SCHEMA_VERSION for x in recs)
    points, result = recs[:-1], recs[-1]
    assert [x["trial"] for x in points] == list(range(1, r.trials + 1))
    first = points[0]
    assert set(first) == {
        "schema_version", "kind", "trial", "phase", "batch_size", "oom", "samples_per_s", "step_ms",
        "step_ms_p10", "step_ms_p90", "timed_steps", "warmup_steps", "peak_allocated_bytes",
        "alloc_retries", "device_allocs", "leaked_bytes", "error", "wall_s", "unavailable",
    }
    oom = next(x for x in points if x["oom"])
    assert oom["samples_per_s"] is None and oom["leaked_bytes"] == 0 and "out of memory" in oom["error"]
    assert result["knee"] == r.knee and result["max_fit"] == r.max_fit
    assert result["thrash_zone"] == [r.thrash_zone.start, r.thrash_zone[-1]]
    assert result["recommended"] == r.recommended and result["reason"] == r.reason
    assert result["stopped"] == "boundary" and result["predicted_max"] == r.predicted_max
    assert "points" not in result


def test_str_is_a_table(log):
    gpu, step = setup(thrash_from=3000, thrash_factor=1.3)
    r = run(step, gpu)
    text = str(r)
    lines = text.splitlines()
    assert lines[0].startswith("stepprof.sweep on cuda:0:") and "trials" in lines[0]
    assert "samples/s" in lines[1] and "peak alloc" in lines[1]
    rows = lines[2:2 + r.trials]
    assert [int(row.split()[0].replace(",", "")) for row in rows] == [p.batch_size for p in r.points]
    assert any(row.rstrip().endswith("recommended") for row in rows)
    assert any("OOM" in row for row in rows) and any("thrash" in row for row in rows)
    assert f"knee {r.knee:,}" in text and f"max_fit {r.max_fit:,}" in text
    assert f"recommended {r.recommended:,}: " in text
    assert str(r.point(1)) .startswith("batch 1: ")


def test_progress_prints_a_line_per_trial_and_can_be_silenced(capsys):
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


def test_plot_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    gpu, step = setup(thrash_from=3000, thrash_factor=1.3)
    r = run(step, gpu)
    out = r.plot(tmp_path / "sweep.png")
    data = (tmp_path / "sweep.png").read_bytes()
    assert out == str(tmp_path / "sweep.png") and data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_to_a_path_without_extension_writes_that_path(tmp_path):
    """The docstring's "a PNG at ``path``" and the returned path: matplotlib alone would write
    ``sweep.png`` next to it and the returned ``sweep`` would not exist."""
    pytest.importorskip("matplotlib")
    gpu, step = setup()
    r = run(step, gpu, progress=False, max_batch=8)
    out = r.plot(tmp_path / "sweep")
    assert out == str(tmp_path / "sweep")
    assert (tmp_path / "sweep").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_names_the_install_command(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    gpu, step = setup()
    r = run(step, gpu, max_batch=8)
    with pytest.raises(ImportError, match=r"pip install 'stepprof\[plot\]'") as info:
        r.plot(tmp_path / "x.png")
    assert isinstance(info.value, stepprof.StepprofError)
    assert not (tmp_path / "x.png").exists()


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
                       max_batch=64, restore=(model, opt), progress=False, min_time_s=0.01)
    assert r.device == "cpu" and r.stopped in ("max_batch", "plateau")
    assert all(p.samples_per_s > 0 and p.step_ms > 0 for p in r.points)
    assert r.recommended is not None and r.knee is not None
    assert r.unavailable.get("predicted_max")
