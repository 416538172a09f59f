"""The C fold (stepprof/_fold.c) and the Python one (StepTotals.fold) leave the same accumulators.

Every record goes to two fresh aggregates, one folding in C and one in Python, and after each
record their whole state (every accumulator, every sketch's buffer, every phase's totals) must be
equal, with the same return value, or the same exception type.  The records: the fuzzers'
hostile logs (every field of the step record meets every hostile value), random records drawn
from a wide set of shapes and values, and the summary of a real run.  CI has a C compiler, so
the C path is tested there; without one the tests skip.
"""

from __future__ import annotations

import random
import threading
import shutil
from array import array
from typing import Any

import pytest

import stepprof
from stepprof import _aggregate, _native
from stepprof._aggregate import RunAggregate, StepTotals
from stepprof._errors import BuildError

from . import fuzzlogs


@pytest.fixture(scope="module")
def fold() -> Any:
    """The C fold's ``fold_step`` (built here if needed)."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    try:
        _native.build()
    except BuildError as e:  # a compiler that cannot build it is a failure, not a skip
        pytest.fail(str(e))
    _native.reload()  # (an earlier test may have left another cache's module, or none): every user
    assert _aggregate.use_native() is None
    mod = _native.module()
    assert mod is not None
    return mod.fold_step


def state(obj: Any) -> Any:
    """Everything an accumulator holds, as plain values (floats by repr: NaN equals NaN)."""
    if isinstance(obj, float):
        return repr(obj)
    if isinstance(obj, (int, str, bool)) or obj is None:
        return (type(obj).__name__, obj)
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [state(x) for x in obj])
    if isinstance(obj, array):
        return ("array", [repr(x) for x in obj])
    if isinstance(obj, dict):
        return ("dict", [(state(k), state(v)) for k, v in obj.items()])
    if callable(obj) and not hasattr(obj, "__slots__"):
        return ("callable", getattr(obj, "__name__", "?"))
    slots = [s for cls in type(obj).__mro__ for s in getattr(cls, "__slots__", ())]
    return (type(obj).__name__, [(s, state(getattr(obj, s, "<unset>"))) for s in slots])


def fold_both(fold: Any, records: list[Any]) -> int:
    """Fold ``records`` in C and in Python, comparing after each; returns how many C took."""
    c, py = StepTotals(), StepTotals()
    taken = 0
    for i, r in enumerate(records):
        out_c = err_c = out_py = err_py = None
        try:
            got = fold(c, r)
            if got is NotImplemented:
                got = c.fold(r)
            else:
                taken += 1
            out_c = got
        except Exception as e:  # noqa: BLE001 - compared below
            err_c = type(e)
        try:
            out_py = py.fold(r)
        except Exception as e:  # noqa: BLE001 - compared below
            err_py = type(e)
        assert (out_c, err_c) == (out_py, err_py), r
        if i < 100 or i % 97 == 0 or err_c is not None:  # (the state grows: not after every record)
            assert state(c) == state(py), r
    c.settle()
    py.settle()
    assert state(c) == state(py)
    return taken


def test_the_fuzzers_hostile_step_records_fold_the_same(fold: Any) -> None:
    taken = total = 0
    for index, mutations in enumerate(fuzzlogs.cases(600, seed=7)):
        records = [r for r in fuzzlogs.case_records(index, mutations, seed=7) if r.get("kind") == "step"]
        total += len(records)
        taken += fold_both(fold, records)
    assert taken > total * 0.6  # the C path takes all but the counted, explained and compiled steps, and hostile numbers


_VALUES: list[Any] = [
    None, True, False, 0, 1, -1, 7, 2**52, 2**52 + 1, -(2**53), 2**63, 10**30, 0.0, -0.0, 0.5, 1.25, 3.0,
    1e-300, 1e300, 1e308, float("inf"), float("nan"), "", "x", [], [1], {}, {"a": 1},
]


_SANE = [x for x in _VALUES if type(x) is int and abs(x) < 2**40 or type(x) is float and abs(x) < 1e30]


def _num_(rng: random.Random, hostile: bool = True) -> Any:
    return rng.choice([rng.random() * 10, rng.randint(0, 100), *rng.sample(_VALUES if hostile else _SANE, 3)])


def _record(rng: random.Random, i: int, hostile: bool = True) -> dict[str, Any]:
    """A step record of a random shape: every field the fold reads, each present or not, most
    of them sane (all numbers finite and in range unless ``hostile``)."""
    r: dict[str, Any] = {"kind": "step"}
    _num = lambda rng: _num_(rng, hostile)  # noqa: E731
    fields: dict[str, Any] = {
        "step": lambda: rng.choice([i, i, -3, "7", None, 2**70]),
        "device": lambda: rng.choice(["cuda:0", "cpu", 3, None]),
        "name": lambda: rng.choice(["step", "eval", None, 5] + [f"n{k}" for k in range(20)]),
        "warmup": lambda: rng.choice([False, False, True, 1, None]),
        "error": lambda: rng.choice([None, None, None, {"type": "E"}, "", 0]),
        "wall_ms": lambda: _num(rng),
        "gpu_ms": lambda: _num(rng),
        "gpu_busy": lambda: _num(rng),
        "overhead_us": lambda: _num(rng),
        "peak_allocated_bytes": lambda: rng.choice([rng.randint(0, 2**40), None, 1.5, "9"]),
        "reserved_bytes": lambda: rng.choice([rng.randint(0, 2**40), None, 2.5]),
        "host_rss_bytes": lambda: rng.choice([rng.randint(0, 2**40), None, 2.5]),
        "batch_size": lambda: rng.choice([8, 16, 0, -2, None, True, 2.0] + list(range(300, 560))),
        "samples_per_s": lambda: _num(rng),
        "tokens_per_s": lambda: _num(rng),
        "data_wait_ms": lambda: _num(rng),
        "data_wait_in_step_ms": lambda: _num(rng),
        "data_ms": lambda: _num(rng),
        "allocator": lambda: rng.choice([None, {}, {"num_device_alloc": rng.randint(0, 3),
                                                    "num_alloc_retries": rng.choice([0, 1, None]),
                                                    "num_sync_all_streams": True, "other": 4}]),
        "syncs": lambda: rng.choice([None, {}, {"count": rng.choice([0, 2, None, 1.0]),
                                                "mechanism": rng.choice(["warn", 3]),
                                                "other_threads": rng.choice([0, 2, "x"]),
                                                "sites": rng.choice([[], [{"file": "a.py", "line": 3, "count": 1}]])}]),
        "phases": lambda: rng.choice([None, {}, [], {f"p{k}": rng.choice([
            {"wall_ms": _num(rng), "gpu_ms": _num(rng), "peak_allocated_bytes": _num(rng),
             "syncs": rng.choice([0, 1, None, 1.5]), "count": rng.choice([1, 2, None])}, None, 3])
            for k in range(rng.randint(1, 4))}]),
        "energy_j": lambda: _num(rng),
        "energy_span_ms": lambda: _num(rng),
        "tflops_per_s": lambda: _num(rng),
        "mfu": lambda: _num(rng),
        "mfu_datasheet": lambda: _num(rng),
        "compiles": lambda: rng.choice([0, 1, None]),
        "compiled": lambda: rng.choice([False, True]),
        "flops_counted": lambda: rng.choice([False, True]),
        "explained": lambda: rng.choice([False, True]),
        "unavailable": lambda: rng.choice([None, {}, {"gpu_ms": "why", f"k{rng.randint(0, 300)}": "w",
                                                      "energy_j": rng.choice(["no sample", 3])}]),
    }
    rare = {"compiles", "compiled", "flops_counted", "explained", "tflops_per_s", "mfu", "mfu_datasheet"}
    for key, make in fields.items():
        if rng.random() < (0.1 if key in rare else 0.8):
            r[key] = make()
    return r


@pytest.mark.parametrize("seed", range(4))
def test_random_step_records_fold_the_same(fold: Any, seed: int) -> None:
    rng = random.Random(seed)
    assert fold_both(fold, [_record(rng, i) for i in range(3000)]) > 1000


def test_a_settle_and_the_spike_heap_past_their_limits_fold_the_same(fold: Any) -> None:
    rng = random.Random(5)
    records = [{"kind": "step", "step": i, "wall_ms": rng.random() * 10, "gpu_ms": rng.random() * 10,
                "phases": {"forward": {"wall_ms": rng.random(), "count": 1}}} for i in range(9000)]
    assert fold_both(fold, records) == 9000  # past _SETTLE_EVERY twice, past SPIKES_KEPT


def test_the_summary_of_a_run_is_the_same_either_way(fold: Any) -> None:
    rng = random.Random(11)
    records = [_record(rng, i, hostile=False) for i in range(2000)]
    figures = []
    for on in (True, False):
        _aggregate.use_native(on)
        try:
            agg = RunAggregate()
            for r in records:
                agg.add(r)
            figures.append(repr(agg.summary_fields()))
        finally:
            _aggregate.use_native()
    assert figures[0] == figures[1]
    assert "wall_ms" in figures[0]


def test_without_a_compiler_the_build_names_the_fix_and_the_python_fold_goes_on(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("STEPPROF_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    _native.reset()
    try:
        with pytest.raises(BuildError, match=r"no C compiler .*\$CC"):
            _native.build()
        assert _native.module() is None and "stepprof build" in (_native.reason() or "")
        assert _aggregate.use_native() == _native.reason()
        agg = RunAggregate()
        agg.add({"kind": "step", "step": 0, "wall_ms": 2.0})
        assert agg.summary_fields()["wall_ms"].median == 2.0
    finally:
        monkeypatch.undo()  # (before the fold is looked for again, in the real cache)
        _native.reset()
        _aggregate.use_native()


def test_stepprof_env_says_which_fold_is_used(fold: Any) -> None:
    from stepprof._env import environment, render_env as render

    env = environment()
    assert env["fold"] == {"used": "c", "reason": None, "core": "c", "core_reason": None}
    assert "summary fold" in render(env)


# -- build_step: the step record in C (stepprof/_recorder/collector.py's build_step_record) --

from stepprof._recorder import collector  # noqa: E402

from .conftest import make  # noqa: E402
from .fakes import FakeGpu  # noqa: E402


def _as_list(x: Any) -> Any:
    """A record with its keys' order, all the way down."""
    if isinstance(x, dict):
        return [(k, _as_list(v)) for k, v in x.items()]
    return (type(x).__name__, repr(x))


