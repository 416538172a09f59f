"""The step core (stepprof/_core.c) against the Python boundaries it stands in for.

The same scripted loops run on the fake GPU (its clock is deterministic) through the core and
through ``Boundaries`` alone: the records must be equal field for field, and so must every slot
of the steps the collector receives.  The core must take the common boundaries itself, leave
the rare ones to Python, and hand back the very exception a callback raised.
"""

from __future__ import annotations

import gc
import threading

import pytest

import stepprof
from stepprof import _syncs
from stepprof._device.backend import MARK, POP, PUSH, READ, RESET
from stepprof._device.compiled import CompiledCudaBackend
from stepprof._recorder import core as core_mod
from stepprof._recorder.hooks import Hook
from stepprof._recorder.step import OpenPhase, PhaseTotals, Step

from .conftest import make, steps
from .fakes import FakeEvent, FakeGpu, PlannedGpu

pytestmark = pytest.mark.skipif(core_mod._STATE.module is None, reason="stepprof's C module is not built here")

#: The figures that differ between two runs of the same loop: the run and the wall clock.
_RUN = ("run_id", "start_unix_s", "unix_s", "hostname", "pid", "log")


def _records(log: str) -> list[dict]:
    out = []
    for r in stepprof.read(log):
        r = {k: v for k, v in r.items() if k not in _RUN}
        if "data_ms" in r:  # stepprof.iterate times the fetch on the real clock
            r["data_ms"] = r["data_ms"] is not None
        out.append(r)
    return out


def _event(mark):
    """A fake event as the device time it stands for."""
    return None if mark is None else mark.t_ns


class _Slots(Hook):
    """Every slot of each step as the collector receives it (identities as types)."""

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def on_record(self, step: Step, record: dict) -> None:
        out = {}
        for name in Step.__slots__:
            v = getattr(step, name)
            if name in ("ctx", "backend"):
                v = type(v).__name__
            elif name == "phases":
                v = {k: (t.t0, t.wall_ns, [(_event(a), _event(b)) for a, b in t.marks], t.peak, t.count, t.syncs)
                     for k, t in v.items()}
            elif name in ("start_mark", "end_mark"):
                v = _event(v)
            elif name == "flat":
                v = tuple(_event(e) for e in v)
            elif name == "data_ns":  # (the real clock: see _records)
                v = v >= 0
            out[name] = v
        self.seen.append(out)


def _loop(prof, gpu: FakeGpu) -> None:
    """Steps of every common shape, and a few that the core leaves to Python."""
    m = prof.measure
    for i in range(6):  # plain steps, with and without a batch size, and data waits
        gpu.host(0.3)
        with prof.step(batch_size=8 if i % 2 else None):
            gpu.alloc(100 * (i + 1))
            gpu.launch(1.0)
            gpu.free(100 * (i + 1))
    for i in range(5):  # phases: nested, repeated, peaks in and between them
        with prof.step("train", batch_size=16):
            with m("forward"):
                gpu.alloc(50)
                gpu.launch(0.5)
                with m("attention"):
                    gpu.alloc(30)
                    gpu.free(30)
            gpu.alloc(7 * i)
            gpu.free(7 * i)
            for _ in range(2):
                with m("backward"):
                    gpu.launch(0.7)
                    gpu.host(0.1)
            with m("optimizer"):
                gpu.free(50)
    with pytest.raises(ZeroDivisionError):  # the user's exception: recorded, and theirs
        with prof.step(batch_size=4):
            with m("forward"):
                gpu.launch(0.2)
                1 / 0  # noqa: B018

    @prof.measure("decorated")
    def decorated(batch):
        gpu.launch(0.3)

    for _ in range(3):  # a measured function opens the step; its batch's size is inferred (Python)
        decorated([[1, 2], [3, 4], [5, 6]])
    for x in prof.iterate([1, 2, 3]):  # the wait for each batch
        gpu.host(0.2)
        with prof.step(batch_size=x):
            gpu.launch(0.1)
    prof.begin_step(2, "begun", global_step=7)  # the framework form
    prof.begin_phase("fwd")
    gpu.launch(0.2)
    prof.end_phase("fwd")
    prof.end_step()


def _profiler(path: str, log: str, gpu: FakeGpu, **settings) -> stepprof.Profiler:
    """A profiler on ``gpu`` through the step core (``path`` "c") or Python's boundaries alone."""
    with pytest.MonkeyPatch.context() as mp:
        if path == "python":
            mp.setattr(core_mod._STATE, "module", None)
        return make(log, gpu, **settings)


