"""The bench scripts' own method, on the CPU: what each round charges to which variant."""

from __future__ import annotations

import importlib
import json
import os
import sys
import time

import pytest
import torch

from stepprof._recorder.profiler import _make_profiler

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


@pytest.fixture
def overhead(monkeypatch):
    """bench/overhead.py, with its workload on the CPU and no CUDA synchronisation."""
    monkeypatch.syspath_prepend(BENCH)
    mod = importlib.import_module("overhead")
    make = mod.make_workload
    monkeypatch.setattr(mod, "make_workload",
                        lambda width, batch: make(16, 4, depth=2, device="cpu", dtype=torch.float32))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    return mod


def test_overhead_leaves_no_records_for_the_next_round(overhead, monkeypatch, tmp_path):
    """A stepprof variant's records are written in its own round, never in another's.

    The collector here never wakes by itself (as if every round ended just before it
    would): whatever a variant's round leaves pending is written later, while some other
    variant is being timed.  At every step after the warm-up (which ends with the first
    synchronisation), no other variant's profiler may have work pending.
    """
    made = []
    timing = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: timing.append(True))

    def make_profiler(*a, **kw):
        kw.setdefault("collect_every_s", 3600.0)
        prof = _make_profiler(*a, **kw)
        made.append(prof)
        return prof

    monkeypatch.setattr(overhead, "_make_profiler", make_profiler)
    make = overhead.make_workload
    leftovers = []

    def workload(width, batch):
        fwd, bwd, opt = make(width, batch)

        def checked_fwd():
            if timing:
                leftovers.extend(os.path.basename(p.log) for p in made if p._boundaries.threads.step() is None and p._collector.pending)
            fwd()

        return checked_fwd, bwd, opt

    monkeypatch.setattr(overhead, "make_workload", workload)
    overhead.run("cpu", 16, 4, rounds=3, k=4, tmp=str(tmp_path), profiler=False)
    assert len(made) == len(overhead.VARIANTS)
    assert leftovers == []


def test_overhead_post_processing_counts_the_profilers_exit(overhead, monkeypatch, tmp_path):
    """torch.profiler's post-processing is its exit (the trace stopped and collected) plus
    ``key_averages()``: the docs report it as the trace's processing at exit."""

    class FakeProfile:
        def __init__(self, **kw):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            time.sleep(0.05)  # stopping the trace

        def key_averages(self):
            return []

    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    out = overhead.run("cpu", 16, 4, rounds=2, k=2, tmp=str(tmp_path), profiler=True)
    assert out["profiler_postprocess_s_median"] >= 0.05


