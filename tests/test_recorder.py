"""The recording logic, driven by a fake asynchronous device and a fake clock."""

from __future__ import annotations

import time

import orjson
import pytest

import stepprof

from .conftest import make
from .fakes import FakeGpu


def steps(log, prof=None):
    return list(stepprof.read(log, kind="step"))


def test_step_record_figures(log, gpu):
    with make(log, gpu) as prof:
        with prof.step(batch_size=32):
            gpu.launch(5.0)         # 5 ms of device work queued at once...
            gpu.host(2.0)           # ...then 2 ms of host work while it runs
            gpu.alloc(1000)
        gpu.wait_idle()
    (r,) = steps(log)
    assert r["schema_version"] == stepprof.SCHEMA_VERSION
    assert r["kind"] == "step" and r["step"] == 0 and r["name"] == "step"
    assert r["device"] == "cuda:0"
    assert r["wall_ms"] == pytest.approx(2.0)
    assert r["gpu_ms"] == pytest.approx(5.0)
    assert r["gpu_busy"] == pytest.approx(2.5)
    assert r["peak_allocated_bytes"] == 1000
    assert r["reserved_bytes"] == 1000
    # The step cannot complete faster than its device span: samples/s uses max(wall, gpu).
    assert r["samples_per_s"] == pytest.approx(32 / 5e-3)
    assert r["error"] is None
    assert r["unavailable"] == {}
    assert r["phases"] == {}
    assert r["overhead_us"] >= 0


def test_records_are_written_lazily_without_any_sync(log, gpu):
    prof = make(log, gpu)
    for _ in range(3):
        with prof.step():
            gpu.launch(10.0)        # device far behind the host
            gpu.host(1.0)
    assert steps(log, prof) == []  # nothing has completed yet, and nothing waited
    assert gpu.syncs == 0
    gpu.host(15.0)                  # device finishes step 0 (ends at 10 ms) only
    with prof.step():
        gpu.host(1.0)
    assert [r["step"] for r in steps(log, prof)] == [0]
    assert gpu.syncs == 0
    summary = prof.close()
    assert gpu.syncs == 1           # close synchronises exactly once
    assert [r["step"] for r in steps(log)] == [0, 1, 2, 3]
    assert summary.steps == 4
    # every event went back to the pool exactly once
    assert len(gpu.released) == gpu.marks_made


def test_gpu_time_is_the_device_span_idle_gaps_included(log, gpu):
    prof = make(log, gpu)
    with prof.step():
        gpu.host(2.0)               # device idles while the host prepares
        gpu.launch(5.0)
    prof.close()
    (r,) = steps(log)
    assert r["gpu_ms"] == pytest.approx(7.0)   # a span, not kernel-busy time (docs say so)


def test_gpu_time_excludes_the_backlog_before_the_step(log, gpu):
    prof = make(log, gpu)
    gpu.launch(50.0)                # backlog queued before the step
    with prof.step():
        gpu.launch(5.0)
    prof.close()
    (r,) = steps(log)
    assert r["gpu_ms"] == pytest.approx(5.0)   # the backlog is not charged to the step


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


def test_warmup_and_summary_statistics(log, gpu):
    prof = make(log, gpu, warmup=2)
    walls = [100, 100, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]   # warm-up steps are slow
    for w in walls:
        with prof.step(batch_size=10):
            gpu.host(w)
    s = prof.close()
    recs = steps(log)
    assert [r["warmup"] for r in recs] == [True, True] + [False] * 11
    assert (s.steps, s.warmup_steps, s.measured_steps) == (13, 2, 11)
    assert s.wall_ms.median == pytest.approx(6.0)
    assert s.wall_ms.p10 == pytest.approx(2.0)
    assert s.wall_ms.p90 == pytest.approx(10.0)
    assert s.samples_per_s_median == pytest.approx(10 / 6e-3)
    (line,) = list(stepprof.read(log, kind="summary"))
    assert line["measured_steps"] == 11 and line["wall_ms"]["median"] == pytest.approx(6.0)
    assert line["schema_version"] == stepprof.SCHEMA_VERSION
    assert "6.00 ms" in str(s) and "11 measured steps" in str(s)


def test_summary_is_null_with_reasons_when_nothing_was_measured(log, gpu):
    s = make(log, gpu, warmup=5).close()
    assert s.steps == 0 and s.wall_ms is None and s.gpu_ms is None
    assert "no measured steps" in s.unavailable["wall_ms"]