@pytest.mark.parametrize("settings", [
    {},
    {"warmup": 0},
    {"phase_peaks_every": 1},
    {"phase_peaks_every": 0},
    {"warmup": 2, "phase_peaks_every": 3, "memory_every": 4},
    {"overhead_budget": 0.05},
    {"overhead_budget": 0.5, "warmup": 1},
])
def test_the_core_writes_what_python_writes(tmp_path, settings):
    runs = {}
    for path in ("c", "python"):
        gpu = FakeGpu()
        log = str(tmp_path / f"{path}.jsonl")
        prof = _profiler(path, log, gpu, **settings)
        slots = _Slots()
        prof._hooks.append(slots)
        prof._collector.use(prof._hooks)
        core = getattr(prof._enter, "__self__", None)
        assert (type(core).__name__ == "Core") is (path == "c")
        _loop(prof, gpu)
        prof.close()
        runs[path] = (_records(log), slots.seen, core.counts() if path == "c" else None)
    (c_records, c_slots, counts), (py_records, py_slots, _) = runs["c"], runs["python"]
    assert len(c_records) == len(py_records) > 20
    for a, b in zip(c_records, py_records):
        assert a == b
    assert c_slots == py_slots
    entries, exits = counts
    assert entries >= 40 and exits >= 40  # the common boundaries ran in C


def _sync_loop(prof, gpu: PlannedGpu) -> None:
    """Steps with and without syncs, in phases, under a budget, while the route gives way, and
    with the route's hold broken and repaired; syncs outside any step."""
    m = prof.measure
    for i in range(12):
        if i == 5:
            gpu.route.give_way = "the user set a sync-debug mode"
        if i == 7:
            gpu.route.give_way = None
        with prof.step(batch_size=4):
            gpu.launch(0.5)
            if i % 3 == 0:
                gpu.sync("item")
            with m("forward"):
                if i % 4 == 1:
                    gpu.sync()
                    gpu.sync()
        if i == 9:
            gpu.sync()  # outside a step
    with pytest.raises(stepprof.SyncBudgetExceeded):
        with prof.step(batch_size=4, max_syncs=1, on_sync="raise"):
            gpu.sync()
            gpu.sync()
    with prof.step(batch_size=4):
        gpu.sync()


def test_the_cores_sync_watch_is_the_backends(tmp_path):
    """With a backend's sync plan, the core attaches and detaches the tracker itself while the
    plan's checks hold, and ends a sync-free step's count itself: the same records and slots as
    Python's, and the same trackers attached afterwards (none)."""
    runs = {}
    for path in ("c", "python"):
        gpu = PlannedGpu()
        log = str(tmp_path / f"{path}.jsonl")
        prof = _profiler(path, log, gpu, warmup=2)
        slots = _Slots()
        prof._hooks.append(slots)
        prof._collector.use(prof._hooks)
        _sync_loop(prof, gpu)
        assert not _syncs._trackers  # every tracker detached
        prof.close()
        runs[path] = (_records(log), slots.seen, gpu.route.ensures)
    (c_records, c_slots, c_ensures), (py_records, py_slots, py_ensures) = runs["c"], runs["python"]
    assert len(c_records) == len(py_records) > 14
    for a, b in zip(c_records, py_records):
        assert a == b
    assert c_slots == py_slots
    steps_ = [r for r in c_records if r["kind"] == "step"]
    assert [r["syncs"]["count"] if r["syncs"] else None for r in steps_] == [
        1, 2, 0, 1, 0, None, None, 0, 0, 3, 0, 0, 2, 1]
    assert py_ensures == 14  # one a step
    # In C: the first step's, the two that gave way, and the one after (the plan made anew).
    assert c_ensures == 4


def test_without_a_plan_the_backends_own_unwatch_runs_every_step(log):
    """A backend whose sync_plan gives None (one that watches its own way): the core leaves
    every watch and unwatch to it."""
    class OwnWay(PlannedGpu):
        unwatched = 0

        def sync_plan(self):
            return None

        def unwatch_syncs(self, tracker):
            OwnWay.unwatched += 1
            _syncs.detach(tracker)

    gpu = OwnWay()
    prof = make(log, gpu)
    for _ in range(6):
        with prof.step():
            gpu.launch(0.1)
    prof.close()
    assert OwnWay.unwatched == 6 and gpu.route.ensures == 6
    assert not _syncs._trackers


