"""The sync routes that patch torch ("warn") and take its GPU-trace callbacks ("trace"),
on the CPU: what they wrap, what they restore, and when.

A route is installed once per profiler session (its first watched step) and restored at
close, at fork (in the child) and at interpreter exit.  torch's CPU build has no
sync-debug mode: ``torch_sync`` stands in for it (the mode, and a wait that warns as torch
does in mode "warn"), and the profiler tests drive the real "warn" route through a
``FakeGpu`` that holds it.
"""

from __future__ import annotations

import _thread
import contextlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest
import torch
from torch._utils import CallbackRegistry

import stepprof
from stepprof import _syncs
from stepprof._aggregate import RunAggregate
from stepprof._device import sync_routes
from stepprof._recorder import core as core_mod

from .conftest import make, marked_line
from .fakes import FakeGpu, PlannedGpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def line_of(marker: str) -> str:
    return marked_line(__file__, marker)


class TorchSync:
    """torch's sync-debug mode (0 default, 1 warn, 2 error) and a wait under it."""

    def __init__(self) -> None:
        self.mode = 0
        self.sets = 0  # how often the mode was set (stepprof sets it once per session)

    def set(self, mode: int) -> None:
        self.sets += 1
        self.mode = mode

    def wait(self) -> None:
        """A stream wait (``.item()``): what torch does in each mode."""
        if self.mode == 1:
            warnings.warn(f"{_syncs.SYNC_MESSAGE} (Triggered internally)", UserWarning, stacklevel=2)
        elif self.mode == 2:
            raise RuntimeError(_syncs.SYNC_MESSAGE)