@pytest.fixture
def both(fold: Any, monkeypatch) -> list[int]:
    """Every step record built in C and in Python, compared; counts [built in C, in Python]."""
    assert collector.use_native() is None
    monkeypatch.setattr(collector._NATIVE, "harvest", None)  # every record through build_step_record
    counts = [0, 0]
    real = collector.build_step_record

    def checked(s, b, *, start_unix_s, phase_peaks_why, not_sampled=None, host=None):
        if not_sampled is None and collector._NATIVE.build is not None:
            if b.has_device_timing:
                got = collector._NATIVE.build(s, b.device, start_unix_s, phase_peaks_why)
            else:
                assert host is not None and host == collector.host_reasons(b)
                got = collector._NATIVE.build_host(s, b.device, start_unix_s, host)
            want = collector._build_python(s, b, start_unix_s, phase_peaks_why)
            if got is not NotImplemented:
                assert _as_list(got) == _as_list(want)
                counts[0] += 1
            else:
                counts[1] += 1
        return real(s, b, start_unix_s=start_unix_s, phase_peaks_why=phase_peaks_why, not_sampled=not_sampled,
                    host=host)

    monkeypatch.setattr(collector, "build_step_record", checked)
    return counts


def _loop(prof: Any, gpu: FakeGpu, rng: random.Random, n: int) -> None:
    for i in range(n):
        batch = rng.choice([8, None, 2**60])
        kw = {"batch_size": batch} if batch is not None else {}
        try:
            with prof.step(**kw):
                gpu.alloc(rng.randint(0, 1 << 20))
                for name in rng.choice([(), ("forward",), ("forward", "backward", "optimizer"), ("a", "a")]):
                    with prof.measure(name):
                        gpu.launch(rng.random())
                        if rng.random() < 0.3:
                            with prof.measure("inner"):
                                gpu.alloc(rng.randint(0, 1 << 22))
                                gpu.launch(rng.random())
                                gpu.free(1 << 10)
                    if rng.random() < 0.2:
                        gpu.sync()
                if rng.random() < 0.1:
                    raise KeyError("the user's")
                gpu.host(rng.random())
        except KeyError:
            pass


