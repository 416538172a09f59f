"""The C harvest (``_fold.c``'s ``harvest_steps``) against the Python harvest it stands in for.

The same scripted loops run twice on the fake GPU (or the host, on a fake clock), once with the
collector's C harvest and once without: the logs must be equal record for record, and the C
harvest must have taken the ordinary steps itself.
"""

from __future__ import annotations

import itertools
import sys
import threading
from collections.abc import Callable

import pytest

from stepprof._recorder import collector as collector_mod
from stepprof._recorder import energy as energy_mod
from stepprof._recorder.hooks import Hook
from stepprof._recorder.profiler import _make_profiler

from .conftest import make
from .fakes import FakeGpu, FakeNvml
from .test_core import _loop, _records
from .test_energy import Gate, run_step

pytestmark = pytest.mark.skipif(collector_mod._NATIVE.harvest is None, reason="stepprof's C module is not built here")


def _both(monkeypatch, scenario: Callable[[str], str]) -> tuple[list[dict], list[dict], list[int]]:
    """``scenario(path)`` -> its log, with the C harvest and without: (C's records, Python's, [steps C took, calls])."""
    real = collector_mod._NATIVE.harvest
    taken = [0, 0]

    def counted(plan, pending, n, batch):
        done, logged = real(plan, pending, n, batch)
        taken[0] += done
        taken[1] += 1
        return done, logged

    monkeypatch.setattr(collector_mod._NATIVE, "harvest", counted)
    c_log = scenario("c")
    monkeypatch.setattr(collector_mod._NATIVE, "harvest", None)
    monkeypatch.setattr(energy_mod._NATIVE, "fill", None)
    py_log = scenario("python")
    return _records(c_log), _records(py_log), taken


def _same(c: list[dict], py: list[dict], least: int = 6) -> None:
    assert len(c) == len(py) >= least
    for a, b in zip(c, py):
        assert a == b
        assert list(a) == list(b)  # the keys' order too


@pytest.mark.parametrize("settings", [
    {}, {"warmup": 0}, {"phase_peaks_every": 0}, {"warmup": 2, "memory_every": 3}, {"syncs": "off"},
])
def test_the_c_harvest_writes_what_python_writes_on_the_gpu(tmp_path, monkeypatch, settings):
    def scenario(path: str) -> str:
        log = str(tmp_path / f"{path}.jsonl")
        gpu = FakeGpu()
        prof = make(log, gpu, **settings)
        _loop(prof, gpu)
        prof.close()
        return log

    c, py, (taken, calls) = _both(monkeypatch, scenario)
    _same(c, py)
    memory = [r["trigger"] for r in c if r["kind"] == "memory"]
    assert (memory.count("periodic") > 0) is ("memory_every" in settings) and "close" in memory
    assert taken >= 10


def test_the_c_harvest_writes_what_python_writes_on_the_host(tmp_path, monkeypatch):
    """The host's records on a fake clock (its RSS is the process's own: not compared)."""

    def scenario(path: str) -> str:
        log = str(tmp_path / f"{path}.jsonl")
        ticks = itertools.count(10**9, 12_345)
        prof = _make_profiler(log, device="cpu", clock=lambda: next(ticks), collect_every_s=None, energy_every_s=0.5)
        for i in range(12):
            with prof.step(batch_size=4 if i % 3 else None):
                for name in ("forward", "backward")[: i % 3]:
                    with prof.measure(name):
                        pass
        try:
            with prof.step():
                raise KeyError("the user's")
        except KeyError:
            pass
        prof.close()
        return log

    c, py, (taken, _) = _both(monkeypatch, scenario)
    for r in (*c, *py):
        if r.get("host_rss_bytes") is not None:
            r["host_rss_bytes"] = "an int"
    _same(c, py)
    assert c[3]["unavailable"]["energy_j"] == c[3]["unavailable"]["energy_span_ms"]  # (the hook's constant fields)
    assert taken >= 11  # all but the first and the error