def test_a_sync_plan_whose_check_raises_fails_the_entry_as_ensure_would(log):
    """A check that raises (a user's object in the way) is the entry's failure, as the route's
    ensure() raising is on the Python path: recording stops, training goes on."""
    gpu = PlannedGpu()
    prof = make(log, gpu)
    with prof.step():
        pass

    class Broken:
        @property
        def give_way(self):
            raise RuntimeError("broken check")

    assert type(prof._enter.__self__).__name__ == "Core"
    plan = gpu.sync_plan()
    gpu.sync_plan = lambda: (plan[0], ((Broken(), "give_way", None, None),))
    with prof.step():  # the plan is made anew after this step's slow watch
        pass
    with pytest.warns(stepprof.StepprofWarning, match="stopped recording .* broken check"):
        with prof.step():
            gpu.launch(0.1)
    with prof.step():
        gpu.launch(0.1)
    prof.close()
    assert not _syncs._trackers
    assert len(steps(log)) == 2


def test_a_step_made_in_c_has_every_slot_of_one_made_in_python(log, gpu):
    """The core copies a new object's defaults from one its class made (configure_core): a
    slot added to Step with a default is filled in C too."""
    prof = make(log, gpu)
    with prof.step():
        pass
    with prof.step() as scope:
        token = scope._tokens[-1][1]
        with prof.measure("a") as ph_scope:
            phase = ph_scope._tokens[-1][1]
    prof.close()
    assert type(token) is Step and type(phase) is OpenPhase
    for name in Step.__slots__:
        getattr(token, name)  # every slot is set
    total = token.phases["a"]
    assert type(total) is PhaseTotals and total.count == 1 and total.marks and total.marks[0][0] is phase.mark
    # Waiting for the harvest, they stay out of the cyclic GC's lists (_core.c's untrack_totals).
    assert not any(gc.is_tracked(o) for o in (total, total.marks, total.marks[0]))
    assert prof._enter.__self__.counts() == (2, 3)  # all but the first step's entry


def test_the_rare_boundaries_go_to_python(log, gpu):
    prof = make(log, gpu)
    core = prof._enter.__self__
    with prof.step():  # the first step: the backend is chosen in Python
        pass
    assert core.counts() == (0, 1)
    done = threading.Event()

    def other():
        with prof.step():  # another thread's: Python
            pass
        done.set()

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert done.is_set() and core.counts() == (0, 2)
    @prof.measure("step")
    def train_step(batch):
        pass

    train_step([[1], [2]])  # a measured function's batch, whose size is inferred: Python
    assert core.counts() == (0, 3)
    with prof.step():
        with pytest.raises(stepprof.UsageError):
            with prof.step():  # nested steps: Python's error
                pass
    prof.close()
    with pytest.raises(stepprof.UsageError):
        with prof.step():  # closed: Python's error
            pass
    assert len(steps(log)) == 4


def test_an_exception_inside_the_core_is_the_users_and_the_step_is_recorded(log, gpu):
    """A KeyboardInterrupt raised from the backend (a signal landing in a Python callback of
    the core) reaches the loop as the same object; the step is recorded with it."""
    prof = make(log, gpu)
    with prof.step():
        pass
    boom = KeyboardInterrupt("from the backend")
    real = gpu.read_memory
    calls = {"n": 0}

    def read_memory():
        calls["n"] += 1
        if calls["n"] == 1:
            raise boom
        return real()

    gpu.read_memory = read_memory
    with pytest.raises(KeyboardInterrupt) as caught:
        with prof.step(batch_size=3):
            gpu.launch(0.5)
    assert caught.value is boom
    with prof.step():
        pass
    prof.close()
    recs = steps(log)
    assert [r["step"] for r in recs] == [0, 1, 2]
    assert recs[1]["error"] == {"type": "KeyboardInterrupt", "message": "from the backend"}
    assert recs[2]["error"] is None


def test_an_internal_failure_inside_the_core_stops_recording_not_training(log, gpu):
    prof = make(log, gpu)
    with prof.step():
        pass
    gpu.fail_on = "mark"
    with pytest.warns(RuntimeWarning, match="stopped recording"):
        with prof.step():
            gpu.launch(0.5)
    gpu.fail_on = None
    with prof.step():  # recording stopped; training goes on
        pass
    s = prof.close()
    assert "internal error" in s.unavailable["stepprof"]
    assert [r["step"] for r in steps(log)] == [0]


