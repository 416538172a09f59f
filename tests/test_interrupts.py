"""Interrupts inside stepprof's boundaries: an exception injected at every point of a step.

A ``KeyboardInterrupt`` (what Python's SIGINT handler raises) or an exception raised by a
signal handler (the usual timeout pattern) can land at any bytecode, stepprof's included.
``sys.settrace`` finds every line and call event that stepprof's code (and the fake
device's) runs during one step with nested phases, and the exception is then injected at
each of them in turn: raised by the trace function itself (a KeyboardInterrupt), or by a
real signal handler that the trace function triggers with ``signal.raise_signal``.

At every point: the exception that reaches the loop is the very one injected; the loop
catches it and goes on; the next steps record normally; the interrupted step either never
started or is recorded with that exception as its error; recording never stops; and the
global state (sync route, warning filters) is restored (checked by conftest).
"""

from __future__ import annotations

import linecache
import os
import signal
import sys
import warnings

import pytest

import stepprof
from stepprof import _syncs

from stepprof._recorder.profiler import _make_profiler

from .conftest import make
from .fakes import FakeGpu

#: The fault suite runs on the step core and on the Python boundaries.
pytestmark = pytest.mark.usefixtures("either_path")
_STEPPROF_DIR = os.path.dirname(stepprof.__file__) + os.sep
_FAKES = os.path.join(os.path.dirname(__file__), "fakes.py")
PHASES = {"fwd", "fwd/inner", "bwd"}
#: The collector thread writes the records, as in a real run (settrace sees only the
#: training thread): an interrupt lands only where the training thread runs stepprof.
COLLECT_EVERY_S = 0.002


class Injected(Exception):
    """What the test's signal handler raises: an ordinary exception, the user's."""


class WatchdogError(OSError):
    """A custom ``OSError`` subclass, as a watchdog library might raise."""


#: What the signal handler raises, by ``how``: the classes a guard around stepprof's own
#: I/O would catch if it looked at the class alone (TimeoutError and InterruptedError are
#: OSErrors, like a failed read of /proc).
RAISED_BY_HANDLER = {"signal": Injected, "timeout": TimeoutError, "interrupted": InterruptedError,
                     "oserror": WatchdogError}


def _ours(filename: str) -> bool:
    return filename.startswith(_STEPPROF_DIR) or filename == _FAKES


def one_step(prof, form: str) -> None:
    """A step with two top-level phases and a nested one, in one of the three scope forms."""
    if form == "with":
        with prof.step(batch_size=2):
            with stepprof.measure("fwd"):
                with stepprof.measure("inner"):
                    pass
            with stepprof.measure("bwd"):
                pass
        return

    @stepprof.measure("inner")
    def inner():
        pass

    @stepprof.measure("fwd")
    def fwd():
        inner()

    @stepprof.measure("bwd")
    def bwd():
        pass

    @stepprof.measure("step")
    def train_step():
        fwd()
        bwd()

    if form == "decorator":
        train_step()
    else:  # "mixed": a with-step around decorated phases
        with prof.step(batch_size=2):
            fwd()
            bwd()


def _profiler(log: str, gpu):
    """A profiler on the fake GPU, or (``gpu`` None) on the real host backend."""
    if gpu is None:
        return _make_profiler(log, device="cpu", collect_every_s=COLLECT_EVERY_S, energy_every_s=None)
    return make(log, gpu, collect_every_s=COLLECT_EVERY_S)


def _on_try_line(frame) -> bool:
    """Line events that no real signal can reproduce, skipped as injection points.

    A ``try:`` line's event fires at a NOP that the exception table does not cover, and a
    ``with`` line's fires again before the block's own ``__exit__`` call; raising from the
    trace function at either can leave a ``with lock:`` held (a CPython artefact).  A real
    signal's handler runs only where the interpreter checks for one (a call, a backward
    jump), where this cannot happen.
    """
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).lstrip()
    return line.startswith(("try:", "with "))


class Injector:
    """A trace function that counts stepprof's events and raises at the ``at``-th one."""

    def __init__(self, at: int | None, how: str) -> None:
        self.at = at
        self.how = how
        self.events = 0
        self.raised: BaseException | None = None
        self.where = ""  # the injection point

    def __call__(self, frame, event, arg):
        if event == "call" and not _ours(frame.f_code.co_filename):
            return None  # not traced inside: only stepprof's own lines count
        if event == "call" or (event == "line" and not _on_try_line(frame)):
            if self.events == self.at:
                self.events += 1
                self.where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} {event} in {frame.f_code.co_name}"
                self._raise()
            self.events += 1
        return self

    def _raise(self) -> None:
        if self.how == "keyboard":
            self.raised = KeyboardInterrupt("injected")
            raise self.raised
        # A real signal: its handler runs at the next check of the interpreter, here in
        # the trace function, and what it raises propagates into the traced frame.
        signal.raise_signal(signal.SIGUSR1)