@pytest.mark.parametrize("uptime_ns", [10**9, 2**53 + 12_345], ids=["1s", "104days"])
def test_records_that_wait_for_their_energy_sample_are_held_in_order(tmp_path, monkeypatch, uptime_ns):
    """Energy on: the C harvest holds a record until its sample comes, and every later one behind
    it, and gives each one's span itself (EnergyHook.late only where no sample covers it), on a
    step clock past 2**52 ns too (perf_counter_ns counts from boot: a host up 52 days)."""
    from stepprof._aggregate import RunAggregate
    from stepprof._recorder.energy import EnergyHook

    late_calls = {"c": 0, "python": 0}
    add_late_calls = {"c": 0, "python": 0}

    def scenario(path: str) -> str:
        log = str(tmp_path / f"{path}.jsonl")
        gpu = FakeGpu()
        gpu.host_ns = gpu.gpu_free_at = uptime_ns
        gate = Gate(FakeNvml(gpu))
        real_late, real_add_late = EnergyHook.late, RunAggregate.add_late

        def late(self, step, record):
            late_calls[path] += 1
            return real_late(self, step, record)

        def add_late(self, r, name, batch, timed):
            add_late_calls[path] += timed
            return real_add_late(self, r, name, batch, timed)

        with monkeypatch.context() as mp:
            mp.setattr(EnergyHook, "late", late)
            mp.setattr(RunAggregate, "add_late", add_late)
            mp.setitem(sys.modules, "pynvml", gate.nvml)
            mp.setattr("stepprof._recorder.energy.open_counter", gate.opener)
            mp.setattr(EnergyHook.__init__, "__defaults__", (gate.opener,))
            prof = make(log, gpu, energy_every_s=0.05)
            run_step(prof, gpu)
            run_step(prof, gpu)
            gate.sample(prof)
            for i in range(8):
                run_step(prof, gpu, gpu_ms=1.0 + i % 3)
                if i in (2, 5):
                    gate.sample(prof)
            with prof.step("named", batch_size=2):
                with prof.measure("forward"):
                    gpu.launch(0.5)
            prof.begin_step(global_step=2**70)  # past what orjson encodes: the held line is repaired
            gpu.launch(0.5)
            prof.end_step()
            gate.sample(prof)
            gate.release()
            prof.close()
        return log

    c, py, (taken, _) = _both(monkeypatch, scenario)
    _same(c, py)
    energies = [r["energy_j"] for r in c if r["kind"] == "step"]
    assert energies[:2] == [None, None] and all(e is not None for e in energies[2:])
    assert c[-3]["kind"] == "step" and c[-3]["encoding_replaced"] == ["global_step"], c[-3]
    assert taken >= 9
    # Python's late() saw every step; C's only the two before the first sample (the first of
    # them starts the sampler) and the one that begin_step left to Python (no budget: light).
    assert late_calls["python"] == len(energies) and late_calls["c"] <= 4, late_calls
    # The summary's add_late: Python's for every timed step given its energy; C folds each
    # one's energy into the run's totals itself (one name so far: no group to tell).
    assert add_late_calls["python"] >= 5 and add_late_calls["c"] == 0, add_late_calls


