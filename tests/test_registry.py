"""stepprof._registry: the active, default and open profilers, and the one reset()."""

from __future__ import annotations

import subprocess
import sys
import threading
import warnings

import pytest

import stepprof
from stepprof import _registry

from .conftest import make
from .fakes import FakeGpu


def steps(log):
    return list(stepprof.read(log, kind="step"))


def test_innermost_profiler_is_the_active_one(tmp_path, gpu):
    a, b = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    with make(a, gpu):
        with stepprof.profile_step("in-a"):
            pass
        with make(b, gpu):
            with stepprof.profile_step("in-b"):
                pass
        with stepprof.profile_step("in-a-again"):
            pass
    assert [r["name"] for r in steps(a)] == ["in-a", "in-a-again"]
    assert [r["name"] for r in steps(b)] == ["in-b"]


def test_environment_configures_the_default_profiler(tmp_path, monkeypatch):
    path = str(tmp_path / "env.jsonl")
    monkeypatch.setenv("STEPPROF_LOG", path)
    monkeypatch.setenv("STEPPROF_WARMUP", "1")
    for _ in range(2):
        with stepprof.profile_step():
            pass
    _registry.default_profiler().close()
    assert [r["warmup"] for r in steps(path)] == [True, False]


def test_no_profiler_and_no_log_warns_once_and_still_runs():
    with pytest.warns(stepprof.StepprofWarning, match="no log is configured"):
        with stepprof.profile_step():
            x = 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with stepprof.profile_step():
            x += 1
    assert x == 2


def test_another_threads_measure_is_its_own_step_and_does_not_disturb_the_open_one(log, gpu):
    """Each thread has its own step context: a helper thread's @measure call, outside any
    step of its own, is a step of that thread; the training thread's step keeps no phase of
    it, and both lose their peak (one counter per device), with the reason."""
    seen = []

    @stepprof.measure("worker")
    def work():
        seen.append(threading.get_ident())

    with make(log, gpu) as prof:
        with prof.step("main"):
            t = threading.Thread(target=work, name="helper")
            t.start()
            t.join()
    main, worker = sorted(steps(log), key=lambda r: r["name"])
    assert seen and main["name"] == "main" and main["phases"] == {} and "thread" not in main
    assert worker["name"] == "worker" and worker["thread"] == "helper"
    for r in (main, worker):
        assert r["peak_allocated_bytes"] is None and "overlapped" in r["unavailable"]["peak_allocated_bytes"]
    assert prof.summary.steps == 2


def test_each_thread_records_into_its_own_innermost_profiler(tmp_path):
    """Two threads, each with its own ``with Profiler``: the active profiler is per thread, so
    the first thread's steps do not go to the profiler the second thread opened meanwhile."""
    a_open, b_open, a_done = threading.Event(), threading.Event(), threading.Event()
    gpus = {"a": FakeGpu(), "b": FakeGpu()}
    summaries, errors = {}, []

    def run(name, opened, wait_for, done=None):
        try:
            with make(str(tmp_path / f"{name}.jsonl"), gpus[name]) as prof:
                opened.set()
                wait_for.wait(5)
                with stepprof.profile_step(name):
                    pass
                if done is not None:
                    done.set()
                elif not a_done.wait(5):
                    errors.append("thread a never finished its step")
            summaries[name] = prof.summary.steps
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ta = threading.Thread(target=run, args=("a", a_open, b_open, a_done))
    tb = threading.Thread(target=run, args=("b", b_open, a_open))
    ta.start()
    tb.start()
    ta.join()
    tb.join()
    assert not errors
    assert summaries == {"a": 1, "b": 1}
    assert [r["name"] for r in steps(str(tmp_path / "a.jsonl"))] == ["a"]
    assert [r["name"] for r in steps(str(tmp_path / "b.jsonl"))] == ["b"]


def test_interpreter_exit_flushes_the_default_profiler(tmp_path):
    path = tmp_path / "exit.jsonl"
    code = (
        "import stepprof\n"
        f"stepprof.configure(log={str(path)!r})\n"
        "for _ in range(3):\n"
        "    with stepprof.profile_step():\n"
        "        pass\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    kinds = [r["kind"] for r in stepprof.read(path)]
    assert kinds == ["step", "step", "step", "summary"]


def test_host_rss_is_the_figure_psutil_gives_and_falls_back_to_psutil(monkeypatch):
    import os

    import psutil

    rss = _registry.HostRss()
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
    fallback = _registry.HostRss()
    assert abs(fallback.read() - psutil.Process().memory_info().rss) < 8 << 20
    assert fallback._process is not None and fallback._fd is None


def test_reset_forgets_every_piece_of_state(tmp_path, gpu):
    default = stepprof.configure(log=str(tmp_path / "default.jsonl"))
    entered = make(str(tmp_path / "entered.jsonl"), gpu).__enter__()
    _registry.MEMORY_MARKS.baselines["cuda:0"] = "a mark"
    assert _registry.take_no_log_warning()
    leftover = _registry.reset()
    assert leftover == [entered] and default.closed and _registry.default_profiler() is None
    assert _registry.innermost() is None and not _registry.MEMORY_MARKS.baselines
    assert _registry.take_no_log_warning()  # warned again after a reset
    entered.close()
