"""Sync points on the CPU: attribution to the user's line, kinds, de-duplication, budgets,
the warning route's plumbing, and restoring global state."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings

import pytest

import stepprof
from stepprof import _syncs
from stepprof._recorder.profiler import _make_profiler

from . import fake_torch
from .conftest import make, marked_line
from .fake_torch import FakeTensor



@pytest.fixture(autouse=True)
def fake_torch_is_internal(monkeypatch):
    monkeypatch.setattr(
        _syncs, "_INTERNAL_PREFIXES", (*_syncs._INTERNAL_PREFIXES, fake_torch.__file__)
    )


def line_of(marker: str) -> str:
    return marked_line(__file__, marker)


def steps(log):
    return [r for r in stepprof.read(log) if r["kind"] == "step"]


def sites(record):
    return {(s["where"], s["kind"]): (s["count"], s["waits"]) for s in record["syncs"]["sites"]}


def test_each_kind_is_named_and_attributed_to_the_users_line(log, gpu, monkeypatch):
    monkeypatch.setitem(_syncs.WAITS_PER_CALL, "repeat_interleave", 2)  # as calibrated on CUDA
    t = FakeTensor(gpu)
    mask = FakeTensor(gpu)
    with make(log, gpu) as prof:
        with prof.step():
            t.item()  # item
            t.tolist()  # tolist
            t.cpu()  # cpu
            t.to("cpu")  # to-cpu
            t.cuda()  # cuda
            float(t)  # float
            if t > 0:  # if
                pass
            t.nonzero()  # nonzero
            t[mask]  # mask
            fake_torch.masked_select(t, mask)  # masked_select
            fake_torch.unique(t)  # unique
            t.repeat_interleave(2)  # repeat_interleave
            print(t)  # print
            f"{t}"  # fstring
            t.synchronize()  # stream
            fake_torch.synchronize(gpu)  # device
            t.to("cpu", non_blocking=True)
            t[mask] = 1.0
    (rec,) = steps(log)
    expected = {
        (line_of("item"), "item"): (1, 1),
        (line_of("tolist"), "tolist"): (1, 1),
        (line_of("cpu"), "to_host"): (1, 1),
        (line_of("to-cpu"), "to_host"): (1, 1),
        (line_of("cuda"), "to_device"): (1, 1),
        (line_of("float"), "scalar"): (1, 1),
        (line_of("if"), "bool"): (1, 1),
        (line_of("nonzero"), "nonzero"): (1, 1),
        (line_of("mask"), "mask_index"): (1, 1),
        (line_of("masked_select"), "masked_select"): (1, 1),
        (line_of("unique"), "unique"): (1, 1),
        # One C++ op that waits twice per call (calibrated): one call, two waits.
        (line_of("repeat_interleave"), "repeat_interleave"): (1, 2),
        (line_of("print"), "print"): (1, 3),
        (line_of("fstring"), "print"): (1, 3),
        (line_of("stream"), "stream_synchronize"): (1, 1),
        (line_of("device"), "device_synchronize"): (1, 1),
    }
    assert sites(rec) == expected
    assert rec["syncs"]["count"] == 16
    assert rec["syncs"]["waits"] == 16 + 1 + 2 + 2
    by_where = {s["where"]: s for s in rec["syncs"]["sites"]}
    assert by_where[line_of("item")]["code"] == "t.item()"
    assert by_where[line_of("if")]["code"] == "t > 0"
    assert by_where[line_of("mask")]["code"] == "t[mask]"



def test_a_multi_wait_op_is_measured_once_at_its_first_wait(log, gpu, monkeypatch):
    monkeypatch.setattr(_syncs, "WAITS_PER_CALL", {})
    calls = []

    def probe():  # what the CUDA backend registers: run the op once, count its waits
        calls.append(1)
        gpu.sync()  # a wait while probing is never the user's (the CUDA probe counts its own)
        return 2

    monkeypatch.setattr(_syncs, "PROBES", {"repeat_interleave": probe})
    t = FakeTensor(gpu)
    with make(log, gpu) as prof:
        with prof.step():
            t.item()  # not a multi-wait kind: no probe
            assert calls == []
            for _ in range(2):
                t.repeat_interleave(2)  # probed
        with prof.step():
            t.repeat_interleave(2)  # again
    assert calls == [1] and _syncs.WAITS_PER_CALL == {"repeat_interleave": 2}
    first, second = steps(log)
    assert sites(first)[(line_of("probed"), "repeat_interleave")] == (2, 4)
    assert first["syncs"]["count"] == 3  # item + 2 calls; the probe's wait is not the user's
    assert sites(second) == {(line_of("again"), "repeat_interleave"): (1, 2)}


@pytest.mark.parametrize("calibrated, expected", [(2, (3, 6)), (None, (6, 6))])
def test_a_multi_wait_op_in_a_loop_counts_its_calls(log, gpu, monkeypatch, calibrated, expected):
    if calibrated is not None:
        monkeypatch.setitem(_syncs.WAITS_PER_CALL, "repeat_interleave", calibrated)
    t = FakeTensor(gpu)
    budget = 3 if calibrated else None  # calibrated, three calls are within a budget of 3
    with make(log, gpu, max_syncs=budget, on_sync="raise") as prof:
        with prof.step():
            with prof.measure("model"):
                for _ in range(3):
                    t.repeat_interleave(2)  # loop
    (rec,) = steps(log)
    assert sites(rec) == {(line_of("loop"), "repeat_interleave"): expected}
    assert rec["syncs"]["count"] == expected[0]
    assert rec["phases"]["model"]["syncs"] == expected[0]


def test_a_line_in_a_loop_counts_every_call(log, gpu):
    t = FakeTensor(gpu)
    with make(log, gpu) as prof:
        with prof.step():
            for _ in range(3):
                t.item()  # looped
            for _ in range(2):
                print(t)  # printed
    (rec,) = steps(log)
    assert sites(rec) == {
        (line_of("looped"), "item"): (3, 3),
        (line_of("printed"), "print"): (2, 6),
    }


def test_syncs_are_counted_per_phase_and_in_nested_phases(log, gpu):
    t = FakeTensor(gpu)
    with make(log, gpu) as prof:
        with prof.step():
            with prof.measure("forward"):
                t.item()
                with prof.measure("loss"):
                    t.item()
            with prof.measure("backward"):
                pass
            t.item()  # outside any phase: the step's only
    (rec,) = steps(log)
    assert rec["syncs"]["count"] == 3
    assert rec["phases"]["forward"]["syncs"] == 2
    assert rec["phases"]["forward/loss"]["syncs"] == 1
    assert rec["phases"]["backward"]["syncs"] == 0


def test_sync_free_step_counts_zero_and_steps_do_not_share_counts(log, gpu):
    t = FakeTensor(gpu)
    with make(log, gpu) as prof:
        with prof.step():
            t.item()
        with prof.step():
            t > 0
            t.to("cpu", non_blocking=True)
    first, second = steps(log)
    assert first["syncs"]["count"] == 1
    assert second["syncs"] == {
        "count": 0, "waits": 0, "sites": [], "other_threads": 0, "mechanism": "fake",
    }
    assert prof.summary.syncs_per_step_median == 0.5
    assert prof.summary.sync_mechanism == "fake"


def test_waits_on_other_threads_are_counted_apart(log, gpu):
    t = FakeTensor(gpu)
    with make(log, gpu) as prof:
        with prof.step():
            worker = threading.Thread(target=t.item)
            worker.start()
            worker.join()
            t.item()
    (rec,) = steps(log)
    assert rec["syncs"]["count"] == 1
    assert rec["syncs"]["other_threads"] == 1


def test_budget_raise_names_the_site_and_keeps_the_step(log, gpu):
    t = FakeTensor(gpu)
    prof = make(log, gpu, max_syncs=1, on_sync="raise")
    with pytest.raises(stepprof.SyncBudgetExceeded) as info:
        with prof.step():
            t.item()
            t.tolist()  # over
    assert info.value.where == line_of("over")
    assert info.value.kind == "tolist"
    assert info.value.count == 1
    assert "max_syncs=1" in str(info.value) and line_of("over") in str(info.value)
    with prof.step():  # the profiler goes on
        t.item()
    prof.close()
    failed, ok = steps(log)
    assert failed["error"]["type"] == "SyncBudgetExceeded"
    assert ok["error"] is None and ok["syncs"]["count"] == 1
    assert gpu.installs == gpu.uninstalls == 1 and gpu.route.ensures == 2


def test_budget_warn_warns_once_per_site_at_the_users_line(log, gpu):
    t = FakeTensor(gpu)
    prof = make(log, gpu, max_syncs=0, on_sync="warn")
    with pytest.warns(RuntimeWarning, match="max_syncs=0") as caught:
        for _ in range(3):
            with prof.step():
                t.item()  # warned
    prof.close()
    ours = [w for w in caught if "max_syncs" in str(w.message)]
    assert len(ours) == 1
    assert f"{os.path.relpath(ours[0].filename)}:{ours[0].lineno}" == line_of("warned")


def test_budget_is_per_step_overridable_and_skips_warmup(log, gpu):
    t = FakeTensor(gpu)
    prof = make(log, gpu, warmup=1, max_syncs=0, on_sync="raise")
    with prof.step():  # warm-up: lazy initialisation may sync
        t.item()
    with prof.step(max_syncs=2):
        t.item()
        t.item()
    with pytest.raises(stepprof.SyncBudgetExceeded):
        with prof.step():
            t.item()
    prof.close()
    with _make_profiler(None, backend=gpu, clock=gpu.clock, collect_every_s=None):
        with stepprof.profile_step(max_syncs=0, on_sync="raise"):
            with pytest.raises(stepprof.SyncBudgetExceeded):
                t.item()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_syncs": -1}, "'max_syncs' must be an int >= 0 or None \\(got -1\\)"),
        ({"max_syncs": "0"}, "'max_syncs' .*got '0'"),
        ({"max_syncs": True}, "'max_syncs' .*got True"),
        ({"on_sync": "explode"}, "'on_sync' must be one of 'count', 'warn', 'raise' \\(got 'explode'\\)"),
        ({"syncs": "always"}, "'syncs' must be one of 'warn', 'trace', 'off' \\(got 'always'\\)"),
    ],
)
def test_bad_budget_arguments_are_named(log, kwargs, match):
    with pytest.raises(stepprof.ConfigError, match=match):
        stepprof.Profiler(log, **kwargs)
    if "syncs" not in kwargs:
        with pytest.raises(stepprof.ConfigError, match=match):
            stepprof.profile_step(**kwargs)


def test_internal_failure_while_watching_still_detaches(log, gpu):
    t = FakeTensor(gpu)
    prof = make(log, gpu)
    gpu.fail_on = "unwatch_syncs"
    with pytest.warns(RuntimeWarning, match="internal error"):
        with prof.step():
            t.item()
    assert not _syncs._trackers  # detached; the route stays until the close
    gpu.fail_on = None
    prof.close()
    assert not _syncs.installed() and gpu.uninstalls == 1


def test_no_cuda_means_null_syncs_and_allocator_with_reasons(log):
    with stepprof.Profiler(log, device="cpu") as prof:
        with prof.step():
            pass
    (rec,) = steps(log)
    assert rec["syncs"] is None and rec["allocator"] is None
    assert "there is no device for the host to wait on" in rec["unavailable"]["syncs"]
    assert "allocator" in rec["unavailable"]
    assert prof.summary.syncs_per_step_median is None
    assert "syncs_per_step_median" in prof.summary.unavailable


def test_allocator_counters_are_per_step_deltas(log, gpu):
    with make(log, gpu) as prof:
        gpu.counters = [1, 0, 5, 5]  # before the first step: the baseline
        with prof.step():
            gpu.counters = [3, 1, 9, 6]
        with prof.step():
            pass
    first, second = steps(log)
    assert first["allocator"] == {
        "num_alloc_retries": 2, "num_sync_all_streams": 1, "num_device_alloc": 4, "num_device_free": 1,
    }
    assert set(second["allocator"].values()) == {0}


# -- the warning route's plumbing, with real warnings ------------------------------


class TapRoute:
    """A route of the warnings tap alone (no sync-debug mode, no wrappers)."""

    traced = False

    def __init__(self, forward=False):
        self.tap = _syncs.WarningTap(forward=forward)

    def install(self):
        self.tap.install()

    def uninstall(self):
        self.tap.uninstall()

    def ensure(self):
        self.tap.ensure()


@contextlib.contextmanager
def watching(tracker, route):
    """A session of one step: ``route`` installed, ``tracker`` watching, both undone at exit."""
    sessions = _syncs.Sessions()
    assert sessions.watch(tracker, lambda: route) is None
    try:
        yield sessions
    finally:
        sessions.unwatch(tracker)
        sessions.end()


class _Shown:
    """The user's own ``showwarning`` (pytest.warns would re-emit what it did not match)."""

    def __enter__(self):
        self.messages, self._previous = [], warnings.showwarning
        warnings.showwarning = lambda message, *args, **kwargs: self.messages.append(str(message))
        return self

    def __exit__(self, *exc):
        warnings.showwarning = self._previous


