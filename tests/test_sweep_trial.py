"""stepprof._sweep.trial: timing, out-of-memory detection and clean-up, errors that propagate."""

from __future__ import annotations

import traceback

import pytest
import torch

import stepprof
from stepprof._sweep.search import sweep_on
from stepprof._sweep.trial import is_oom

from .fakes import FakeSweepGpu
from .sweep_helpers import GB, run, setup


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

    r = sweep_on(gpu, gpu.clock, train_step, lambda n: torch.randn(n, 1), max_batch=1, steps=3, max_steps=3, progress=False)
    p = r.point(1)
    assert "step_ms" in p.unavailable and p.timed_steps == 3
    assert p.step_ms == pytest.approx(10.0)


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

    r = sweep_on(gpu, gpu.clock, train_step, step.make_batch, progress=False)
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

    r = sweep_on(gpu, gpu.clock, train_step, step.make_batch, progress=False)
    assert 97 <= r.max_fit <= 100
    with pytest.raises(RuntimeError, match="CUDNN_STATUS") as info:
        sweep_on(gpu, gpu.clock, train_step, step.make_batch, start=128, progress=False)
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

    r = sweep_on(gpu, gpu.clock, step, make_batch, progress=False)
    assert 485 <= r.max_fit <= 500 and r.stopped == "boundary"
