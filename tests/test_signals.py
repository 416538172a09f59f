"""SIGTERM and SIGINT: the summary is written (``ended_by``), the user's handler runs, and the
process does on the signal exactly what it would have done without stepprof."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import stepprof
from stepprof import _signals

pytestmark = [pytest.mark.skipif(not hasattr(signal, "SIGTERM") or os.name != "posix", reason="POSIX signals"),
              pytest.mark.usefixtures("either_path")]


def records(log, kind):
    return list(stepprof.read(log, kind=kind))


def test_sigterm_with_a_user_handler_writes_the_summary_calls_the_handler_and_training_goes_on(log):
    called = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: called.append(signum))
    try:
        with stepprof.Profiler(log, device="cpu") as prof:
            assert signal.getsignal(signal.SIGTERM) is not previous  # stepprof's, in front
            for i in range(5):
                with prof.step(batch_size=2):
                    if i == 2:
                        signal.raise_signal(signal.SIGTERM)
        assert called == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is not _signals._handler  # put back at close
    finally:
        signal.signal(signal.SIGTERM, previous)
    first, last = records(log, "summary")
    assert first["ended_by"] == "SIGTERM" and first["steps"] == 2  # written before the signal went on
    assert last["ended_by"] == "SIGTERM" and last["steps"] == 5  # training went on; close wrote it again
    assert prof.summary.ended_by == "SIGTERM"


def test_sigint_raises_keyboardinterrupt_as_before_and_the_summary_says_sigint(log):
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):
        with stepprof.Profiler(log, device="cpu") as prof:
            for i in range(5):
                with prof.step():
                    if i == 3:
                        signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    steps = records(log, "step")
    assert [s["error"] for s in steps[:3]] == [None] * 3
    assert steps[3]["error"]["type"] == "KeyboardInterrupt"
    summaries = records(log, "summary")
    assert [s["ended_by"] for s in summaries] == ["SIGINT", "SIGINT"]  # at the signal, then at close
    assert summaries[-1]["steps"] == 4 and summaries[-1]["error_steps"] == 1


def test_an_ignored_signal_stays_ignored(log):
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with stepprof.Profiler(log, device="cpu"):
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGINT) is _signals._handler
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_handler_the_user_installs_later_is_left_in_place_at_close(log):
    mine = lambda signum, frame: None  # noqa: E731
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with stepprof.Profiler(log, device="cpu"):
            signal.signal(signal.SIGTERM, mine)
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_profiler_opened_off_the_main_thread_installs_nothing_and_raises_nothing(log):
    before = signal.getsignal(signal.SIGTERM)
    seen, errors = [], []

    def run():
        try:
            with stepprof.Profiler(log, device="cpu") as prof:
                seen.append(signal.getsignal(signal.SIGTERM))
                with prof.step():
                    pass
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert not errors and seen == [before]


def _steps_in(log):
    with open(log, "rb") as f:
        return sum(b'"kind":"step"' in line for line in f)


def test_a_signal_inside_the_training_threads_own_harvest_waits_for_it_and_loses_no_step(log):
    """SIGTERM lands mid-harvest on the main thread (a flush, or an inline catch-up): the
    handler runs once that harvest is done, so the log already holds every step by then."""
    seen = []  # the user's handler: the steps the log held when it ran
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(_steps_in(log)))
    try:
        with stepprof.Profiler(log, device="cpu", flush_every_s=3600) as prof:
            def watcher(record):
                if record["step"] == 3 and threading.current_thread() is threading.main_thread():
                    signal.raise_signal(signal.SIGTERM)  # Python runs the handler right here
                    signal.raise_signal(signal.SIGTERM)  # (twice: pending twice is pending once)
                    assert seen == []  # deferred: the harvest this record belongs to goes on

            prof.watch(watcher)
            prof._collector.stop()  # (so that the main thread harvests: the flush below)
            for _ in range(10):
                with prof.step():
                    pass
            prof.flush()
            assert seen == [10]  # after the flush, once: all ten steps were written before it ran
    finally:
        signal.signal(signal.SIGTERM, previous)
    (summary,) = records(log, "summary")  # close had nothing new to add
    assert summary["ended_by"] == "SIGTERM" and summary["steps"] == 10
    assert [r["step"] for r in records(log, "step")] == list(range(10))
    assert _signals._holds == [] and _signals._deferred == []


def test_a_signal_during_close_proceeds_after_the_summary(log):
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(records(log, "summary")))
    try:
        prof = stepprof.Profiler(log, device="cpu", flush_every_s=3600)

        class Raise(stepprof._recorder.hooks.Hook):
            def on_close(self, closing):
                signal.raise_signal(signal.SIGTERM)
                assert seen == []

        prof._hooks.append(Raise())
        for _ in range(4):
            with prof.step():
                pass
        prof.close()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert len(seen) == 1 and [s["steps"] for s in seen[0]] == [4]  # close's own summary, whole
    assert [s["ended_by"] for s in records(log, "summary")] == ["close"]


CHILD = textwrap.dedent("""
    import os, signal, sys, time
    import stepprof
    log, mode = sys.argv[1], sys.argv[2]
    if mode == "handler":
        def on_term(signum, frame):
            os.write(1, b"handler\\n")
            sys.exit(7)
        signal.signal(signal.SIGTERM, on_term)
    use = os.environ.get("NO_STEPPROF") is None
    prof = stepprof.Profiler(log, device="cpu") if use else None
    os.write(1, b"ready\\n")
    i = 0
    while True:
        if prof is not None:
            with prof.step(batch_size=4):
                time.sleep(0.001)
        else:
            time.sleep(0.001)
        i += 1