def test_warning_tap_counts_sync_warnings_and_passes_the_rest_on():
    tracker = _syncs.SyncTracker("warn")
    tracker.begin([], None, "count", True)
    with _Shown() as shown:
        filters, show = list(warnings.filters), warnings.showwarning
        with watching(tracker, TapRoute()):
            for _ in range(2):
                warnings.warn(f"{_syncs.SYNC_MESSAGE} (Triggered internally)")  # tapped
            warnings.warn("the user's own warning")
        assert warnings.filters == filters and warnings.showwarning is show
    rec = tracker.end()
    assert [(s["where"], s["count"]) for s in rec["sites"]] == [(line_of("tapped"), 2)]
    assert shown.messages == ["the user's own warning"]


def test_the_users_once_per_location_warnings_stay_shown_once_across_steps():
    tap = _syncs.WarningTap(forward=False)  # one tap for the process, installed at every step
    with warnings.catch_warnings(), _Shown() as shown:
        warnings.simplefilter("default")  # Python's default: once per location
        for _ in range(4):
            tap.install()
            try:
                warnings.warn("the user's own warning, every step")  # every step
            finally:
                tap.uninstall()
    assert shown.messages == ["the user's own warning, every step"]


def test_a_sync_warning_shown_before_stepprof_is_still_counted():
    with warnings.catch_warnings(), _Shown() as shown:
        warnings.simplefilter("default")

        def sync():
            warnings.warn(_syncs.SYNC_MESSAGE)  # the location

        sync()  # shown once by the user's own "warn" mode: now in the location's registry
        tracker = _syncs.SyncTracker("warn")
        tracker.begin([], None, "count", True)
        with watching(tracker, TapRoute()):
            sync()
    assert shown.messages == [_syncs.SYNC_MESSAGE]
    assert tracker.end()["count"] == 1