@pytest.fixture
def torch_sync(monkeypatch) -> TorchSync:
    ts = TorchSync()
    monkeypatch.setattr(torch._C, "_cuda_get_sync_debug_mode", lambda: ts.mode, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_set_sync_debug_mode", ts.set, raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)  # no CUDA here
    monkeypatch.setattr(sync_routes.ROUTES, "warn_route", None)
    return ts


@pytest.fixture(params=[FakeGpu, PlannedGpu])
def warn_gpu(torch_sync, request) -> FakeGpu:
    """A fake device whose profilers hold the real "warn" route; on a PlannedGpu, the C step
    core watches syncs itself while the route's checks hold."""
    gpu = request.param()
    gpu.route = sync_routes.warn_route()
    return gpu


def state():
    """What the "warn" route changes, as the user sees it."""
    return (torch._C._cuda_get_sync_debug_mode(), list(warnings.filters), warnings._showwarnmsg,
            warnings.showwarning, torch.cuda.synchronize, torch.cuda.Event.synchronize)


def steps(log):
    return list(stepprof.read(log, kind="step"))


# -- the routes alone --------------------------------------------------------------


def test_warn_route_wraps_what_is_there_and_restores_it(torch_sync, monkeypatch):
    """The "warn" route's wrappers: made once, but a function the user replaced between
    sessions is wrapped anew; each session's close puts back what was there."""
    tracker = _syncs.SyncTracker("warn")
    for replaced in (False, True):
        if replaced:
            def users_sync(device=None):
                pass

            monkeypatch.setattr(torch.cuda, "synchronize", users_sync)
        before = torch.cuda.synchronize
        sessions = _syncs.Sessions()
        tracker.begin([], None, "count", True)
        assert sessions.watch(tracker, sync_routes.warn_route) is None
        try:
            assert torch.cuda.synchronize is not before
            torch.cuda.synchronize()  # device-wrapped
        finally:
            sessions.unwatch(tracker)
            sessions.end()
        rec = tracker.end()
        assert torch.cuda.synchronize is before
        assert [(s["where"], s["kind"]) for s in rec["sites"]] == [
            (line_of("device-wrapped"), "device_synchronize")
        ]


@pytest.mark.skipif(core_mod._STATE.module is None, reason="stepprof's C module is not built here")
def test_the_warn_routes_checks_hold_exactly_while_ensure_has_nothing_to_do(torch_sync, monkeypatch):
    """``WarnRoute.checks()`` is what ``ensure()`` checks, as data, and the step core's own
    test of them (``_core.c``'s ``checks_pass``) is the judge: after each thing a user can move,
    the checks fail, and ensure() gives way or puts it back; after that the route's fresh checks
    hold again."""
    checks_pass = core_mod._STATE.module.checks_pass
    route = sync_routes.warn_route()
    sessions = _syncs.Sessions()
    tracker = _syncs.SyncTracker("warn")
    assert sessions.watch(tracker, lambda: route) is None
    sessions.unwatch(tracker)
    try:
        def users_sync(device=None):
            pass

        def users_hook(msg):
            pass

        moves = {
            "nothing": lambda: None,
            "the mode": lambda: setattr(torch_sync, "mode", 2),
            "a filter in front": lambda: warnings.simplefilter("ignore"),
            "no filter at all": lambda: warnings.resetwarnings(),
            "the hook": lambda: monkeypatch.setattr(warnings, "_showwarnmsg", users_hook),
            "a function": lambda: monkeypatch.setattr(torch.cuda, "synchronize", users_sync),
        }
        for what, move in moves.items():
            with warnings.catch_warnings():
                checks = sessions.plan("warn")[1]
                assert checks_pass(checks)
                move()
                before = state()
                holds = checks_pass(checks)
                why = route.ensure()
                assert holds is (what == "nothing"), what
                assert (why is None and state() == before) is holds, what  # ensure() did something
                torch_sync.mode = 1
                route.ensure()
                assert checks_pass(sessions.plan("warn")[1]), what
        sessions.end()
        assert sessions.plan("warn") is None  # no session open: no plan
    finally:
        sessions.end()
        torch_sync.mode = 0


def test_a_function_the_user_wrapped_mid_session_counts_once_at_the_next_step(torch_sync, monkeypatch):
    """The user wraps ``torch.cuda.synchronize`` (ours, then) during a step; theirs is wrapped
    at the next step: one call is still one sync, at the user's line.  Theirs stays at close."""
    tracker = _syncs.SyncTracker("warn")
    sessions = _syncs.Sessions()
    records = []
    for step in range(2):
        tracker.begin([], None, "count", True)
        assert sessions.watch(tracker, sync_routes.warn_route) is None
        try:
            if step == 0:
                wrapped = torch.cuda.synchronize

                def users_sync(device=None):
                    return wrapped(device)

                monkeypatch.setattr(torch.cuda, "synchronize", users_sync)
            torch.cuda.synchronize()  # users-wrapped
        finally:
            sessions.unwatch(tracker)
        records.append(tracker.end())
    sessions.end()
    assert torch.cuda.synchronize is users_sync
    assert [r["count"] for r in records] == [1, 1]
    assert [(s["where"], s["kind"]) for s in records[1]["sites"]] == [
        (line_of("users-wrapped"), "device_synchronize")
    ]
    torch.cuda.synchronize()  # after the close: passes through, counted nowhere
    assert sessions.outside(None) == (0, None)


def test_trace_route_counts_a_wait_on_a_thread_with_no_python_frames():
    """With "trace", a wait on one of C++ autograd's threads (no Python frame above torch's
    callback) is counted in other_threads, and outside the steps, as documented."""
    done = threading.Event()
    registry = CallbackRegistry("stream synchronization")  # as in torch.cuda._gpu_trace
    registry.add_callback(sync_routes.on_stream_sync)
    registry.add_callback(lambda *_: done.set())
    tracker = _syncs.SyncTracker("trace")
    tracker.begin([], None, "count", True)
    sessions = _syncs.Sessions()
    assert sessions.watch(tracker, sync_routes.trace_route) is None
    try:
        # What torch's C++ does on its own thread: fire the callbacks, no Python frame above.
        _thread.start_new_thread(registry.fire_callbacks, (0,))
        assert done.wait(10)
    finally:
        sessions.unwatch(tracker)
        sessions.end()
    rec = tracker.end()
    assert rec["count"] == 0 and rec["other_threads"] == 1
    assert sessions.outside(None) == (1, None)
    assert not sync_routes.ROUTES.trace_on


def test_a_tracker_takes_only_its_own_routes_waits():
    """Two routes installed at once (a "warn" and a "trace" profiler): a wait reaches a step
    through its own mechanism's route only, so it is never counted twice."""
    warn, trace = _syncs.SyncTracker("warn"), _syncs.SyncTracker("trace")
    for tracker in (warn, trace):
        tracker.begin([], None, "count", True)
        _syncs.attach(tracker)
        try:
            _syncs.dispatch(None, sys._getframe(), traced=False)
            _syncs.dispatch(None, sys._getframe(), traced=True)
        finally:
            _syncs.detach(tracker)
        assert tracker.end()["count"] == 1


def test_stepprofs_own_waits_count_nowhere(gpu):
    """A wait of stepprof's own (the close's wait on the steps' events) is nobody's sync."""
    sessions = _syncs.Sessions()
    sessions.watch(_syncs.SyncTracker("fake"), lambda: gpu.route)
    _syncs.detach()
    with _syncs.OWN_WAITS:
        gpu.sync()
    gpu.sync()
    sessions.end()
    assert sessions.outside(None) == (1, None)


def test_a_sync_debug_mode_the_user_set_mid_session_is_left_in_place(torch_sync):
    tracker = _syncs.SyncTracker("warn")
    sessions = _syncs.Sessions()
    tracker.begin([], None, "count", True)
    assert sessions.watch(tracker, sync_routes.warn_route) is None
    try:
        assert torch_sync.mode == 1  # stepprof's, while the session is open
        torch._C._cuda_set_sync_debug_mode(2)  # the user's: "error" from here on
    finally:
        sessions.unwatch(tracker)
    tracker.end()
    why = sessions.watch(tracker, sync_routes.warn_route)  # the next step gives way
    assert why is not None and "'error'" in why
    sessions.end()
    assert torch_sync.mode == 2
    assert sessions.outside(None) == (None, why)
    torch_sync.mode = 0  # the user's setting ends with the test (the fake stays patched until teardown)


def test_reset_forgets_the_warn_route_and_turns_the_trace_off(monkeypatch):
    routes = sync_routes._RouteState()
    monkeypatch.setattr(sync_routes, "ROUTES", routes)
    routes.warn_route = object()
    routes.trace_registered = routes.trace_on = routes.prototype_quiet = True
    routes.trace_probe = []
    routes.reset()
    assert routes.warn_route is None and routes.trace_probe is None and not routes.trace_on
    # torch cannot unregister its callbacks, and warns about the prototype once per process
    assert routes.trace_registered and routes.prototype_quiet


def test_the_trace_route_turns_the_callbacks_on_while_a_session_holds_it(monkeypatch):
    monkeypatch.setattr(sync_routes, "ROUTES", sync_routes._RouteState())
    route = sync_routes.trace_route()
    first, second = _syncs.open_session(route), _syncs.open_session(route)
    assert sync_routes.ROUTES.trace_on
    _syncs.close_session(first)
    assert sync_routes.ROUTES.trace_on  # the other session still holds it
    _syncs.close_session(second)
    assert not sync_routes.ROUTES.trace_on


# -- a profiler's session, with the real "warn" route ------------------------------


def test_the_route_is_installed_once_for_many_steps_and_restored_at_close(log, warn_gpu, torch_sync):
    before = state()
    with make(log, warn_gpu) as prof:
        for i in range(5):
            with prof.step():
                torch_sync.wait()
            if i == 0:
                during = state()
                assert during[0] == 1 and during[1][0][0] == "always"
                assert during[2:] != before[2:] and during[3] is before[3]  # showwarning: never touched
            assert state() == during  # the same installation between every two steps
        assert torch_sync.sets == 1 and warn_gpu.route.installed
    assert state() == before and torch_sync.sets == 2
    assert not warn_gpu.route.installed and not _syncs.installed()
    assert [r["syncs"]["count"] for r in steps(log)] == [1] * 5
    assert prof.summary.syncs_outside_steps == 0 and "syncs_outside_steps" not in prof.summary.unavailable


def test_restored_after_an_exception_in_a_step_and_out_of_the_with(log, warn_gpu, torch_sync):
    """A step that raised leaves nothing in the next step's syncs; an exception out of the
    ``with Profiler`` still restores everything."""
    before = state()
    with pytest.raises(KeyError):
        with make(log, warn_gpu) as prof:
            with pytest.raises(ValueError):
                with prof.step():
                    torch_sync.wait()
                    raise ValueError("planted")
            assert not _syncs._trackers  # the raised step's tracker is gone
            with prof.step():
                pass
            raise KeyError("out of the with")
    assert state() == before
    failed, clean = steps(log)
    assert failed["error"]["type"] == "ValueError" and failed["syncs"]["count"] == 1
    assert clean["syncs"] == {"count": 0, "waits": 0, "sites": [], "other_threads": 0, "mechanism": "fake"}
    assert prof.summary.ended_by == "exception" and prof.summary.syncs_outside_steps == 0


def test_a_sync_between_steps_counts_outside_steps_and_in_no_step(log, warn_gpu, torch_sync):
    with make(log, warn_gpu) as prof:
        with prof.step():
            torch_sync.wait()
        torch_sync.wait()           # between steps: a stream wait...
        torch.cuda.synchronize()    # ...and a device wait (wrapped)
        with prof.step():
            worker = threading.Thread(target=torch_sync.wait)  # another thread, a step open here
            worker.start()
            worker.join()
        with prof.step():
            pass
    assert [(r["syncs"]["count"], r["syncs"]["other_threads"]) for r in steps(log)] == [(1, 0), (0, 1), (0, 0)]
    assert prof.summary.syncs_outside_steps == 3
    assert "3 syncs outside steps" in str(prof.summary)
    # The log's summary record carries it: a report of the log shows the same figure.
    (record,) = stepprof.read(log, kind="summary")
    assert record["syncs_outside_steps"] == 3
    agg = RunAggregate()
    for r in stepprof.read(log):
        agg.add(r)
    assert agg.summary_fields()["syncs_outside_steps"] == 3


def test_a_sync_outside_steps_counts_once_in_each_open_session(tmp_path, torch_sync):
    gpus = [FakeGpu(), FakeGpu()]
    for g in gpus:
        g.route = sync_routes.warn_route()
    profs = [make(str(tmp_path / f"{i}.jsonl"), g) for i, g in enumerate(gpus)]
    for p in profs:
        with p.step():
            pass
    torch_sync.wait()
    first = profs[0].close()
    assert torch_sync.mode == 1  # the other session still holds the route
    torch_sync.wait()
    second = profs[1].close()
    assert (first.syncs_outside_steps, second.syncs_outside_steps) == (1, 2)
    assert torch_sync.mode == 0


@pytest.mark.parametrize(("mode", "says"), [(2, "'error'"), (0, "'default' (off)")])
def test_a_mode_the_user_sets_mid_session_is_given_way_to_and_kept(log, warn_gpu, torch_sync, mode, says):
    with make(log, warn_gpu) as prof:
        with prof.step():
            torch_sync.wait()
        torch._C._cuda_set_sync_debug_mode(mode)  # the user's
        with prof.step():
            with pytest.raises(RuntimeError) if mode == 2 else contextlib.nullcontext():
                torch_sync.wait()
    first, second = steps(log)
    assert first["syncs"]["count"] == 1
    assert second["syncs"] is None and says in second["unavailable"]["syncs"]
    assert torch_sync.mode == mode  # theirs, kept after the close
    assert prof.summary.syncs_outside_steps is None
    assert says in prof.summary.unavailable["syncs_outside_steps"]
    torch_sync.mode = 0


def test_counting_resumes_once_the_mode_is_back(log, warn_gpu, torch_sync):
    with make(log, warn_gpu) as prof:
        for mode in (None, 0, 1):  # stepprof's "warn", then the user's off, then "warn" again
            if mode is not None:
                torch_sync.mode = mode
            with prof.step():
                torch_sync.wait()
    assert [r["syncs"] and r["syncs"]["count"] for r in steps(log)] == [1, None, 1]
    assert torch_sync.mode == 0  # "warn" at the close, as stepprof set it: off again


def test_a_cuda_backend_that_watches_syncs_its_own_way_gives_the_core_no_plan():
    """``CudaBackend.sync_plan`` promises that its watch is the base class's: a subclass that
    overrides ``watch_syncs`` or ``unwatch_syncs`` gets None, so the core calls its own."""
    from stepprof._device.compiled import CompiledCudaBackend
    from stepprof._device.cuda import CudaBackend

    from .fakes import FakeRoute

    class OwnUnwatch(CudaBackend):
        def unwatch_syncs(self, tracker):
            _syncs.detach(tracker)

    class OwnWatch(CudaBackend):
        def watch_syncs(self, tracker):
            return "not counted here"

    for cls, planned in ((CudaBackend, True), (CompiledCudaBackend, True), (OwnUnwatch, False),
                         (OwnWatch, False)):
        b = object.__new__(cls)  # (no CUDA here: only what sync_plan reads)
        b.sync_mechanism = "warn"
        b._sessions = _syncs.Sessions()
        tracker = _syncs.SyncTracker("warn")
        assert b._sessions.watch(tracker, FakeRoute) is None
        b._sessions.unwatch(tracker)
        try:
            assert (b.sync_plan() is not None) is planned, cls.__name__
        finally:
            b._sessions.end()


def test_a_step_after_the_filters_were_reset_is_still_counted(log, warn_gpu, torch_sync):
    """``warnings.resetwarnings()`` between steps empties the filter list, stepprof's filter
    with it: the next step puts it back and counts (on the core's sync plan too, whose check
    of the list's first filter then finds none)."""
    with warnings.catch_warnings(), make(log, warn_gpu) as prof:
        for i in range(4):
            if i == 2:
                warnings.resetwarnings()
            with prof.step():
                torch_sync.wait()
    assert [r["syncs"]["count"] for r in steps(log)] == [1, 1, 1, 1]


def test_catch_warnings_and_simplefilter_around_a_step(log, warn_gpu, torch_sync):
    """A user's filter put in front of stepprof's (``catch_warnings()`` + ``simplefilter``)
    around a step: the step's syncs are still counted, and the user's filters are theirs."""
    before = list(warnings.filters)
    shown = []
    with make(log, warn_gpu) as prof:
        with prof.step():
            pass
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with prof.step():
                torch_sync.wait()
            assert ("ignore", None, Warning, None, 0) in warnings.filters  # theirs, still there
            warnings.warn("the user's own warning, ignored as they asked")
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            warnings.showwarning = lambda message, *a, **k: shown.append(str(message))

            def sync():
                torch_sync.wait()  # one location

            sync()  # under their "default": counted outside, and now in the location's registry
            with prof.step():
                sync()  # not hidden by the registry
        after_blocks = list(warnings.filters)
    assert [r["syncs"]["count"] for r in steps(log)] == [0, 1, 1]
    assert after_blocks[1:] == before  # the user's own list, with only stepprof's in front
    assert list(warnings.filters) == before
    assert shown == [] and prof.summary.syncs_outside_steps == 1


def test_the_users_warn_mode_is_forwarded_and_kept(log, warn_gpu, torch_sync):
    torch_sync.mode = 1  # the user's own "warn"
    shown = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *a, **k: shown.append(str(message))
        with make(log, warn_gpu) as prof:
            with prof.step():
                torch_sync.wait()
            torch_sync.wait()
    assert torch_sync.mode == 1 and torch_sync.sets == 0  # theirs: never set, kept
    assert len(shown) == 2 and all(_syncs.SYNC_MESSAGE in m for m in shown)  # passed on to them
    assert steps(log)[0]["syncs"]["count"] == 1 and prof.summary.syncs_outside_steps == 1
    torch_sync.mode = 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_gets_the_process_state_back(log, warn_gpu, torch_sync):
    before = state()
    prof = make(log, warn_gpu)
    with prof.step():
        torch_sync.wait()
    during = state()
    assert during != before
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what it has, and leave without running pytest's exit
        try:
            now = state()
            report = {"restored": now == before, "mode": now[0],
                      "sessions": len(_syncs._sessions), "trackers": len(_syncs._trackers)}
        except BaseException as e:  # noqa: BLE001
            report = {"error": repr(e)}
        os.write(write, json.dumps(report).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        report = json.loads(f.read())
    os.waitpid(pid, 0)
    assert report == {"restored": True, "mode": 0, "sessions": 0, "trackers": 0}
    assert state() == during  # the parent's session goes on
    with prof.step():
        torch_sync.wait()
    prof.close()
    assert state() == before
    assert [r["syncs"]["count"] for r in steps(log)] == [1, 1]


_EXIT_SCRIPT = """\
import atexit, json, sys, warnings
import torch

mode = [0]
torch._C._cuda_get_sync_debug_mode = lambda: mode[0]
torch._C._cuda_set_sync_debug_mode = lambda m: mode.__setitem__(0, m)
torch.cuda.synchronize = lambda device=None: None  # the CPU build's would fail
original = (warnings._showwarnmsg, torch.cuda.synchronize)

def report():  # registered before stepprof is imported: runs after stepprof's handlers
    ours = [f for f in warnings.filters if "synchronizing" in getattr(f[1], "pattern", "")]
    now = (warnings._showwarnmsg, torch.cuda.synchronize)
    print(json.dumps({"mode": mode[0], "filter": bool(ours), "hook_and_function": now == original}))

atexit.register(report)

from stepprof._device import sync_routes
from tests.conftest import make
from tests.fakes import FakeGpu

gpu = FakeGpu()
gpu.route = sync_routes.warn_route()
prof = make(sys.argv[1], gpu)
with prof.step():
    pass
report()
# exits with the profiler open
"""


def test_interpreter_exit_restores_an_open_session(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_EXIT_SCRIPT), str(tmp_path / "exit.jsonl")],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    during, at_exit = (json.loads(line) for line in out.stdout.strip().splitlines()[-2:])
    assert during == {"mode": 1, "filter": True, "hook_and_function": False}
    assert at_exit == {"mode": 0, "filter": False, "hook_and_function": True}
    (summary,) = stepprof.read(str(tmp_path / "exit.jsonl"), kind="summary")
    assert summary["ended_by"] == "exit" and summary["syncs_outside_steps"] == 0