def test_summary_gpu_busy_that_no_step_had_is_null_with_the_reason(log, gpu):
    prof = make(log, gpu)
    for _ in range(3):
        with prof.step(batch_size=2):
            gpu.launch(1.0)         # device work, no host time: wall_ms is 0, gpu_busy null
    s = prof.close()
    assert all(r["gpu_busy"] is None and r["unavailable"]["gpu_busy"] for r in steps(log))
    assert s.gpu_ms.median == pytest.approx(1.0) and s.gpu_busy_median is None
    assert s.unavailable["gpu_busy_median"] == "wall time was zero"


def test_close_is_idempotent_and_a_closed_profiler_refuses_steps(log, gpu):
    prof = make(log, gpu)
    with prof.step():
        pass
    s = prof.close()
    assert prof.close() is s and prof.summary is s and prof.closed
    with pytest.raises(stepprof.UsageError, match="closed"):
        with prof.step():
            pass
    assert len(list(stepprof.read(log, kind="summary"))) == 1


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


def test_cpu_backend_marks_gpu_fields_unavailable(log):
    prof = stepprof.Profiler(log, device="cpu")
    with prof.step(batch_size=2):
        with prof.measure("forward"):
            sum(range(1000))
    s = prof.close()
    (r,) = steps(log)
    assert r["device"] == "cpu"
    for field in ("gpu_ms", "gpu_busy", "peak_allocated_bytes", "reserved_bytes"):
        assert r[field] is None
        assert r["unavailable"][field]
    assert r["phases"]["forward"]["gpu_ms"] is None
    assert r["unavailable"]["phases.gpu_ms"]
    assert r["host_rss_bytes"] > 0
    assert r["wall_ms"] > 0 and r["samples_per_s"] > 0
    assert s.gpu_ms is None and s.unavailable["gpu_ms"]
    assert s.peak_allocated_bytes_max is None and s.unavailable["peak_allocated_bytes_max"]


def test_collector_thread_writes_completed_steps_without_close(log, gpu):
    prof = make(log, gpu, collect_every_s=0.001)
    for _ in range(3):
        with prof.step():
            with prof.measure("forward"):
                gpu.launch(1.0)
    gpu.wait_idle()
    deadline = time.monotonic() + 5
    while len(steps(log)) < 3 and time.monotonic() < deadline:
        time.sleep(0.002)
    assert [r["step"] for r in steps(log)] == [0, 1, 2]
    assert gpu.syncs == 0
    prof.close()
    assert prof._collector.thread is not None and not prof._collector.thread.is_alive()
    assert len(gpu.released) == gpu.marks_made


def test_phase_gpu_time_tiles_the_step(log, gpu):
    prof = make(log, gpu)
    with prof.step():
        with prof.measure("forward"):
            gpu.launch(1.0)
        gpu.launch(0.5)             # device work between phases counts toward the next
        with prof.measure("backward"):
            gpu.launch(2.0)
    prof.close()
    (r,) = steps(log)
    assert r["phases"]["forward"]["gpu_ms"] == pytest.approx(1.0)
    assert r["phases"]["backward"]["gpu_ms"] == pytest.approx(2.5)
    assert r["gpu_ms"] == pytest.approx(3.5)


def test_a_harvest_writes_its_records_in_one_system_call(log, gpu, monkeypatch):
    from stepprof import _log

    prof = make(log, gpu, memory_every=0)
    for _ in range(4):
        with prof.step():
            gpu.launch(5.0)          # the device runs behind: the steps stay pending
    calls = []
    real_write = _log.os.write

    def counting_write(fd, data):
        calls.append(bytes(data))
        return real_write(fd, data)

    monkeypatch.setattr(_log.os, "write", counting_write)
    gpu.wait_idle()
    prof._drain()
    assert len(calls) == 1
    lines = calls[0].splitlines()
    assert [orjson.loads(x)["step"] for x in lines if b'"kind":"step"' in x] == [0, 1, 2, 3]
    assert calls[0].endswith(b"\n")
    prof.close()