def test_warning_tap_forwards_sync_warnings_when_the_user_had_them_on():
    tracker = _syncs.SyncTracker("warn")
    tracker.begin([], None, "count", True)
    with _Shown() as shown:
        with watching(tracker, TapRoute(forward=True)):
            warnings.warn(_syncs.SYNC_MESSAGE)
    assert tracker.end()["count"] == 1
    assert shown.messages == [_syncs.SYNC_MESSAGE]


def test_budget_raise_propagates_through_the_warning_machinery():
    tracker = _syncs.SyncTracker("warn")
    tracker.begin([], 0, "raise", True)
    with watching(tracker, TapRoute()):
        with pytest.raises(stepprof.SyncBudgetExceeded, match="max_syncs=0"):
            warnings.warn(_syncs.SYNC_MESSAGE)
    tracker.end()


def test_uninstall_leaves_a_showwarning_hook_installed_after_ours():
    show = warnings.showwarning
    tracker = _syncs.SyncTracker("warn")
    tracker.begin([], None, "count", True)

    def users_hook(*args, **kwargs):
        pass

    with watching(tracker, TapRoute()):
        warnings.showwarning = users_hook
    try:
        assert warnings.showwarning is users_hook
    finally:
        warnings.showwarning = show
    tracker.end()


def test_classify_falls_back_to_the_line_without_positions(monkeypatch):
    monkeypatch.setattr(_syncs.dis, "get_instructions", lambda code: iter(()))
    frame = sys._getframe()
    kind, text = _syncs.classify(frame)  # this line has no call that syncs
    assert kind is None and "classify" in text


