"""Threads: each thread has its own step context (docs/measurement.md, "Threads").

Run under a 1 µs switch interval, so that the interpreter switches threads inside
stepprof's boundaries as often as it can.
"""

from __future__ import annotations

import sys
import threading
import time
import warnings
from collections import Counter

import pytest

import stepprof
from stepprof import _syncs

from .conftest import make

#: The fault suite runs on the step core and on the Python boundaries.
pytestmark = pytest.mark.usefixtures("either_path")

THREADS = 4
STEPS = 10_000
PHASES = {"fwd", "fwd/inner", "bwd"}


@pytest.fixture
def switch_every_1us():
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def _loop(i: int, steps: int, errors: list[BaseException]) -> None:
    try:
        for _ in range(steps):
            with stepprof.profile_step(f"t{i}", batch_size=i + 1):
                with stepprof.measure("fwd"):
                    with stepprof.measure("inner"):
                        pass
                with stepprof.measure("bwd"):
                    pass
    except BaseException as e:  # noqa: BLE001 - the test fails on any
        errors.append(e)


def test_four_threads_and_a_helper_record_every_step_under_a_1us_switch_interval(tmp_path, switch_every_1us):
    log = str(tmp_path / "threads.jsonl")
    errors: list[BaseException] = []
    stop = threading.Event()
    helper_calls = [0]

    @stepprof.measure("load_batch")
    def load_batch():
        return 1

    def helper():
        try:
            while not stop.is_set():
                load_batch()
                helper_calls[0] += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "stopped recording", no warning at all
        with stepprof.Profiler(log, device="cpu") as prof:
            workers = [threading.Thread(target=_loop, args=(i, STEPS, errors), name=f"worker-{i}")
                       for i in range(THREADS)]
            h = threading.Thread(target=helper, name="helper")
            h.start()
            for t in workers:
                t.start()
            for t in workers:
                t.join()
            stop.set()
            h.join()
    assert not errors, errors[:3]
    records = list(stepprof.read(log, kind="step"))
    by_name = Counter(r["name"] for r in records)
    assert by_name == {**{f"t{i}": STEPS for i in range(THREADS)}, "load_batch": helper_calls[0]}
    assert sorted(r["step"] for r in records) == list(range(len(records)))  # each index once
    assert prof.summary.steps == len(records) == THREADS * STEPS + helper_calls[0]
    threads = {r["name"]: set() for r in records}
    for r in records:
        threads[r["name"]].add(r.get("thread"))
        assert r["error"] is None, r
        if r["name"] == "load_batch":
            assert r["phases"] == {}, r
        else:  # its own phases, never another thread's
            assert set(r["phases"]) == PHASES and all(p["count"] == 1 for p in r["phases"].values()), r
            assert r["batch_size"] == int(r["name"][1:]) + 1
    # One thread name per step name; the training thread (the first to open a step) has none.
    assert all(len(names) == 1 for names in threads.values()), threads
    named = sorted(n for (n,) in threads.values() if n is not None)
    assert len(named) == THREADS  # the other 3 workers and the helper
    assert not _syncs._trackers