@pytest.mark.parametrize("settings", [
    {}, {"phase_peaks_every": 1}, {"phase_peaks_every": 0}, {"syncs": "off"}, {"warmup": 0},
    {"overhead_budget": 0.05}, {"max_syncs": 0},
])
def test_the_c_build_gives_the_python_records_for_every_kind_of_step(both: list[int], log, settings) -> None:
    gpu = FakeGpu(seed=3)
    rng = random.Random(str(settings))
    with make(log, gpu, **settings) as prof:
        _loop(prof, gpu, rng, 120)
        prof.begin_step(global_step=7)
        prof.add_batch(list(range(4)), wait_s=0.001)
        prof.end_step()
        for _ in prof.iterate([1, 2]):
            with prof.step():
                gpu.launch(1.0)
    assert both[0] > 40, both  # the C path takes the ordinary steps; errors, warm-up (etc.) stay in Python


@pytest.mark.parametrize("settings", [{}, {"phase_peaks_every": 1}, {"syncs": "off"}, {"warmup": 0},
                                      {"overhead_budget": 0.05}])
def test_the_c_build_gives_the_python_records_of_host_steps(both: list[int], log, settings) -> None:
    """On the host (the CPU): every device figure null with the backend's reasons, the RSS."""
    from stepprof._recorder.profiler import _make_profiler

    gpu = FakeGpu(seed=5)  # (only its random work: the steps run on the real host backend)
    rng = random.Random(str(settings))
    with _make_profiler(log, device="cpu", collect_every_s=None, energy_every_s=None, **settings) as prof:
        _loop(prof, gpu, rng, 80)
        prof.begin_step(global_step=3)
        prof.add_batch(list(range(4)), wait_s=0.001)
        prof.end_step()
        for _ in prof.iterate([1, 2]):
            with prof.step():
                pass
        t = threading.Thread(target=lambda: prof.step().__enter__().__exit__(None, None, None))
        t.start()
        t.join()
    assert both[0] > (0 if "overhead_budget" in settings else 40), both  # (light steps: Python's)
    recs = list(stepprof.read(log, kind="step"))
    assert any(r["error"] for r in recs) and all(r["gpu_ms"] is None for r in recs)