def test_two_profilers_with_steps_open_on_one_thread(log, gpu, tmp_path):
    """The inner step gets the waits; the outer one keeps counting once the inner closes."""
    t = FakeTensor(gpu)
    other = str(tmp_path / "inner.jsonl")
    outer, inner = make(log, gpu), make(other, gpu)
    with outer.step():
        t.item()
        with inner.step():
            t.item()
            t.item()
        t.item()
    outer.close()
    inner.close()
    assert steps(log)[0]["syncs"]["count"] == 2
    assert steps(other)[0]["syncs"]["count"] == 2
    assert not _syncs.installed() and gpu.installs == gpu.uninstalls == 1


def test_a_showwarnmsg_hook_chained_mid_session_counts_once_and_gets_the_rest():
    """The user wraps ``_showwarnmsg`` during a session (chaining to what was there: ours).
    At the next step ours goes back in front of theirs: a sync still counts once, and does
    not loop; their hook still gets every other warning; theirs stays after the close."""
    route = TapRoute()
    seen = []
    original = warnings._showwarnmsg
    tracker = _syncs.SyncTracker("warn")
    sessions = _syncs.Sessions()
    try:
        with _Shown() as shown:
            for step in range(3):
                tracker.begin([], None, "count", True)
                assert sessions.watch(tracker, lambda: route) is None
                try:
                    if step == 0:
                        chained = warnings._showwarnmsg

                        def users_hook(msg):
                            seen.append(str(msg.message))
                            chained(msg)

                        warnings._showwarnmsg = users_hook
                    warnings.warn(_syncs.SYNC_MESSAGE)  # chained-sync
                    warnings.warn(f"the user's own warning {step}")
                finally:
                    sessions.unwatch(tracker)
                assert tracker.end()["count"] == 1
            sessions.end()
            assert warnings._showwarnmsg is users_hook  # theirs, set since: left in place
            warnings.warn("after the close")
    finally:
        warnings._showwarnmsg = original
    assert shown.messages == [f"the user's own warning {i}" for i in range(3)] + ["after the close"]
    # Their hook saw the first sync (it was in front then) and every warning of theirs.
    assert seen == [_syncs.SYNC_MESSAGE] + [f"the user's own warning {i}" for i in range(3)] + [
        "after the close"
    ]