""")


def _run_child(tmp_path, mode, sig, env_extra=None):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    log = str(tmp_path / f"{mode}-{env_extra is not None}.jsonl")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **(env_extra or {})}
    p = subprocess.Popen([sys.executable, str(script), log, mode], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    assert p.stdout.readline() == b"ready\n"
    time.sleep(0.3)
    p.send_signal(sig)
    out, err = p.communicate(timeout=60)
    return p.returncode, out.decode(), err.decode(), log


@pytest.mark.parametrize("mode, sig", [("default", signal.SIGTERM), ("default", signal.SIGINT),
                                       ("handler", signal.SIGTERM)])
def test_a_real_signal_ends_the_process_as_without_stepprof_and_the_summary_is_written(tmp_path, mode, sig):
    reference = _run_child(tmp_path, mode, sig, {"NO_STEPPROF": "1"})[0]
    code, out, err, log = _run_child(tmp_path, mode, sig)
    assert code == reference, (code, reference, err[-2000:])
    if mode == "handler":
        assert out.splitlines()[-1] == "handler"
    summaries = records(log, "summary")
    assert summaries and summaries[-1]["ended_by"] == signal.Signals(sig).name, err[-2000:]
    steps = records(log, "step")
    assert steps and summaries[-1]["steps"] >= len(steps) - 1


def test_a_second_sigint_just_as_the_first_ones_summary_takes_the_lock_waits_and_leaves_it_free(log):
    """Ctrl-C twice: the second SIGINT lands just after the first one's handler took the
    collector's lock, where a real handler runs too (after a call returns).  It waits until
    the lock is let go, then ends the loop as before; a lock left held made close hang."""
    import linecache

    fired = []

    def local(frame, event, arg):
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).lstrip()
        if event == "line" and not fired and line.startswith("try:"):
            fired.append(frame.f_lineno)
            signal.raise_signal(signal.SIGINT)
        return local

    def tracer(frame, event, arg):
        return local if event == "call" and frame.f_code.co_name == "_on_signal" else None

    prof = stepprof.Profiler(log, device="cpu")
    with pytest.raises(KeyboardInterrupt):
        for i in range(5):
            with prof.step():
                if i == 3:
                    sys.settrace(tracer)
                    try:
                        signal.raise_signal(signal.SIGINT)
                    finally:
                        sys.settrace(None)
    held = prof._collector.lock.locked()
    if held:
        prof._collector.lock.release()  # (else close would wait forever)
    prof.close()
    assert fired and not held
    assert _signals._holds == [] and _signals._deferred == []
    summaries = records(log, "summary")
    assert {s["ended_by"] for s in summaries} == {"SIGINT"} and summaries[-1]["steps"] == 4