def test_once_the_names_split_the_c_fill_tells_the_summary_through_add_late(tmp_path, monkeypatch):
    """Two step names: the summary's name groups need each step's energy too, so the C fill
    leaves it to add_late, and the summary (energy per name included) is Python's."""
    from stepprof._aggregate import RunAggregate
    from stepprof._recorder.energy import EnergyHook

    calls = {"c": 0, "python": 0}
    real = RunAggregate.add_late

    def scenario(path: str) -> str:
        log = str(tmp_path / f"{path}.jsonl")
        gpu = FakeGpu()
        gate = Gate(FakeNvml(gpu))

        def add_late(self, r, name, batch, timed):
            calls[path] += timed
            return real(self, r, name, batch, timed)

        with monkeypatch.context() as mp:
            mp.setattr(RunAggregate, "add_late", add_late)
            mp.setitem(sys.modules, "pynvml", gate.nvml)
            mp.setattr("stepprof._recorder.energy.open_counter", gate.opener)
            mp.setattr(EnergyHook.__init__, "__defaults__", (gate.opener,))
            prof = make(log, gpu, energy_every_s=0.05, warmup=1)
            run_step(prof, gpu)
            run_step(prof, gpu)
            gate.sample(prof)
            for i in range(10):
                with prof.step("train" if i % 2 else "eval", batch_size=4):
                    gpu.host(0.5)
                    gpu.launch(1.0 + i % 3)
                    gpu.wait_idle()
                if i in (3, 7):
                    gate.sample(prof)
            gate.sample(prof)
            gate.release()
            prof.close()
        return log

    c, py, _ = _both(monkeypatch, scenario)
    _same(c, py)
    assert sum(r["energy_j"] is not None for r in c if r["kind"] == "step") >= 8
    assert calls["c"] >= 6 and calls["c"] == calls["python"], calls


def _steps(prof, gpu: FakeGpu, n: int) -> None:
    for _ in range(n):
        with prof.step():
            gpu.launch(1.0)


def _stepped(tmp_path, path: str, n: int):
    """(log, gpu, profiler) after ``n`` steps of 1 ms on a fake GPU."""
    log = str(tmp_path / f"{path}.jsonl")
    gpu = FakeGpu()
    prof = make(log, gpu)
    _steps(prof, gpu, n)
    return log, gpu, prof


class _Amends(Hook):
    """A hook with work on every record: the C harvest leaves all of them to Python."""

    def on_record(self, step, record):
        record["thread"] = "amended"


def test_a_hook_with_work_per_record_sends_the_steps_to_python(tmp_path, monkeypatch):
    def scenario(path: str) -> str:
        log, gpu, prof = _stepped(tmp_path, path, 4)
        gpu.wait_idle()
        prof.flush()
        prof._hooks.append(_Amends())
        prof._collector.use(prof._hooks)
        _steps(prof, gpu, 3)
        prof.close()
        return log

    c, py, (taken, _) = _both(monkeypatch, scenario)
    _same(c, py)
    steps = [r for r in c if r["kind"] == "step"]
    assert [s.get("thread") for s in steps] == [None] * 4 + ["amended"] * 3
    assert taken == 3  # steps 1 to 3 (step 0 chooses the backend, in Python), none after the hook came


def test_the_collector_thread_takes_chunks_and_keeps_the_order(tmp_path, monkeypatch):
    """The collector thread's harvests (a few C calls each, the lock let go between chunks)."""

    def scenario(path: str) -> str:
        log = str(tmp_path / f"{path}.jsonl")
        gpu = FakeGpu()
        prof = _make_profiler(log, backend=gpu, clock=gpu.clock, collect_every_s=0.001, energy_every_s=None)
        for i in range(700):
            with prof.step(batch_size=8):
                with prof.measure("forward"):
                    gpu.launch(0.1)
        prof.close()
        return log

    c, py, (taken, calls) = _both(monkeypatch, scenario)
    assert [r["step"] for r in c if r["kind"] == "step"] == list(range(700))
    c_steps = [{k: v for k, v in r.items() if k != "overhead_us"} for r in c]  # (the collector's share: its own CPU)
    py_steps = [{k: v for k, v in r.items() if k != "overhead_us"} for r in py]
    _same(c_steps, py_steps)
    assert taken == 699 and calls >= 699 // collector_mod.FAST_STEPS


