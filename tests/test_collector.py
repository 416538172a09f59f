"""The collector and the step record (stepprof._recorder.collector), driven by a fake device and clock."""

from __future__ import annotations

import gc
import time

import orjson
import pytest

import stepprof
from stepprof._recorder.hooks import Hook

from .conftest import make, steps


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
    # The first step has no data wait: nothing came before it.
    assert r["data_wait_ms"] is None and "data_ms" not in r
    assert r["unavailable"] == {"data_wait_ms": "no previous step on this thread returned from its "
                                                "exit (the first step, or one cut short)"}
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
    prof.flush()
    assert len(calls) == 1
    lines = calls[0].splitlines()
    assert [orjson.loads(x)["step"] for x in lines if b'"kind":"step"' in x] == [0, 1, 2, 3]
    assert calls[0].endswith(b"\n")
    prof.close()


@pytest.mark.parametrize("starved", ["never runs", "slow mid-harvest"])
def test_a_starved_collector_thread_leaves_the_writing_to_the_training_thread(tmp_path, monkeypatch, starved):
    """The collector thread never runs, or runs slowly while it holds its lock (as when other
    processes starve it of CPU): the training thread writes each step within
    ``flush_every_s``, and never lets more than ``HARVEST_AT`` completed steps wait (the memory
    they hold)."""
    import threading

    from stepprof._recorder import collector as collector_module
    from stepprof._recorder.profiler import _make_profiler

    if starved == "never runs":
        monkeypatch.setattr(collector_module.Collector, "_loop", lambda self: self._stop.wait())
    else:
        build = collector_module.Builder.build

        def slow_build(self, s):
            if threading.current_thread().name == "stepprof-collector":
                time.sleep(0.002)  # 2 ms a record, the lock held: 256 records would be 0.5 s
            return build(self, s)

        monkeypatch.setattr(collector_module.Builder, "build", slow_build)
        monkeypatch.setattr(collector_module._NATIVE, "harvest", None)  # (each record through build)
    log = str(tmp_path / "starved.jsonl")
    prof = _make_profiler(log, device="cpu", energy_every_s=None, flush_every_s=0.05)
    most_pending = 0
    oldest_s = slowest_s = 0.0
    t_end = time.perf_counter() + 0.6
    n = 0
    # The interpreter's full collections grow with what the test session holds (0.03 to
    # 0.18 s late in a run): not stepprof's wait, so they are kept out of the timing.
    gc.disable()
    try:
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            with prof.step(batch_size=1):
                with prof.measure("p"):
                    pass
            slowest_s = max(slowest_s, time.perf_counter() - t0)
            n += 1
            pending = prof._collector.pending
            most_pending = max(most_pending, len(pending))
            if pending:
                oldest_s = max(oldest_s, (time.perf_counter_ns() - pending[0].t1) / 1e9)
    finally:
        gc.enable()
    with open(log, "rb") as f:
        written = sum(b'"kind":"step"' in line for line in f)
    prof.close()
    assert prof._collector.thread is not None and n > 1000
    assert most_pending <= collector_module.HARVEST_AT + 1  # the step just appended, then written
    assert oldest_s < 0.05 + 0.05  # flush_every_s, and a check every quarter of it
    assert written >= n - collector_module.HARVEST_AT - 1
    assert slowest_s < 0.1  # the training thread waited one slow record, never a chunk
    assert len(steps(log)) == n


class Late(Hook):
    """A late hook (a stand-in for energy): its field comes once ``ready``, or at close; odd
    steps get it null, with a reason."""

    ready = False

    def late(self, step, record):
        return (step.index,)

    def fill(self, token, final, why=None):
        if not (self.ready or final):
            return None
        (i,) = token
        if i % 2:
            return {"late_ms": None}, {"late_ms": why or f"step {i} is odd"}
        return {"late_ms": i / 2}, {}


@pytest.mark.parametrize("held", [False, True])
def test_completed_steps_are_written_young_and_held_ones_wait_as_untracked_lines(tmp_path, monkeypatch, held):
    """With the collector thread kept from running (a tight loop holds the GIL), the training
    thread writes the completed steps once more than ``HARVEST_AT`` wait, so that they die
    before the GC promotes them.  A record whose late field is not known yet (energy) waits
    built and encoded: no step object waits, and what does wait the GC does not track."""
    from stepprof._recorder import collector as collector_module
    from stepprof._recorder.profiler import _make_profiler

    monkeypatch.setattr(collector_module.Collector, "_loop", lambda self: self._stop.wait())
    harvests = []
    harvest = collector_module.Collector.harvest

    def counted(self, *args, **kwargs):
        harvests.append(len(self.pending))
        return harvest(self, *args, **kwargs)

    monkeypatch.setattr(collector_module.Collector, "harvest", counted)
    log = str(tmp_path / "young.jsonl")
    prof = _make_profiler(log, device="cpu", energy_every_s=None, flush_every_s=3600.0)
    late = Late()
    if held:
        prof._collector.use([*prof._hooks, late])
    most = 0
    n = 3 * collector_module.HARVEST_AT + 10
    for _ in range(n):
        with prof.step(batch_size=1):
            pass
        most = max(most, len(prof._collector.pending))
    assert most == collector_module.HARVEST_AT  # the 257th is written at its own exit
    assert len(harvests) == n // (collector_module.HARVEST_AT + 1)
    held_now = prof._collector.held.entries
    if held:
        assert steps(log) == [] and len(held_now) == 3 * (collector_module.HARVEST_AT + 1)
        gc.collect()
        assert not any(gc.is_tracked(entry) for entry in held_now)
        late.ready = True
    else:
        assert not held_now
    prof.close()
    records = steps(log)
    assert [r["step"] for r in records] == list(range(n))
    if held:
        assert [r["late_ms"] for r in records[:4]] == [0.0, None, 1.0, None]
        assert records[1]["unavailable"]["late_ms"] == "step 1 is odd"
        assert "late_ms" not in records[0]["unavailable"]


