"""The step and phase boundaries (stepprof._recorder.boundaries), driven by a fake device and clock."""

from __future__ import annotations

import pytest

import stepprof

from .conftest import make, steps
from .fakes import FakeGpu


def test_phases_get_their_own_peak_and_the_step_gets_the_true_max(log, gpu):
    prof = make(log, gpu)
    gpu.alloc(100)                  # live before the step (weights)
    with prof.step():
        with prof.measure("forward"):
            gpu.alloc(50)           # activations
            gpu.launch(1.0)
        gpu.alloc(500)              # a spike between phases: it counts toward the
        gpu.free(500)               # next top-level phase (one read saved per phase)
        with prof.measure("backward"):
            gpu.alloc(20)
            gpu.free(50)
            gpu.launch(2.0)
        with prof.measure("optimizer"):
            gpu.alloc(80)           # foreach temporaries: the optimizer sets the phase peak
            gpu.free(80)
            gpu.launch(1.0)
    prof.close()
    (r,) = steps(log)
    ph = r["phases"]
    assert list(ph) == ["forward", "backward", "optimizer"]
    assert ph["forward"]["peak_allocated_bytes"] == 150
    assert ph["backward"]["peak_allocated_bytes"] == 650
    assert ph["optimizer"]["peak_allocated_bytes"] == 200
    assert r["peak_allocated_bytes"] == 650       # the gap's spike is in the step's peak
    assert ph["forward"]["gpu_ms"] == pytest.approx(1.0)
    assert ph["backward"]["gpu_ms"] == pytest.approx(2.0)
    assert all(p["count"] == 1 for p in ph.values())
    assert r["gpu_ms"] == pytest.approx(4.0)


def test_repeated_phase_names_sum_for_gradient_accumulation(log, gpu):
    prof = make(log, gpu)
    with prof.step(batch_size=4 * 8):
        for _ in range(4):
            with prof.measure("forward"):
                gpu.launch(1.0)
                gpu.host(0.5)
            with prof.measure("backward"):
                gpu.launch(2.0)
                gpu.host(0.25)
    prof.close()
    (r,) = steps(log)
    assert r["phases"]["forward"]["count"] == 4
    assert r["phases"]["forward"]["wall_ms"] == pytest.approx(2.0)
    assert r["phases"]["forward"]["gpu_ms"] == pytest.approx(4.0)
    # The device runs behind the host, so phase spans include queued work of the
    # previous phase; their sum over the step still equals the step's span.
    total = sum(p["gpu_ms"] for p in r["phases"].values())
    assert total == pytest.approx(r["gpu_ms"])


def test_reads_per_step_are_one_per_phase_plus_one(log, gpu):
    prof = make(log, gpu)  # the first steps read their phases' peaks (the peak is not steady yet)
    for _ in range(2):
        with prof.step():
            for name in ("forward", "backward", "optimizer"):
                with prof.measure(name):
                    pass
    prof.close()
    # One extra read, once: the baseline of the allocator's counters at the first step.
    assert gpu.calls.count("read_memory") == 1 + 2 * 4
    assert gpu.marks_made == 2 * 5  # top-level phases share boundary events


def _phased_steps(prof, gpu, n, spikes=()):
    """``n`` steps of forward/backward/optimizer; a step in ``spikes`` allocates more."""
    for i in range(n):
        with prof.step():
            with prof.measure("forward"):
                gpu.alloc(50)
            with prof.measure("backward"):
                extra = 1000 if i in spikes else 0
                gpu.alloc(20 + extra)
                gpu.free(70 + extra)
            with prof.measure("optimizer"):
                gpu.alloc(30)
                gpu.free(30)


def test_phase_peaks_are_read_while_the_step_peak_moves_then_one_step_in_n(log, gpu):
    gpu.alloc(100)
    prof = make(log, gpu, warmup=2, phase_peaks_every=5)
    _phased_steps(prof, gpu, 20, spikes={12})
    prof.close()
    rs = steps(log)
    read = [r["step"] for r in rs if r["phases"]["forward"]["peak_allocated_bytes"] is not None]
    # Warm-up steps 0-1 read, and step 2 (the peak has repeated only once); from then on one
    # step in 5 (7, 12).  The spike at 12 moves the step's peak, and it moves back at 13, so
    # 13, 14 and 15 read until it has held for two steps again; the next would be 20.
    assert read == [0, 1, 2, 7, 12, 13, 14, 15]
    for r in rs:
        assert r["peak_allocated_bytes"] == (1170 if r["step"] == 12 else 170)  # always exact
        ph = r["phases"]
        if r["step"] in read:
            assert ph["forward"]["peak_allocated_bytes"] == 150
            assert ph["backward"]["peak_allocated_bytes"] == (1170 if r["step"] == 12 else 170)
            assert ph["optimizer"]["peak_allocated_bytes"] == 130
            assert "phases.peak_allocated_bytes" not in r["unavailable"]
        else:
            assert all(p["peak_allocated_bytes"] is None for p in ph.values())
            why = r["unavailable"]["phases.peak_allocated_bytes"]
            assert "one step in 5" in why and "phase_peaks_every=1" in why
            assert all(p["gpu_ms"] is not None for p in ph.values())  # only the peak is skipped