def test_budget_raise_with_the_trace_route_is_not_swallowed(log, monkeypatch):
    """With "trace", torch calls stepprof from C++ (through ``fire_callbacks``, which logs what
    a callback raises): SyncBudgetExceeded must still reach the user, with the step's error."""
    from stepprof._device import sync_routes

    from . import fakes

    monkeypatch.setattr(_syncs, "_INTERNAL_PREFIXES", (*_syncs._INTERNAL_PREFIXES, fakes.__file__))
    gpu = fakes.TracedGpu()
    t = FakeTensor(gpu)
    prof = make(log, gpu, max_syncs=0, on_sync="raise")
    with pytest.raises(stepprof.SyncBudgetExceeded) as info:
        with prof.step():
            t.item()  # traced-over
            t.item()
    assert (info.value.where, info.value.kind, info.value.count) == (line_of("traced-over"), "item", 1)
    prof.close()
    (rec,) = steps(log)
    assert rec["error"]["type"] == "SyncBudgetExceeded"
    assert rec["syncs"]["count"] == 2
    assert not _syncs.installed() and not sync_routes.ROUTES.trace_on


def test_a_probe_taken_by_another_thread_is_not_an_error(monkeypatch):
    """Two threads meeting a multi-wait op's first wait at once: the second finds the probe
    gone (the first took it) and counts on, rather than raising KeyError in the user's step."""
    class Taken(dict):  # "in" still saw the probe; another thread popped it since
        def __contains__(self, key):
            return True

    monkeypatch.setattr(_syncs, "PROBES", Taken())
    monkeypatch.setattr(_syncs, "WAITS_PER_CALL", {})
    tracker = _syncs.SyncTracker("fake")
    tracker.begin([], None, "count", False)
    frame = sys._getframe()
    entry = tracker._new_location(frame.f_code, frame.f_lasti, "repeat_interleave", frame, frame)
    assert entry[1][1] == "repeat_interleave" and entry[3] == 1