def test_host_rss_is_the_figure_psutil_gives_and_falls_back_to_psutil(monkeypatch):
    import os

    import psutil

    from stepprof._profiler import _HostRss

    rss = _HostRss()
    first = rss.read()
    assert abs(first - psutil.Process().memory_info().rss) < 8 << 20  # same pages, read apart
    grown = bytearray(64 << 20)
    grown[::4096] = b"\1" * len(grown[::4096])  # touch every page: the RSS grows by 64 MiB
    assert rss.read() - first > 48 << 20  # re-read, not cached
    rss.forget()  # what a forked child does: reopen its own
    assert abs(rss.read() - psutil.Process().memory_info().rss) < 8 << 20

    def no_proc(*args, **kwargs):
        raise OSError("no /proc here")

    monkeypatch.setattr(os, "open", no_proc)
    fallback = _HostRss()
    assert abs(fallback.read() - psutil.Process().memory_info().rss) < 8 << 20
    assert fallback._process is not None and fallback._fd is None


def test_a_host_step_pending_when_cuda_comes_up_keeps_its_host_record(log, gpu, monkeypatch):
    """device=None: step 0 runs before CUDA is initialised (host), step 1 after (CUDA).  Step 0 is
    still waiting for the collector when the backend switches; its record is the host's."""
    import torch

    from stepprof._cuda import HostBackend
    from stepprof._profiler import _make_profiler
    from stepprof._recorder import boundaries

    cuda_up = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: bool(cuda_up))
    monkeypatch.setattr(
        boundaries, "select_backend",
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


def test_close_from_two_threads_at_once_closes_once(log):
    """A second close() while the first is still synchronising waits for it and returns the
    same summary; the close-time records are written once."""
    import threading

    class SlowSync(FakeGpu):
        def __init__(self):
            super().__init__()
            self.waiting, self.go = threading.Event(), threading.Event()

        def synchronize(self):
            self.waiting.set()
            self.go.wait(5)
            super().synchronize()

    gpu = SlowSync()
    prof = make(log, gpu)
    with prof.step():
        gpu.launch(5.0)             # pending: close() must synchronise
    build = prof._build_summary
    slow = []

    def slow_build():               # the first closer lingers before its summary
        if not slow:
            slow.append(1)
            time.sleep(0.2)
        return build()

    prof._build_summary = slow_build
    got = [None, None]

    def closer(i):
        got[i] = prof.close()

    first = threading.Thread(target=closer, args=(0,))
    first.start()
    assert gpu.waiting.wait(5)
    second = threading.Thread(target=closer, args=(1,))
    second.start()
    time.sleep(0.1)                 # the second closer is inside close() too
    gpu.go.set()
    first.join(5)
    second.join(5)
    assert got[0] is not None and got[0] is got[1] is prof.summary
    assert gpu.syncs == 1
    kinds = [(r["kind"], r.get("trigger")) for r in stepprof.read(log)]
    assert kinds == [("step", None), ("memory", "after_warmup"), ("memory", "close"), ("summary", None)]


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_a_forked_child_does_not_write_the_parents_pending_steps_again(log, gpu):
    """Steps pending in the parent at a fork are the parent's to write: a child that exits
    normally (closing its inherited profilers at interpreter exit) must not write them too."""
    import os

    from stepprof import _profiler

    prof = make(log, gpu, collect_every_s=30, memory_every=0)  # step 0 stays pending
    with prof.step():
        pass
    pid = os.fork()
    if pid == 0:                                 # the child: as at its interpreter exit
        try:
            _profiler._close_all_at_exit()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    prof.close()
    assert [r["step"] for r in steps(log)] == [0]


def test_a_forked_child_records_nothing_into_the_parents_log(log, gpu):
    """An inherited profiler is inert in a forked child: its steps and phases are not
    recorded, its close writes no summary, and using it warns once with the remedy."""
    import os
    import warnings as w

    prof = make(log, gpu, memory_every=0)
    with prof.step():
        pass
    r, wr = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            with w.catch_warnings(record=True) as caught:
                w.simplefilter("always")
                for _ in range(2):
                    with prof.step():
                        with prof.measure("forward"):
                            pass
                s = prof.close()
            warned = [str(c.message) for c in caught if "inherited by the forked process" in str(c.message)]
            os.write(wr, f"{len(warned)} {s.steps}".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(wr)
    _, status = os.waitpid(pid, 0)
    got = os.read(r, 100).decode()
    os.close(r)
    assert status == 0, got
    with prof.step():
        pass
    prof.close()
    kinds = [(x["kind"], x.get("step")) for x in stepprof.read(log) if x["kind"] != "memory"]
    assert kinds == [("step", 0), ("step", 1), ("summary", None)]   # the parent's only
    assert got.split()[0] == "1"                 # one warning, at the first use


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