def test_an_interrupt_from_a_late_hook_reaches_the_loop_and_the_log_stays_whole(tmp_path, monkeypatch):
    """A KeyboardInterrupt raised inside the C harvest's call to the late hook (a signal landing
    there) reaches the training loop as the same object, on both paths alike."""
    boom = KeyboardInterrupt("in the late hook")

    def scenario(path: str) -> str:
        log = str(tmp_path / f"{path}.jsonl")
        gpu = FakeGpu()
        prof = make(log, gpu, energy_every_s=1.0)
        late = prof._collector.held.late
        real = type(late).late
        calls = {"n": 0}

        def late_once(self, step, record):
            calls["n"] += 1
            if calls["n"] == 3:
                raise boom
            return real(self, step, record)

        with monkeypatch.context() as mp:
            mp.setattr(type(late), "late", late_once)
            mp.setattr(type(late), "quiet", lambda self, b: None)
            with pytest.raises(KeyboardInterrupt) as got:
                for _ in range(5):
                    with prof.step():
                        gpu.launch(1.0)
                        gpu.wait_idle()
            assert got.value is boom
        prof.close()
        return log

    c, py, _ = _both(monkeypatch, scenario)
    _same(c, py, least=5)
    assert [r["step"] for r in c if r["kind"] == "step"] == [0, 1]  # (the step whose record it cut short is lost)


def test_a_step_of_another_thread_or_backend_is_left_to_python(tmp_path, monkeypatch):
    def scenario(path: str) -> str:
        log, gpu, prof = _stepped(tmp_path, path, 3)
        done = threading.Event()

        def other():
            with prof.step("other"):
                gpu.launch(0.5)
            done.set()

        t = threading.Thread(target=other, name="worker")
        t.start()
        t.join()
        _steps(prof, gpu, 3)
        prof.close()
        return log

    c, py, (taken, _) = _both(monkeypatch, scenario)
    _same(c, py)
    assert [r.get("thread") for r in c if r["kind"] == "step"].count("worker") == 1
    assert taken >= 4


class _Samples:
    """A sampler's lists, as EnergyHook reads them (no thread)."""

    def __init__(self, times, mj):
        self.times, self.mj, self.reason, self.running = times, mj, None, True

    energy_j = energy_mod.Sampler.energy_j
    trim = energy_mod.Sampler.trim


def _held_write(monkeypatch, tmp_path, c: bool, entries, times, mj, final: bool):
    """HeldRecords.write over ``entries`` with the C fill or without: (the log's lines, the entries left, the summary)."""
    from stepprof._recorder.held import HeldRecords
    from stepprof._recorder.sinks import LogSink, SummarySink

    done = [0]
    with monkeypatch.context() as mp:
        real = energy_mod._NATIVE.fill
        if not c:
            mp.setattr(energy_mod._NATIVE, "fill", None)
        else:
            assert real is not None

            def counted(*args):
                got = real(*args)
                done[0] += got[0]
                return got

            mp.setattr(energy_mod._NATIVE, "fill", counted)
        path = str(tmp_path / f"held-{c}-{final}.jsonl")
        log, summary = LogSink(path, None, "r"), SummarySink("r")
        held = HeldRecords(log, summary)
        hook = energy_mod.EnergyHook(0.5, lambda: times[-1] if times else 0)
        hook.sampler = _Samples(list(times), list(mj))
        held.late = hook
        held.entries.extend(entries)
        held.write(final)
        log.close()
        with open(path, "rb") as f:
            lines = f.read()
        return lines, list(held.entries), summary.aggregate.summary_fields(), done[0]