# -- the session: the route held from the first step to the close ---------------------


def test_the_route_is_held_from_the_first_step_to_the_close(log, gpu):
    t = FakeTensor(gpu)
    prof = make(log, gpu)
    assert gpu.installs == 0  # nothing before the first step
    for _ in range(5):
        with prof.step():
            t.item()
        assert not _syncs._trackers  # per step only the tracker comes and goes
    assert (gpu.installs, gpu.uninstalls, gpu.route.ensures) == (1, 0, 5) and _syncs.installed()
    prof.close()
    assert (gpu.installs, gpu.uninstalls) == (1, 1) and not _syncs.installed()
    prof.close()  # again: nothing more
    assert gpu.uninstalls == 1


def test_a_route_that_gives_way_nulls_the_steps_and_the_outside_count(log, gpu):
    t = FakeTensor(gpu)
    why = "torch's sync-debug mode is 'error' (set outside stepprof), so a sync raises instead of being counted"
    with make(log, gpu) as prof:
        for give_way in (None, why, None):
            gpu.route.give_way = give_way
            with prof.step():
                t.item()
            t.item()  # between steps
    counted, gave_way, again = steps(log)
    assert counted["syncs"]["count"] == again["syncs"]["count"] == 1
    assert gave_way["syncs"] is None and gave_way["unavailable"]["syncs"] == why
    assert prof.summary.syncs_outside_steps is None
    assert prof.summary.unavailable["syncs_outside_steps"] == why


@pytest.mark.parametrize("case", ["cpu", "off", "no step"])
def test_syncs_outside_steps_is_null_with_the_reason_when_not_counted(log, gpu, case):
    if case == "cpu":
        prof = stepprof.Profiler(log, device="cpu")
        expected = "there is no device for the host to wait on"
    elif case == "off":
        gpu.sync_reason = expected = "sync tracking was turned off (syncs='off')"
        prof = make(log, gpu)
    else:
        prof = make(log, gpu)
        expected = _syncs.NOT_WATCHED
    if case != "no step":
        with prof.step():
            pass
    summary = prof.close()
    assert summary.syncs_outside_steps is None
    assert expected in summary.unavailable["syncs_outside_steps"]
    (record,) = stepprof.read(log, kind="summary")
    assert record["syncs_outside_steps"] is None
    assert expected in record["unavailable"]["syncs_outside_steps"]


def test_a_signals_summary_has_the_outside_count_so_far(log, gpu):
    t = FakeTensor(gpu)
    prof = make(log, gpu)
    with prof.step():
        pass
    t.item()
    prof._on_signal("SIGTERM")
    t.item()
    prof.close()
    first, last = stepprof.read(log, kind="summary")
    assert (first["syncs_outside_steps"], last["syncs_outside_steps"]) == (1, 2)


def test_a_failure_ending_the_session_still_closes_with_a_summary(log, gpu):
    prof = make(log, gpu)
    with prof.step():
        pass
    gpu.fail_on = "end_syncs"
    with pytest.warns(RuntimeWarning, match="internal error"):
        summary = prof.close()
    assert summary.steps == 1 and "end_syncs" in summary.unavailable["stepprof"]
    gpu.fail_on = None
    _syncs.close_all()  # what the failed end left held (at exit, the hub's handler does this)
