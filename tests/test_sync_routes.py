"""The sync routes that patch torch ("warn") and take its GPU-trace callbacks ("trace"),
on the CPU: what they wrap, what they restore, and a wait with no Python caller."""

from __future__ import annotations

import _thread
import threading

import torch
from torch._utils import CallbackRegistry

from stepprof import _syncs
from stepprof._device import sync_routes

from .conftest import marked_line


def line_of(marker: str) -> str:
    return marked_line(__file__, marker)


def test_warn_route_wraps_what_is_there_and_restores_it(monkeypatch):
    """The "warn" route's wrappers: made once, but a function the user replaced is wrapped anew."""
    monkeypatch.setattr(torch._C, "_cuda_get_sync_debug_mode", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_set_sync_debug_mode", lambda m: None, raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)  # no CUDA here
    monkeypatch.setattr(sync_routes.ROUTES, "warn_route", None)
    tracker = _syncs.SyncTracker("warn")
    for replaced in (False, True):
        if replaced:
            def users_sync(device=None):
                pass

            monkeypatch.setattr(torch.cuda, "synchronize", users_sync)
        before = torch.cuda.synchronize
        tracker.begin([], None, "count", True)
        _syncs.attach(tracker, sync_routes.install_warn_route)
        try:
            assert torch.cuda.synchronize is not before
            torch.cuda.synchronize()  # device-wrapped
        finally:
            _syncs.detach()
        rec = tracker.end()
        assert torch.cuda.synchronize is before
        assert [(s["where"], s["kind"]) for s in rec["sites"]] == [
            (line_of("device-wrapped"), "device_synchronize")
        ]


def test_a_function_the_user_wrapped_during_a_step_counts_once_at_the_next(monkeypatch):
    """The user wraps ``torch.cuda.synchronize`` (ours, then) during a step; theirs is left in
    place and wrapped at the next step: one call is still one sync, at the user's line."""
    monkeypatch.setattr(torch._C, "_cuda_get_sync_debug_mode", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_set_sync_debug_mode", lambda m: None, raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)  # no CUDA here
    monkeypatch.setattr(sync_routes.ROUTES, "warn_route", None)
    tracker = _syncs.SyncTracker("warn")
    records = []
    for step in range(2):
        tracker.begin([], None, "count", True)
        _syncs.attach(tracker, sync_routes.install_warn_route)
        try:
            if step == 0:
                wrapped = torch.cuda.synchronize

                def users_sync(device=None):
                    return wrapped(device)

                monkeypatch.setattr(torch.cuda, "synchronize", users_sync)
            torch.cuda.synchronize()  # users-wrapped
        finally:
            _syncs.detach()
        records.append(tracker.end())
    assert [r["count"] for r in records] == [1, 1]
    assert [(s["where"], s["kind"]) for s in records[1]["sites"]] == [
        (line_of("users-wrapped"), "device_synchronize")
    ]


def test_trace_route_counts_a_wait_on_a_thread_with_no_python_frames():
    """With "trace", a wait on one of C++ autograd's threads (no Python frame above torch's
    callback) is counted in other_threads, as documented."""
    done = threading.Event()
    registry = CallbackRegistry("stream synchronization")  # as in torch.cuda._gpu_trace
    registry.add_callback(sync_routes.on_stream_sync)
    registry.add_callback(lambda *_: done.set())
    tracker = _syncs.SyncTracker("trace")
    tracker.begin([], None, "count", True)
    _syncs.attach(tracker, sync_routes.install_trace_route)
    try:
        # What torch's C++ does on its own thread: fire the callbacks, no Python frame above.
        _thread.start_new_thread(registry.fire_callbacks, (0,))
        assert done.wait(10)
    finally:
        _syncs.detach()
    rec = tracker.end()
    assert rec["count"] == 0 and rec["other_threads"] == 1


def test_a_sync_debug_mode_the_user_set_during_a_step_is_left_in_place(monkeypatch):
    mode = [0]
    monkeypatch.setattr(torch._C, "_cuda_get_sync_debug_mode", lambda: mode[0], raising=False)
    monkeypatch.setattr(torch._C, "_cuda_set_sync_debug_mode", lambda m: mode.__setitem__(0, m),
                        raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)  # no CUDA here
    monkeypatch.setattr(sync_routes.ROUTES, "warn_route", None)
    tracker = _syncs.SyncTracker("warn")
    tracker.begin([], None, "count", True)
    _syncs.attach(tracker, sync_routes.install_warn_route)
    try:
        assert mode == [1]  # stepprof's, while the step is open
        torch._C._cuda_set_sync_debug_mode(2)  # the user's: "error" from here on
    finally:
        _syncs.detach()
    tracker.end()
    assert mode == [2]
    mode[0] = 0  # the user's setting ends with the test (the fake stays patched until teardown)


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


def test_the_trace_route_turns_the_callbacks_on_while_installed(monkeypatch):
    monkeypatch.setattr(sync_routes, "ROUTES", sync_routes._RouteState())
    (undo,) = sync_routes.install_trace_route()
    assert sync_routes.ROUTES.trace_on
    undo()
    assert not sync_routes.ROUTES.trace_on