def test_spike_on_an_unread_step_still_sets_the_step_peak(log, gpu):
    gpu.alloc(100)
    prof = make(log, gpu, phase_peaks_every=50)
    _phased_steps(prof, gpu, 10, spikes={6})
    prof.close()
    r = steps(log)[6]
    assert r["phases"]["backward"]["peak_allocated_bytes"] is None  # a steady step: not read
    assert r["peak_allocated_bytes"] == 1170


def test_phase_peaks_every_1_reads_every_step_and_0_none(log, gpu, tmp_path):
    prof = make(log, gpu, phase_peaks_every=1)
    _phased_steps(prof, gpu, 8)
    prof.close()
    assert all(r["phases"]["forward"]["peak_allocated_bytes"] == 50 for r in steps(log))
    assert gpu.calls.count("read_memory") == 1 + 8 * 4
    other = str(tmp_path / "none.jsonl")
    gpu.calls.clear()
    prof = make(other, gpu, phase_peaks_every=0)
    _phased_steps(prof, gpu, 3)
    prof.close()
    rs = steps(other)
    assert all(p["peak_allocated_bytes"] is None for r in rs for p in r["phases"].values())
    assert "phase_peaks_every=0" in rs[0]["unavailable"]["phases.peak_allocated_bytes"]
    assert gpu.calls.count("read_memory") == 1 + 3  # the counters baseline, then the step's own read


@pytest.mark.parametrize("bad", [-1, 1.5, True, "5"])
def test_bad_phase_peaks_every_names_the_argument(log, gpu, bad):
    with pytest.raises(stepprof.ConfigError, match="'phase_peaks_every' must be an int >= 0"):
        make(log, gpu, phase_peaks_every=bad)


def test_nested_phase_peaks_are_exact(log, gpu):
    prof = make(log, gpu)
    with prof.step():
        with prof.measure("model"):
            gpu.alloc(300)
            gpu.free(300)           # before the nested phase: not in its peak
            with prof.measure("attention"):
                gpu.alloc(10)
                gpu.free(10)
    prof.close()
    (r,) = steps(log)
    assert r["phases"]["model/attention"]["peak_allocated_bytes"] == 10
    assert r["phases"]["model"]["peak_allocated_bytes"] == 300
    assert r["peak_allocated_bytes"] == 300


def test_nested_phases_are_keyed_by_path(log, gpu):
    prof = make(log, gpu)
    with prof.step():
        with prof.measure("model"):
            with prof.measure("attention"):
                gpu.alloc(10)
            gpu.free(10)
    prof.close()
    (r,) = steps(log)
    assert set(r["phases"]) == {"model", "model/attention"}
    assert r["phases"]["model"]["peak_allocated_bytes"] == 10


def test_nvtx_ranges_balance(log, gpu):
    prof = make(log, gpu)
    with prof.step("train"):
        with prof.measure("forward"):
            pass
    prof.close()
    assert gpu.ranges == ["+train 0", "+forward", "-", "-"]


def test_step_that_raises_is_recorded_and_the_exception_propagates(log, gpu):
    prof = make(log, gpu)
    boom = ValueError("bad batch")
    with pytest.raises(ValueError) as info:
        with prof.step():
            with prof.measure("forward"):
                raise boom
    assert info.value is boom
    with prof.step():               # state is clean: the next step works
        gpu.launch(1.0)
    s = prof.close()
    first, second = steps(log)
    assert first["error"] == {"type": "ValueError", "message": "bad batch"}
    assert "forward" in first["phases"]
    assert second["error"] is None
    assert s.error_steps == 1 and s.measured_steps == 1


def test_overhead_is_stepprofs_own_time(log):
    gpu = FakeGpu(mark_cost_ns=3_000)   # each event record costs 3 µs of host time
    prof = make(log, gpu)
    with prof.step():
        with prof.measure("forward"):
            gpu.host(1.0)
    prof.close()
    (r,) = steps(log)
    assert r["overhead_us"] == pytest.approx(9.0)     # three marks: start, phase end, end
    assert r["wall_ms"] == pytest.approx(1.0 + 0.003)  # inner boundaries are inside the step


def test_internal_failure_stops_recording_but_never_the_training(log, gpu):
    prof = make(log, gpu)
    with prof.step():
        pass
    gpu.fail_on = "read_memory"
    ran = []
    with pytest.warns(RuntimeWarning, match="stopped recording"):
        for i in range(3):
            with prof.step():
                with prof.measure("forward"):
                    ran.append(i)
    assert ran == [0, 1, 2]
    s = prof.close()
    assert "internal error" in s.unavailable["stepprof"]