def test_boundary_costs_times_every_records_write(monkeypatch, tmp_path):
    """bench/boundary_costs.py's harvest row covers every step record's encoding and write,
    the C harvest's (which encodes with the collector's ``_ENCODE``) as well as Python's."""
    import json
    import types

    from stepprof import _log
    from stepprof._device.backend import HostBackend
    from stepprof._recorder import collector

    monkeypatch.syspath_prepend(BENCH)
    mod = importlib.import_module("boundary_costs")
    make = importlib.import_module("overhead").make_workload
    monkeypatch.setattr(mod, "make_workload",
                        lambda width, batch: make(16, 4, depth=2, device="cpu", dtype=torch.float32))
    monkeypatch.setattr(mod, "CudaBackend", lambda index: HostBackend("a CPU check"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    real = _log.orjson

    def slow_dumps(obj, option=None):  # 2 ms a record: a floor for the write's time
        time.sleep(0.002)
        return real.dumps(obj, option=option)

    monkeypatch.setattr(_log, "orjson", types.SimpleNamespace(dumps=slow_dumps, OPT_APPEND_NEWLINE=real.OPT_APPEND_NEWLINE))
    monkeypatch.setattr(collector, "_ENCODE", (slow_dumps,) + collector._ENCODE[1:])
    out = tmp_path / "costs.json"
    monkeypatch.setattr(sys, "argv", ["boundary_costs.py", "--steps", "30", "--log-dir", str(tmp_path),
                                      "--out", str(out)])
    assert mod.main() == 0
    rows = json.loads(out.read_text())["rows"]
    (write,) = [r for k, r in rows.items() if k.startswith("collector harvest")]
    assert write["us_per_step"] >= 2000  # every step's record went through the timed write


def test_soak_runs_every_case_and_writes_its_json(monkeypatch, tmp_path, capsys):
    """bench/soak.py end to end at its smallest (about 12 s): every case runs, none fails,
    and a signal case stepprof cannot yet judge says so instead of failing."""
    import json

    monkeypatch.syspath_prepend(BENCH)
    mod = importlib.import_module("soak")
    out = tmp_path / "soak.json"
    rc = mod.main(["--quick", "--kills", "1", "--hog-kills", "1", "--signals", "1", "--rss-steps", "1000,2000",
                   "--no-rss-log", "--json", str(out)])
    table = capsys.readouterr().out
    assert rc == 0, table
    cases = json.loads(out.read_text())["cases"]
    assert list(cases) == ["kill", "after kills", "kill, 2 hogs", "sigterm", "sigint", "rss"]
    assert all(c["runs"] == 1 and c["failures"] == 0 for c in cases.values()), table
    for sig in ("sigterm", "sigint"):
        skipped = cases[sig]["skipped"]
        assert skipped is None or skipped.startswith("not supported"), skipped
    for name in cases:
        assert f"\n{name:12s}" in table


def test_cost_split_features_charges_each_feature_and_restores_compile_tracking(monkeypatch):
    """bench/cost_split.py --features on the CPU: a figure per feature from every round, the
    ones it cannot switch off named with why, and the compile hook as it was after."""
    monkeypatch.syspath_prepend(BENCH)
    mod = importlib.import_module("cost_split")
    from stepprof._recorder.compiles import CompileHook

    before = {n: CompileHook.__dict__[n] for n in ("on_step_begin", "on_harvest", "on_record")}
    res = mod.features(rounds=2, steps=50, device="cpu", seed=0)
    assert set(res["features"]) == set(mod.FEATURES)
    for figures in res["features"].values():
        assert len(figures["rounds_us"]) == 2 and figures["min_us"] <= figures["median_us"] <= figures["max_us"]
    assert "data wait" in res["not_separable"] and res["defaults_us_per_step"] > 0
    assert {n: CompileHook.__dict__[n] for n in before} == before
    assert res["long_steps"] is None and "per_step_us" not in res["features"]["log writing"]


def test_cost_split_features_splits_each_cost_into_per_step_and_per_run(monkeypatch):
    """--long-steps: each feature's cost is also given as a slope (µs a step) and a rest (ms a
    run), each a median with its range."""
    monkeypatch.syspath_prepend(BENCH)
    mod = importlib.import_module("cost_split")
    res = mod.features(rounds=2, steps=50, device="cpu", seed=0, long_steps=150)
    assert res["long_steps"] == 150
    for f in res["features"].values():
        assert f["per_step_min_us"] <= f["per_step_us"] <= f["per_step_max_us"]
        assert f["per_run_min_ms"] <= f["per_run_ms"] <= f["per_run_max_ms"]


def test_sketch_bench_times_a_compacting_sketch_and_writes_its_json(monkeypatch, tmp_path, capsys):
    import json

    monkeypatch.syspath_prepend(BENCH)
    mod = importlib.import_module("sketch")
    out = tmp_path / "sketch.json"
    assert mod.main(["--values", "70000", "--rounds", "1", "--json", str(out)]) == 0  # past EXACT: it compacts
    got = json.loads(out.read_text())
    assert got["values"] == 70000 and got["feed_us_per_value"] > 0
    assert got["sort_ms_numpy"] > 0 and got["sort_ms_sorted"] > 0
    assert "µs a value" in capsys.readouterr().out


def test_inloop_share_counts_the_loops_gil_samples_in_stepprof_code(monkeypatch, tmp_path):
    """Only the training thread's samples in the loop count, a sample is stepprof's when stepprof's
    code is on its stack, and stepprof's own threads are counted apart."""
    monkeypatch.syspath_prepend(BENCH)
    mod = importlib.import_module("inloop_share")
    raw = tmp_path / "raw.txt"
    loop = "thread (1): MainThread;<module> (bench/inloop_share.py:9);child.<locals>.timed_loop (bench/inloop_share.py:80)"
    raw.write_text("\n".join([
        "thread (1): MainThread;<module> (bench/inloop_share.py:9);make_workload (bench/overhead.py:60) 50",  # setup
        f"{loop};forward (bench/overhead.py:70);Module._call_impl (torch/nn/modules/module.py:1) 90",
        f"{loop};_Scope.__exit__ (stepprof/_scopes.py:79);Boundaries.exit (stepprof/_recorder/boundaries.py:170) 6",
        "thread (2): stepprof-collector;Thread.run (threading.py:1);Collector._loop (stepprof/_recorder/collector.py:340) 4",
    ]) + "\n")
    got = mod.shares(str(raw))
    assert got == {"samples": 96, "stepprof": 6, "threads": {"stepprof-collector": 4}}
    lo, hi = mod._wilson(10, 100)
    assert lo < 0.10 < hi and 0.05 < lo and hi < 0.18


def test_long_loop_charges_each_thread_and_gc_generation_and_aggregates_spy_frames(tmp_path):
    """A short run on the CPU: the training thread carries the loop's CPU, the GC table has each
    generation, and py-spy's raw frames are counted per thread by function, lines merged."""
    import json
    import subprocess

    out = tmp_path / "long.json"
    subprocess.run([sys.executable, os.path.join(BENCH, "long_loop.py"), "--variant", "3 phases",
                    "--seconds", "0.3", "--json", str(out)], check=True, capture_output=True, timeout=120)
    got = json.loads(out.read_text())
    assert got["steps"] > 100 and got["step_us"] > 0 and got["variant"] == "3 phases"
    main = [v for k, v in got["loop_ns_per_step"].items() if k.startswith("MainThread#")]
    assert main and main[0] > 0
    assert sorted(got["gc"]) == ["0", "1", "2"] and all(v["count"] >= 0 for v in got["gc"].values())
    saved = list(sys.path)  # (the module puts the repository and bench/ on it)
    sys.path.insert(0, BENCH)
    try:
        mod = importlib.import_module("long_loop")
    finally:
        sys.path[:] = saved
    raw = tmp_path / "raw.txt"
    raw.write_text(
        "thread (1): MainThread;timed_loop (bench/long_loop.py:90);Boundaries.exit (stepprof/_recorder/boundaries.py:170) 6\n"
        "thread (1): MainThread;timed_loop (bench/long_loop.py:91);Boundaries.exit (stepprof/_recorder/boundaries.py:172) 4\n"
        "thread (2): stepprof-collector;Collector._loop (stepprof/_recorder/collector.py:340) 3\n")
    agg = mod.aggregate(str(raw))
    main = agg["thread (1): MainThread"]
    assert main["samples"] == 10
    assert dict(main["self"]) == {"Boundaries.exit (stepprof/_recorder/boundaries.py)": 10}
    assert dict(main["incl"])["timed_loop (bench/long_loop.py)"] == 10
    assert agg["thread (2): stepprof-collector"]["samples"] == 3


def test_harvest_bench_times_both_loops_and_puts_the_c_one_back(monkeypatch, tmp_path, capsys):
    """bench/harvest.py: one harvest each way a round, every record written, the C loop restored."""
    from stepprof._recorder import collector as collector_mod

    monkeypatch.syspath_prepend(BENCH)
    mod = importlib.import_module("harvest")
    fast = collector_mod._NATIVE.harvest
    if fast is None:
        pytest.skip("stepprof's C module is not built here")
    out = tmp_path / "harvest.json"
    assert mod.main(["--pending", "30", "--phases", "0,2", "--rounds", "2", "--device", "cpu", "--json", str(out)]) == 0
    assert collector_mod._NATIVE.harvest is fast
    res = json.loads(out.read_text())["results"]
    assert [r["phases"] for r in res] == [0, 2]
    assert all(len(r["ratios"]) == 2 and min(r["c_us"] + r["python_us"]) > 0 for r in res)
    assert "C/Python" in capsys.readouterr().out


def test_record_costs_splits_a_record_into_its_parts_and_unwraps_them(monkeypatch):
    """bench/record_costs.py: every part of an inline harvest is charged (less the wrappers'
    own cost), the parts fit inside the harvest, and the classes get their methods back."""
    from stepprof._recorder import collector as collector_mod
    from stepprof._recorder import step

    monkeypatch.syspath_prepend(BENCH)
    mod = importlib.import_module("record_costs")
    before = collector_mod.Collector.harvest, step.Step.read, collector_mod._NATIVE.harvest
    res = mod.run(200, 2, energy=False, no_gc=False, device="cpu", python_harvest=True)
    assert (collector_mod.Collector.harvest, step.Step.read, collector_mod._NATIVE.harvest) == before
    assert res["harvest_loop"] == "python"
    parts = res["us_per_record"]
    assert {"harvest", "read", "build", "summary", "log"} <= parts.keys()
    assert "hold" not in parts  # nothing waits without energy
    assert res["calls"]["build"] == 200 and res["calls"]["summary"] == 200
    inside = parts["read"] + parts["build"] + parts["summary"] + parts["log"]
    assert 0 < inside <= parts["harvest"] * 1.05 + 1.0
    assert res["wrapper_ns"] > 0
    if collector_mod._NATIVE.harvest is not None:  # the C loop: the summary's fold is still charged apart
        res = mod.run(200, 2, energy=False, no_gc=False, device="cpu")
        assert res["harvest_loop"] == "c" and res["calls"]["summary"] == 200
        assert 0 < res["us_per_record"]["summary"] <= res["us_per_record"]["harvest"] * 1.05 + 1.0


@pytest.mark.cuda
def test_cost_split_splits_a_launch_bound_step_with_the_collector_still_writing(monkeypatch, tmp_path):
    """bench/cost_split.py's wrappers pass the collector's arguments through: the run ends with
    every record written, no warning, and figures for the boundaries and the collector."""
    import warnings

    from stepprof import StepprofWarning

    monkeypatch.syspath_prepend(BENCH)
    mod = importlib.import_module("cost_split")
    with warnings.catch_warnings():
        warnings.simplefilter("error", StepprofWarning)
        got = mod.run("step", {}, "step", 60, str(tmp_path), mod.make_workload(256, 64))
    assert got["hot_full_us"] > 0 and got["collector_cpu_us_per_record"] > 0
    assert got["records_per_harvest"] >= 1 and got["calls_per_step"]["cross"] == 2
    lines = (tmp_path / "step.jsonl").read_text().splitlines()
    assert sum('"kind":"step"' in line for line in lines) == 80  # the 20 warm-up steps too


def test_floor_splits_each_variant_into_a_cost_a_step_and_a_cost_a_run(monkeypatch, tmp_path, capsys):
    """bench/floor.py --long-steps on the CPU: every variant gets its slope (µs a step) and
    its rest (ms a run), one pair a round, beside the figure of its short runs."""
    monkeypatch.syspath_prepend(BENCH)
    mod = importlib.import_module("floor")
    out = tmp_path / "floor.json"
    assert mod.main(["--rounds", "2", "--steps", "40", "--long-steps", "120", "--device", "cpu",
                     "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["long_steps"] == 120
    for v in got["variants"].values():
        assert len(v["per_step_rounds_us"]) == len(v["per_run_rounds_ms"]) == len(v["rounds_us"]) == 2
        assert min(v["per_step_rounds_us"]) <= v["per_step_us"] <= max(v["per_step_rounds_us"])
    assert "µs a step" in capsys.readouterr().out


def test_held_energy_bench_times_the_three_ways_and_checks_they_agree(monkeypatch, tmp_path, capsys):
    monkeypatch.syspath_prepend(BENCH)
    mod = importlib.import_module("held_energy")
    out = tmp_path / "held.json"
    assert mod.main(["--records", "300", "--rounds", "2", "--json", str(out)]) == 0
    if not out.exists():  # without the C module there is nothing to compare, and it says so
        assert "not built" in capsys.readouterr().out
        return
    got = json.loads(out.read_text())
    assert set(got["ways"]) == set(mod.WAYS) and got["ways"]["python"]["ratio_median"] == 1.0
    assert all(w["median_us"] > 0 for w in got["ways"].values())


def test_crossings_says_it_needs_cuda_on_the_cpu(monkeypatch, capsys):
    """bench/crossings.py measures CUDA calls only: on the CPU it says so and measures nothing."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs it for real")
    monkeypatch.syspath_prepend(BENCH)
    mod = importlib.import_module("crossings")
    monkeypatch.setattr(sys, "argv", ["crossings.py"])
    assert mod.main() == 0
    assert "needs CUDA; nothing measured" in capsys.readouterr().out


def test_thread_split_gives_each_variant_its_threads_cpu(monkeypatch, tmp_path, capsys):
    """bench/thread_split.py at its smallest on the CPU: a row per variant, each thread's column,
    the JSON with the same figures."""
    monkeypatch.syspath_prepend(BENCH)
    mod = importlib.import_module("thread_split")
    out = tmp_path / "split.json"
    assert mod.main(["--steps", "200", "--rounds", "1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert list(res["us"]) == list(mod.VARIANTS) and res["bare_us"] > 0
    for row in res["us"].values():
        assert row["training"] > 0 and row["total"] >= row["training"] and row["stepprof-energy"] == 0
    table = capsys.readouterr().out
    assert all(f"  {name:26s}" in table for name in mod.VARIANTS)


def test_dist_scale_models_the_exchange_from_the_record_it_builds(monkeypatch):
    """bench/dist_scale.py's parts that need no processes: rank 0's ranks record over synthetic
    rows (it grows with the ranks) and the model (bytes, latency and the report grow with them)."""
    monkeypatch.syspath_prepend(BENCH)
    mod = importlib.import_module("dist_scale")
    small, large = mod.record_cost(8, 1), mod.record_cost(256, 1)
    assert 0 < small["bytes"] < large["bytes"] and small["ms"] >= 0
    sim = {"world": 8, "every": 100}
    records = {w: mod.record_cost(min(w, 256), 1) for w in mod.SCALES}
    costs = mod.model(sim, records, {"per_line_s": 1e-5}, 50000)
    assert list(costs) == list(mod.SCALES)
    for a, b in zip(mod.SCALES, mod.SCALES[1:]):
        assert costs[a]["received_bytes"] < costs[b]["received_bytes"]
        assert costs[a]["report_s"] < costs[b]["report_s"] and costs[a]["report_rss_gib"] < costs[b]["report_rss_gib"]
    assert costs[8]["sent_bytes"] == costs[16384]["sent_bytes"] and costs[8]["collectives_per_step"] == 0.01