def test_a_step_from_another_thread_is_left_to_python(both: list[int], log) -> None:
    import threading

    gpu = FakeGpu()
    with make(log, gpu) as prof:
        with prof.step():
            t = threading.Thread(target=lambda: prof.step().__enter__().__exit__(None, None, None))
            t.start()
            t.join()
            gpu.launch(1.0)
        with prof.step():
            gpu.launch(1.0)
    assert both[0] >= 1


def test_the_c_build_fills_the_declared_fields_in_their_order(fold: Any) -> None:
    from stepprof._schema import STEP_CORE_FIELDS

    mod = _native.module()
    assert mod is not None and mod.BUILD_FIELDS == ("schema_version", "kind", *STEP_CORE_FIELDS)
    assert collector.use_native() is None and collector._NATIVE.build is not None


def test_the_c_build_takes_the_reasons_by_name_and_refuses_a_missing_or_unknown_one(fold: Any) -> None:
    """The reasons' texts reach C by name, so a text cannot land in another reason's place."""
    from stepprof._device.backend import ALLOCATOR_COUNTERS
    from stepprof._recorder.step import PhaseTotals, Step
    from stepprof._schema import SCHEMA_VERSION

    mod = _native.module()
    assert mod is not None

    def configure(reasons: dict[str, str]) -> None:
        mod.configure_build(Step, PhaseTotals, mod.BUILD_FIELDS, collector._BUILD_OPTIONAL,
                            collector._BUILD_PHASE_KEYS, reasons, ALLOCATOR_COUNTERS, SCHEMA_VERSION)

    try:
        missing = {k: v for k, v in collector._BUILD_REASONS.items() if k != "zero_wall"}
        with pytest.raises(ValueError, match="lack a str zero_wall"):
            configure(missing)
        with pytest.raises(ValueError, match="names this build does not know"):
            configure({**collector._BUILD_REASONS, "new_reason": "x"})
    finally:
        assert collector.use_native() is None  # configured again, whole


def test_stepprof_build_without_a_c_compiler_still_builds_the_boundary_and_exits_1(monkeypatch, capsys) -> None:
    from stepprof import _cli
    from stepprof._device import compiled

    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setattr(_native, "_path", lambda: "/nonexistent/stepprof_fold.so")
    monkeypatch.setattr(compiled, "build", lambda verbose=False: compiled.BuildReport(path="/x/b.so", seconds=1.0))
    assert _cli.main(["build"]) == 1
    out, err = capsys.readouterr()
    assert "the compiled boundary is ready in /x/b.so" in out and "no C compiler" in err
    _native.reset()