def count_events(form: str, log: str, gpu) -> int:
    with _profiler(log, FakeGpu() if gpu is not None else None) as prof:
        for _ in range(3):  # warm: the backend, the contexts, the first memory records
            one_step(prof, form)
        tracer = Injector(None, "keyboard")
        sys.settrace(tracer)
        try:
            one_step(prof, form)
        finally:
            sys.settrace(None)
    return tracer.events


@pytest.mark.parametrize("device", ["fake-gpu", "host"])
@pytest.mark.parametrize("how", ["keyboard", *RAISED_BY_HANDLER])
@pytest.mark.parametrize("form", ["with", "decorator", "mixed"])
def test_an_interrupt_at_every_point_of_a_step_propagates_and_the_next_step_records(log, gpu, form, how, device):
    if device == "host":  # the host backend: the RSS read at each step's exit, no device events
        gpu = None
    if how in ("interrupted", "oserror") and form != "with":
        pytest.skip("the handler's class matters only to the guards, which every form reaches")
    n = count_events(form, log + ".count", gpu)
    assert n > 40, n  # the tracer sees stepprof's code
    raised: list[BaseException] = []

    def handler(signum, frame):
        raised.append(RAISED_BY_HANDLER.get(how, Injected)("timeout"))
        raise raised[-1]

    previous = signal.signal(signal.SIGUSR1, handler)
    caught = []
    injected = 0  # a step's events vary a little (the first harvest, say): some `at` are past them
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "stepprof stopped recording" would fail here
            with _profiler(log, gpu) as prof:
                for at in range(n):
                    tracer = Injector(at, how)
                    sys.settrace(tracer)
                    try:
                        one_step(prof, form)
                    except (KeyboardInterrupt, Injected, OSError) as e:
                        assert tracer.where, at  # raised by the injector, nowhere else
                        # Compared here and let go: like a loop that catches and goes on, the
                        # test keeps no reference to the exception (or its frames).
                        caught.append((at, e is (tracer.raised if how == "keyboard" else raised[-1])))
                    finally:
                        sys.settrace(None)
                        tracer.raised = None
                        raised.clear()
                    injected += bool(tracer.where)
                    one_step(prof, form)  # the loop goes on: this one records normally
                    assert prof._boundaries.broken is None, (at, prof._boundaries.broken)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert not _syncs._trackers  # every step's sync watch was undone
    # The exception that reached the loop is the one injected, every time it was raised.
    assert len(caught) == injected > 0.9 * n, (len(caught), injected, n)
    assert all(same for _, same in caught), [at for at, same in caught if not same]
    records = list(stepprof.read(log, kind="step"))
    assert [r["step"] for r in records] == sorted(r["step"] for r in records)
    normal = [r for r in records if r["error"] is None]
    interrupted = [r for r in records if r["error"] is not None]
    # Every step after an injection recorded normally, with its three phases.
    assert len(normal) >= n
    for r in normal:
        assert set(r["phases"]) == PHASES, r
        assert all(p["count"] == 1 for p in r["phases"].values()), r
    raised_type = "KeyboardInterrupt" if how == "keyboard" else RAISED_BY_HANDLER[how].__name__
    expected = {raised_type, "Interrupted"}
    assert {r["error"]["type"] for r in interrupted} <= expected
    # An interrupted step either never started or was recorded: never both, never twice.
    assert len(records) <= 2 * n


def test_the_orphan_thresholds_match_the_references_stepprof_holds(log, gpu):
    """An open step (phase) held by nothing but stepprof is what the boundaries call orphaned."""
    from stepprof._recorder import boundaries as bd

    with make(log, gpu) as prof:
        scope = prof.step()
        scope.__enter__()
        ctx = prof._boundaries.context()
        step = ctx.step
        held_by_scope = sys.getrefcount(step)  # + this local + the scope's token list
        phase_scope = stepprof.measure("p")
        phase_scope.__enter__()
        held_phase = sys.getrefcount(ctx.stack[-1])  # the stack + the scope's token list
        phase_scope.__exit__(None, None, None)
        scope.__exit__(None, None, None)
    # Drop the scope's hold (and this test's local) and the counts reach the thresholds.
    assert held_by_scope - 1 == bd._STEP_ORPHANED
    assert held_phase - 1 == bd._PHASE_ORPHANED