def test_a_host_step_pending_when_cuda_comes_up_keeps_its_host_record(log, gpu, monkeypatch):
    """device=None: step 0 runs before CUDA is initialised (host), step 1 after (CUDA).  Step 0 is
    still waiting for the collector when the backend switches; its record is the host's."""
    import torch

    from stepprof._device.backend import HostBackend
    from stepprof._recorder.profiler import _make_profiler
    from stepprof._device import select

    cuda_up = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: bool(cuda_up))
    monkeypatch.setattr(
        select, "select_backend",
        lambda device, **kw: gpu if cuda_up else HostBackend("CUDA is not initialised"),
    )
    prof = _make_profiler(log, clock=gpu.clock, collect_every_s=30)  # no harvest before close
    with prof.step():
        gpu.host(1.0)
    cuda_up.append(True)            # the training code initialises CUDA
    with prof.step():
        gpu.launch(1.0)
    prof.close()
    host, cuda = steps(log)
    assert host["device"] == "cpu" and cuda["device"] == "cuda:0"
    assert host["host_rss_bytes"] > 0                      # read at its exit: not dropped
    assert host["unavailable"]["gpu_ms"] == "CUDA is not initialised"  # not "capturing a CUDA graph"
    assert "CPU allocator" in host["unavailable"]["peak_allocated_bytes"]
    assert cuda["gpu_ms"] == pytest.approx(1.0)


def test_an_exception_that_cannot_be_printed_is_still_a_recorded_step_error(log, gpu):
    """The user's exception's own __str__ failing is not an internal error of stepprof's."""

    class Unprintable(Exception):
        def __str__(self):
            raise AttributeError("'NoneType' object has no attribute 'name'")

    prof = make(log, gpu)
    boom = Unprintable()
    with pytest.raises(Unprintable) as info:
        with prof.step():
            raise boom
    assert info.value is boom
    with prof.step():               # recording goes on
        pass
    s = prof.close()
    first, second = steps(log)
    assert first["error"]["type"] == "Unprintable"
    assert "Unprintable" in first["error"]["message"]
    assert second["error"] is None
    assert s.error_steps == 1 and s.measured_steps == 1 and "stepprof" not in s.unavailable


def test_nvtx_ranges_pair_up_when_a_phase_closes_with_a_phase_left_open_inside(log, gpu):
    prof = make(log, gpu)
    with prof.step():
        outer = prof.measure("outer")
        outer.__enter__()
        prof.measure("inner").__enter__()  # left open: outer's exit closes it too
        gpu.host(1.0)
        outer.__exit__(None, None, None)
        with prof.measure("after"):
            gpu.host(1.0)
    prof.close()
    pushes = [r for r in gpu.ranges if r.startswith("+")]
    assert len(pushes) == gpu.ranges.count("-") == 4  # the step, outer, inner, after
    (r,) = steps(log)
    assert set(r["phases"]) == {"outer", "outer/inner", "after"}


def test_peak_phase_names_the_innermost_phase_at_the_steps_peak_or_says_why_not(log, gpu, tmp_path):
    prof = make(log, gpu)
    with prof.step():  # the peak in a top-level phase
        with prof.measure("forward"):
            gpu.alloc(50)
        with prof.measure("backward"):
            gpu.alloc(400)
            gpu.free(400)
        gpu.free(50)
    with prof.step():  # in a nested phase: the innermost of those that hold it
        with prof.measure("model"):
            with prof.measure("attention"):
                gpu.alloc(300)
                gpu.free(300)
            gpu.alloc(10)
            gpu.free(10)
    with prof.step():  # after the last phase
        with prof.measure("forward"):
            gpu.alloc(5)
            gpu.free(5)
        gpu.alloc(600)
        gpu.free(600)
    with prof.step():  # no phases: no field
        gpu.alloc(7)
        gpu.free(7)
    prof.close()
    a, b, c, d = steps(log)
    assert a["peak_phase"] == "backward" and "peak_phase" not in a["unavailable"]
    assert b["peak_phase"] == "model/attention"
    assert c["peak_phase"] is None
    assert c["unavailable"]["peak_phase"].startswith("the step's peak was reached outside its phases")
    assert "peak_phase" not in d
    other = str(tmp_path / "unread.jsonl")
    prof = make(other, gpu, phase_peaks_every=0)  # phase peaks off: the phases' reason
    _phased_steps(prof, gpu, 1)
    prof.close()
    (r,) = steps(other)
    assert r["peak_phase"] is None
    assert r["unavailable"]["peak_phase"] == r["unavailable"]["phases.peak_allocated_bytes"]


def test_peak_phase_on_the_host_is_null_with_the_peaks_reason(log):
    with stepprof.Profiler(log, device="cpu") as prof:
        with prof.step():
            with prof.measure("forward"):
                pass
    (r,) = steps(log)
    assert r["peak_phase"] is None
    assert r["unavailable"]["peak_phase"] == r["unavailable"]["peak_allocated_bytes"]