def _python_sanitise(record: Any) -> Any:
    from stepprof import _sanitise

    fast, _sanitise._valid_as_is = _sanitise._valid_as_is, None
    try:
        return _sanitise.sanitise(record)
    finally:
        _sanitise._valid_as_is = fast


def test_the_c_check_passes_a_record_only_where_the_python_pass_would_change_nothing(fold: Any) -> None:
    """Every record of 600 fuzzer cases (every kind, every field meeting hostile values): where
    ``valid_as_is`` says yes, the Python pass returns the same record, unchanged and with nothing
    noted; and it says yes to the unmutated log's records of every kind but one."""
    import copy

    from stepprof import _sanitise

    mod = _native.module()
    assert mod is not None and _sanitise._valid_as_is is mod.valid_as_is
    passed = 0
    base = fuzzlogs.case_records(0, [], seed=7)
    # (a flops record's calibration is free-form: Python checks it)
    assert {r["kind"] for r in base if not mod.valid_as_is(r)} == {"flops"}
    for index, mutations in enumerate(fuzzlogs.cases(600, seed=7)):
        for r in fuzzlogs.case_records(index, mutations, seed=7):
            if not mod.valid_as_is(r):
                continue
            passed += 1
            before = state(r)
            out = _python_sanitise(copy.deepcopy(r))
            assert out is not None and state(out) == before, r
    assert passed > 1000


def test_the_c_check_refuses_tables_it_could_not_read(fold: Any) -> None:
    from stepprof import _sanitise

    mod = _native.module()
    specs, objs, kinds = _sanitise._c_tables()
    try:
        for bad in ((specs, [{"step": len(specs)}, *objs[1:]], kinds), (specs, objs, {"step": (len(objs), ())}),
                    (specs, objs, {"step": (0, ["step"])}), (specs, [["step"], *objs[1:]], kinds)):
            with pytest.raises(ValueError, match="not what valid_as_is reads"):
                mod.configure_sanitise(*bad, _sanitise.STR_MAX, _sanitise.KEY_MAX)
    finally:
        _sanitise.use_native()


@pytest.mark.parametrize("record", [
    {"kind": "step", "step": 1, "wall_ms": 4096.0, "batch_size": 4096.0},  # an integral float in an int field
    {"kind": "step", "step": 1, "wall_ms": float("nan")},
    {"kind": "step", "step": 1, "wall_ms": True},
    {"kind": "step", "step": 1, "name": "x" * 5000},
    {"kind": "step", "step": 1, "phases": {"k" * 300: {}}},
    {"kind": "step", "step": 1, "newer_field": 1},
    {"kind": "step", "step": None},
    {"kind": "step"},
    {"kind": "nope", "step": 1},
    {"kind": ["step"], "step": 1},
    {"kind": "step", "step": 2**60},
])
def test_the_c_check_leaves_to_python_what_python_would_change(fold: Any, record: dict[str, Any]) -> None:
    mod = _native.module()
    assert mod is not None and mod.valid_as_is(record) is False


def test_sync_sites_fold_the_same_known_new_odd_and_past_the_tables_cap(fold: Any, monkeypatch) -> None:
    """The sites' table in C (a site seen before) and through SyncSites.add (the rest), in order."""
    monkeypatch.setattr(_aggregate, "TABLE_CAP", 5)
    _aggregate.use_native()  # (the cap is Python's, read at configure)
    try:
        rng = random.Random(3)
        pool: list[Any] = [
            {"where": "a.py:1", "kind": "item", "count": 2, "code": "x.item()"},
            {"where": "a.py:2", "kind": "cpu", "count": 1},
            {"where": 7, "kind": "item", "count": 1},  # a where that is not a str
            {"where": "a.py:1", "kind": "item", "count": True},  # a bool count: skipped
            {"where": "a.py:1", "kind": "item", "count": 2**70},
            "not a site", {"kind": "item", "count": 1},
        ] + [{"where": f"b.py:{i}", "kind": "sync", "count": 1} for i in range(8)]
        records = []
        for i in range(400):
            sites = [rng.choice(pool) for _ in range(rng.randint(1, 4))]
            records.append({"kind": "step", "step": i, "warmup": False, "wall_ms": 2.0,
                            "syncs": {"count": 3, "mechanism": "warn", "sites": sites}})
        assert fold_both(fold, records) == len(records)
    finally:
        monkeypatch.undo()
        _aggregate.use_native()