def test_a_step_whose_exit_never_ran_is_closed_at_the_next_entry(log, gpu):
    """An interrupt at the very start of the scope's __exit__ leaves the step open, held by
    nobody: the thread's next step closes it (recorded with the reason) instead of raising
    "steps do not nest"."""
    with make(log, gpu) as prof:
        scope = prof.step("lost")
        scope.__enter__()
        del scope  # its exit never runs
        with prof.step("next"):
            pass
    lost, nxt = list(stepprof.read(log, kind="step"))
    assert lost["name"] == "lost" and lost["error"]["type"] == "Interrupted"
    assert nxt["name"] == "next" and nxt["error"] is None
    assert not _syncs._trackers


def test_a_nested_step_is_still_refused_while_its_scope_holds_it(log, gpu):
    with make(log, gpu) as prof:
        with prof.step("outer"):
            with pytest.raises(stepprof.UsageError, match="steps do not nest"):
                with prof.step("inner"):
                    pass
    (outer,) = list(stepprof.read(log, kind="step"))
    assert outer["error"] is None


def test_an_ordinary_exception_from_a_signal_handler_is_the_users_not_an_internal_error(log, gpu):
    """The timeout pattern: a SIGALRM-style handler raises; it lands inside stepprof's code
    (the fake device's mark, here); it propagates unchanged and recording goes on."""
    fired = []

    def handler(signum, frame):
        fired.append(1)
        raise TimeoutError("step took too long")

    previous = signal.signal(signal.SIGUSR1, handler)
    mark = gpu.mark

    def mark_then_signal():
        m = mark()
        if not fired:
            signal.raise_signal(signal.SIGUSR1)  # the handler runs inside stepprof's boundary
        return m

    gpu.mark = mark_then_signal
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with make(log, gpu) as prof:
                with pytest.raises(TimeoutError, match="too long"):
                    with prof.step("a"):
                        pass
                with prof.step("b"):
                    pass
    finally:
        signal.signal(signal.SIGUSR1, previous)
    a, b = list(stepprof.read(log, kind="step"))
    assert a["error"] == {"type": "TimeoutError", "message": "step took too long"}
    assert b["error"] is None and prof.summary.unavailable.get("stepprof") is None


def _harvest_lines(at: int | None, how: str):
    """An :class:`Injector` over the lines of ``Collector.harvest_if_free`` and
    ``take_over`` only, ``try:`` lines included: one there follows a call that may have
    taken the lock, where a real signal's handler runs too."""
    inner = Injector(at, how)

    def local(frame, event, arg):
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).lstrip()
        if event in ("call", "line") and not line.startswith("with "):
            if inner.events == at:
                inner.events += 1
                inner.where = f"{frame.f_code.co_name}:{frame.f_lineno}"
                inner._raise()
            inner.events += 1
        return local

    def tracer(frame, event, arg):
        if event == "call" and frame.f_code.co_name in ("harvest_if_free", "take_over"):
            return local(frame, event, arg)
        return None

    return inner, tracer


@pytest.mark.parametrize("how", ["keyboard", "timeout"])
def test_an_interrupt_as_a_step_harvests_before_the_collector_thread_never_leaves_its_lock_held(log, how):
    """Until the first step's exit starts the collector thread, a step closed after an
    interrupt (here an orphan, closed at the next entry) harvests on the training thread.
    An exception at any point of that harvest's locking leaves the collector's lock free:
    a lock left held made the next harvest wait forever (the watchdog test hung once)."""
    def handler(signum, frame):
        raise RAISED_BY_HANDLER.get(how, Injected)("timeout")

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        at, points = 0, None
        while points is None or at < points:
            with _profiler(log, FakeGpu()) as prof:
                lost = prof.step("lost")
                lost.__enter__()
                del lost  # its exit never runs: the next entry closes it and harvests
                inner, tracer = _harvest_lines(at, how)
                sys.settrace(tracer)
                try:
                    with prof.step("next"):
                        pass
                except (KeyboardInterrupt, *RAISED_BY_HANDLER.values()):
                    pass
                finally:
                    sys.settrace(None)
                held = prof._collector.lock.locked()
                if held:
                    prof._collector.lock.release()  # (else the close below waits forever)
                assert not held, f"the lock was left held by an interrupt at {inner.where}"
                if inner.where == "":  # ran to the end: every point has been tried
                    points = inner.events
            at += 1
        assert points >= 4, points  # harvest_if_free's and take_over's own lines were traced
    finally:
        signal.signal(signal.SIGUSR1, previous)