def test_overlapping_steps_on_a_device_have_no_peak_and_say_why(log, gpu, switch_every_1us):
    """On a device, the allocator's peak counter is one per device: a step that another
    thread's step overlapped has no peak of its own (null, with the reason), the rest keep it."""
    errors: list[BaseException] = []
    inside, release = threading.Event(), threading.Event()

    def other():
        try:
            with stepprof.profile_step("other"):
                inside.set()
                release.wait(5)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    with make(log, gpu, collect_every_s=0.002) as prof:  # the collector thread, as in a real run
        with prof.step("alone"):
            pass
        t = threading.Thread(target=other, name="other-thread")
        t.start()
        assert inside.wait(5)
        with prof.step("overlapped"):
            pass
        release.set()
        t.join()
        with prof.step("alone-again"):
            pass
        workers = [threading.Thread(target=_loop, args=(i, 200, errors)) for i in range(THREADS)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    assert not errors
    recs = {r["name"]: r for r in stepprof.read(log, kind="step")}
    assert recs["alone"]["peak_allocated_bytes"] is not None
    assert recs["alone-again"]["peak_allocated_bytes"] is not None
    for name in ("overlapped", "other"):
        assert recs[name]["peak_allocated_bytes"] is None
        assert "overlapped" in recs[name]["unavailable"]["peak_allocated_bytes"]
        assert recs[name]["allocator"] is None
    assert recs["other"]["thread"] == "other-thread" and "thread" not in recs["overlapped"]
    assert Counter(r["name"] for r in stepprof.read(log, kind="step"))["t0"] == 200
    assert not _syncs._trackers


def test_close_from_another_thread_leaves_that_threads_open_step_unrecorded(log, gpu):
    opened, closed = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def worker(prof):
        try:
            with prof.step("late"):
                opened.set()
                closed.wait(5)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    prof = make(log, gpu)
    with prof.step("first"):
        pass
    t = threading.Thread(target=worker, args=(prof,))
    t.start()
    assert opened.wait(5)
    prof.close()
    closed.set()
    t.join()
    assert not errors  # its exit after close is quiet
    assert [r["name"] for r in stepprof.read(log, kind="step")] == ["first"]
    assert not _syncs._trackers


def test_threads_first_steps_at_once_open_one_sync_session(log, gpu, switch_every_1us, monkeypatch):
    """Four threads' first steps race to open the profiler's sync session: one opens it (the
    route is installed once), and every thread's syncs go to its own step."""
    from .fake_torch import FakeTensor

    install = gpu.route.install

    def slow_install():  # a wide window: the other threads arrive while it installs
        time.sleep(0.01)
        install()

    monkeypatch.setattr(gpu.route, "install", slow_install)
    monkeypatch.setattr(_syncs, "_INTERNAL_PREFIXES", (*_syncs._INTERNAL_PREFIXES, fake_torch_file()))
    t = FakeTensor(gpu)
    start = threading.Barrier(THREADS)
    errors: list[BaseException] = []

    def worker(i):
        try:
            start.wait(5)
            for _ in range(50):
                with prof.step(f"t{i}"):
                    t.item()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    with make(log, gpu, collect_every_s=0.002) as prof:
        workers = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        assert gpu.installs == 1 and gpu.uninstalls == 0
    assert not errors
    assert gpu.installs == gpu.uninstalls == 1 and not _syncs.installed()
    recs = list(stepprof.read(log, kind="step"))
    assert len(recs) == THREADS * 50
    assert all(r["syncs"]["count"] == 1 for r in recs)
    assert prof.summary.syncs_outside_steps == 0


def fake_torch_file() -> str:
    from . import fake_torch

    return fake_torch.__file__


def test_close_returns_within_a_second_while_four_threads_keep_stepping(tmp_path, switch_every_1us):
    """close() writes what was pending when it began and returns; the threads stepping
    meanwhile are refused new steps (as after close) and never write into the closing log."""
    log = str(tmp_path / "closing.jsonl")
    prof = stepprof.Profiler(log, device="cpu")
    stop = threading.Event()
    refused: list[int] = []
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            while not stop.is_set():
                try:
                    with prof.step(f"t{i}", batch_size=1):
                        with prof.measure("p"):
                            pass
                except stepprof.UsageError:
                    refused.append(i)
                    return
        except BaseException as e:  # noqa: BLE001 - the test fails on any
            errors.append(e)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    for t in workers:
        t.start()
    time.sleep(0.5)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "stopped recording"
        summary = prof.close()
    took_s = time.perf_counter() - t0
    deadline = time.monotonic() + 10  # each thread's next step is refused: wait for all of them
    while len(refused) < THREADS and not errors and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    for t in workers:
        t.join()
    assert took_s < 1.0, took_s
    assert not errors, errors[:3]
    assert sorted(refused) == list(range(THREADS))
    records = list(stepprof.read(log))
    assert records[-1]["kind"] == "summary"
    steps = [r for r in records if r["kind"] == "step"]
    assert len(steps) == summary.steps > 0
    assert all(r["error"] is None for r in steps)
    assert not _syncs._trackers


def test_a_step_open_while_close_runs_keeps_measuring_its_phases(tmp_path):
    """close() refuses new steps, not the phases of a step already open on another thread:
    that step ends as the user wrote it, with no error of stepprof's."""
    log = str(tmp_path / "closing.jsonl")
    prof = stepprof.Profiler(log, device="cpu")
    entered, go, done = threading.Event(), threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def work() -> None:
        try:
            with prof.step("open", batch_size=1):
                entered.set()
                go.wait(5)
                with prof.measure("p"):
                    pass
        except BaseException as e:  # noqa: BLE001 - the test fails on any
            errors.append(e)
        done.set()

    t = threading.Thread(target=work)
    t.start()
    assert entered.wait(5)
    collector = prof._collector
    finish = collector.finish

    def finish_after_the_phase() -> None:  # close() has begun: the phase runs now
        go.set()
        assert done.wait(5)
        finish()

    collector.finish = finish_after_the_phase
    prof.close()
    t.join()
    assert not errors, errors
    steps = list(stepprof.read(log, kind="step"))
    assert [(s["error"], list(s["phases"])) for s in steps] == [(None, ["p"])]