def test_a_held_record_is_the_record_it_would_have_been_and_its_events_go_back_at_once(log, gpu):
    """A record that waits for a late field gives its step's events back to the pool when it
    is built, not when it is written (a run shorter than ``energy_every_s`` would make new
    events for every step); written, it is the same record, the late field added, and the
    records after it (memory) still follow it."""
    late = Late()
    records = []
    for hook_on in (False, True):
        path = log + str(hook_on)
        g = type(gpu)()
        prof = make(path, g, memory_every=2)
        if hook_on:
            prof._collector.use([*prof._hooks, late])
        for _ in range(4):
            with prof.step():
                with prof.measure("forward"):
                    g.launch(2.0)
                g.launch(1.0)
                g.host(0.5)
        g.host(10.0)  # the device finishes steps 0-3
        with prof.step():
            g.launch(1.0)
        if hook_on:
            assert steps(path, prof) == []  # held: nothing written yet
            # Steps 0-3, each its own two events and its phase's end (the phase starts on the step's).
            assert len(g.released) == 4 * 3 == g.marks_made - 2
            late.ready = True
        summary = prof.close()
        assert len(g.released) == g.marks_made  # each once
        records.append(list(stepprof.read(path)))
        assert summary.steps == 5
    bare, held = records
    assert [(r["kind"], r.get("step")) for r in held] == [(r["kind"], r.get("step")) for r in bare]
    for a, b in zip(bare, held):
        if a["kind"] == "step":
            assert b.pop("late_ms") == (None if a["step"] % 2 else a["step"] / 2)
            if a["step"] % 2:
                assert b["unavailable"].pop("late_ms") == f"step {a['step']} is odd"
        for r in (a, b):
            for k in ("run_id", "overhead_us", "start_unix_s", "unix_s", "log"):
                r.pop(k, None)
        if a["kind"] != "summary":
            assert a == b


def test_read_marks_is_none_until_every_end_completes_and_a_missing_time_is_none(gpu):
    a = gpu.mark()
    gpu.launch(2.0)
    b = gpu.mark()
    gpu.launch(3.0)
    c = gpu.mark()
    assert gpu.read_marks((a, b, b, c)) is None  # nothing ran yet: nothing is read
    gpu.host(2.5)
    assert gpu.read_marks((a, b, b, c)) is None  # b has completed, c has not
    gpu.wait_idle()
    assert gpu.read_marks((a, b, b, c)) == pytest.approx((2.0, 3.0))
    assert gpu.read_marks((None, c, a, None)) == (None, None)  # a mark missing: no time
    assert gpu.read_marks(()) == ()

    def broken(start, end):
        raise RuntimeError("cudaEventElapsedTime failed")  # an event never recorded, say

    gpu.elapsed_ms = broken
    assert gpu.read_marks((a, b)) == (None,)


def test_release_marks_gives_each_mark_back_once_but_the_kept_one(gpu):
    a, b, c = gpu.mark(), gpu.mark(), gpu.mark()
    gpu.release_marks((a, c, a, b, None, c), keep=c)
    assert gpu.released == [a, b]


def test_one_hook_at_most_has_late_fields(log, gpu):
    """Held records carry one hook's token (a flat tuple): a second late hook is refused."""
    prof = make(log, gpu)
    with pytest.raises(ValueError, match="at most one hook may have late fields"):
        prof._collector.use([*prof._hooks, Late(), Late()])
    prof.close()


def test_catch_up_survives_the_collector_taking_the_last_step_between_its_test_and_its_read(log, gpu):
    """The training thread reads the oldest pending step without the collector's lock: the
    collector thread may pop it in between (a soak run under load once stopped recording on
    the IndexError)."""
    from collections import deque

    class Racy(deque):
        def __getitem__(self, i):
            raise IndexError("deque index out of range")  # emptied just after the test

    with make(log, gpu, flush_every_s=0.01) as prof:
        with prof.step():
            gpu.launch(1.0)
        c = prof._collector
        racy = Racy(c.pending)
        c.pending = racy
        try:
            assert c.catch_up(gpu.clock() + 10**12) is False
        finally:
            c.pending = deque(racy)