class FakeCompiled(FakeGpu):
    """The compiled CUDA boundary's call and event pool (``CompiledCudaBackend.cross``, which the
    core does in C) on the fake device: a pooled event is recorded in place; while
    ``capturing`` (a CUDA graph), a boundary records none and the event goes back to the pool."""

    boundary = "compiled"
    cross = CompiledCudaBackend.cross
    core_plan = CompiledCudaBackend.core_plan
    release = CompiledCudaBackend.release
    release_marks = CompiledCudaBackend.release_marks

    def __init__(self) -> None:
        super().__init__()
        self.index = 0
        self._events: list[FakeEvent] = []
        self._mask = ~0
        self._py_ranges = 0
        self.created = 0
        self.capturing = False

    def _create(self, index: int) -> FakeEvent:
        self.created += 1
        return FakeEvent(0)

    def _boundary(self, index: int, ev, flags: int, name):
        if flags & POP:
            self.range_pop()
        mark = None
        if flags & MARK and not self.capturing:
            self._maybe_fail("mark")
            self.marks_made += 1
            self.host_ns += self.mark_cost_ns
            ev.t_ns = self.gpu_free_at = max(self.gpu_free_at, self.host_ns)
            mark = ev
        mem = self.read_memory() if flags & READ else None
        if flags & RESET:
            self.reset_peak()
        if flags & PUSH:
            self.range_push(name)
        return mark, mem


def test_the_compiled_boundarys_pool_in_c_is_the_pool_in_python(tmp_path):
    """The core's C twin of CompiledCudaBackend.cross (the CUDA path, tested here on the CPU):
    the same records, the same events made, and every event back in the pool."""
    runs = {}
    for path in ("c", "python"):
        gpu = FakeCompiled()
        log = str(tmp_path / f"{path}.jsonl")
        prof = _profiler(path, log, gpu)
        assert (type(getattr(prof._enter, "__self__", None)).__name__ == "Core") is (path == "c")
        _loop(prof, gpu)
        gpu.capturing = True  # a CUDA graph capture: no event recorded, none lost
        for _ in range(3):
            with prof.step(batch_size=2):
                with prof.measure("forward"):
                    gpu.launch(0.1)
        gpu.capturing = False
        with prof.step(batch_size=2):
            gpu.launch(0.1)
        prof.close()
        runs[path] = (_records(log), gpu.created, len(gpu._events), gpu.ranges)
    assert runs["c"] == runs["python"]
    records, created, pooled, ranges = runs["c"]
    assert created == pooled > 0
    assert sum(r.startswith("+") for r in ranges) == ranges.count("-") > 0  # every range pushed was popped
    captured = [r for r in records if r.get("kind") == "step" and r["gpu_ms"] is None and not r["error"]]
    assert len(captured) == 3


@pytest.mark.parametrize("path", ["core", "python", "asked"])
def test_the_summary_and_stepprof_env_say_whether_the_boundaries_ran_in_c(tmp_path, monkeypatch, path):
    """On the host: ``boundary`` is "compiled" where the step core ran, else "python", with the
    reason and what the compiled one saves, in the summary's text."""
    from stepprof._env import environment, render_env
    from stepprof._recorder.profiler import _make_profiler

    if path == "python":
        monkeypatch.setattr(core_mod._STATE, "module", None)
        monkeypatch.setattr(core_mod._STATE, "reason", "no C compiler (the test's)")
    kw = {"boundary": "python"} if path == "asked" else {}
    with _make_profiler(str(tmp_path / "run.jsonl"), device="cpu", energy_every_s=None, **kw) as prof:
        for _ in range(3):
            with prof.step(batch_size=2):
                pass
    s = prof.summary
    if path == "core":
        assert s.boundary == "compiled" and "boundary" not in s.unavailable
        assert "`stepprof build`" not in str(s)
    else:
        why = "no C compiler (the test's)" if path == "python" else "boundary='python' was asked for"
        assert s.boundary == "python" and s.unavailable["boundary"] == why
        assert why in str(s)
    row = [line for line in render_env(environment()).splitlines() if line.startswith("step core")]
    assert row and (row[0].split()[-1] == "C") is (path != "python")