def test_the_c_fill_gives_pythons_energy_to_the_last_bit(monkeypatch, tmp_path):
    """Held records filled in C (fill_energy) and in Python (EnergyHook.fill): the same lines, the
    same summary, the same records left waiting; spans on and between samples, records without a
    span, records after them, a span before the first sample (Python's), and ones still waiting."""
    import random

    import orjson

    rng = random.Random(7)
    times = [10**9 + 100_000_000 * k + rng.randrange(5_000_000) for k in range(40)]
    mj = [0]
    for _ in times[1:]:
        mj.append(mj[-1] + rng.randrange(1, 90_000))
    entries = []
    t = times[0] - 20_000_000  # the first span starts before the first sample: Python fills it, with its reason
    for i in range(300):
        end = t + rng.choice([1, 3_000_000, 17_333_333, times[min(39, i // 7)] - t if i % 11 == 0 else 2_500_001])
        end = max(end, t + 1)
        line = orjson.dumps({"kind": "step", "step": i, "name": "s", "unavailable": {}, "run_id": "r"}, option=orjson.OPT_APPEND_NEWLINE)
        after = b'{"kind":"memory"}\n' if i % 50 == 7 else b""
        head = (line, "s", 8 if i % 3 else None, i % 4 != 0, after, 1 if after else 0)
        entries.append(head if i % 9 == 5 else head + (t, end))
        t = end
    for final in (False, True):
        c = _held_write(monkeypatch, tmp_path, True, entries, times[:25], mj[:25], final)
        py = _held_write(monkeypatch, tmp_path, False, entries, times[:25], mj[:25], final)
        assert c[0] == py[0] and c[1] == py[1] and c[2] == py[2]
        assert c[3] > 150 and py[3] == 0  # (the C fill took most of them)
        assert len(c[1]) > 0 if not final else not c[1]  # (past the last sample: waiting, until final)
    assert b'"energy_j":null' in c[0] and c[0].count(b'"energy_j":') > 200


class _PooledGpu(FakeGpu):
    """A fake whose released marks all go into one list, as the compiled backend's event pool."""

    def __init__(self) -> None:
        super().__init__()
        self.event_pool = self.released


@pytest.mark.parametrize("runs", [1, 20])  # 20 runs of each phase: 82 marks, past the pairwise compare
def test_the_c_harvest_gives_marks_back_to_the_pool_as_release_marks_does(tmp_path, monkeypatch, runs):
    """A backend with an event pool: the C harvest puts each step's marks there itself, each
    distinct one once (the phases share boundary marks), in the order release_marks does."""
    from .fakes import FakeEvent

    pools: dict[str, list[int]] = {}
    calls = {"c": 0, "python": 0}

    def scenario(path: str) -> str:
        log = str(tmp_path / f"{path}.jsonl")
        gpu = _PooledGpu()
        real = gpu.release_marks

        def release_marks(marks, keep=None):
            calls[path] += 1
            real(marks, keep)

        gpu.release_marks = release_marks
        base = FakeEvent._next
        prof = make(log, gpu)
        for i in range(12):
            with prof.step(batch_size=2):
                for _ in range(runs):
                    with prof.measure("forward"):
                        gpu.launch(1.0)
                    with prof.measure("backward"):
                        gpu.launch(0.5 + i % 2)
        prof.close()
        pools[path] = [e.uid - base for e in gpu.released]
        return log

    c, py, (taken, _) = _both(monkeypatch, scenario)
    _same(c, py)
    assert taken >= 10
    assert pools["c"] == pools["python"] and len(set(pools["c"])) == len(pools["c"]) >= 12 * (1 + 2 * runs), pools
    assert calls["python"] == 12 and calls["c"] <= 12 - taken, calls


def test_the_c_harvest_folds_the_common_step_into_the_summary_itself(tmp_path, monkeypatch):
    """The summary's add_step is called for a step that starts or splits the name groups, or has
    a rank; the C harvest folds the rest itself, to the same summary."""
    from stepprof._aggregate import RunAggregate

    calls = {"c": 0, "python": 0}
    real = RunAggregate.add_step

    def add_step(self, r):
        calls[path_now[0]] += 1
        return real(self, r)

    path_now = ["c"]
    monkeypatch.setattr(RunAggregate, "add_step", add_step)

    def scenario(path: str) -> str:
        path_now[0] = path
        log = str(tmp_path / f"{path}.jsonl")
        gpu = FakeGpu()
        prof = make(log, gpu)
        _steps(prof, gpu, 12)
        with prof.step("other"):
            gpu.launch(1.0)
        _steps(prof, gpu, 6)
        prof.close()
        return log

    c, py, (taken, _) = _both(monkeypatch, scenario)
    _same(c, py)
    assert taken >= 16 and calls["python"] == 19 and calls["c"] <= 8, calls
