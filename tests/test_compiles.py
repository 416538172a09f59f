"""torch.compile awareness (stepprof/_recorder/compiles.py): compiles per step, flagged steps
left out of the figures, the recompile reasons in the spike diagnosis, the compiled roofline."""

from __future__ import annotations

import sys
import threading
import time

import orjson
import pytest
import torch
import torch._dynamo
from torch._dynamo.callback import callback_handler

import stepprof
from stepprof._aggregate import ONLY_COMPILE_STEPS, RunAggregate
from stepprof._cli import main
from stepprof._recorder import compiles
from stepprof._recorder.profiler import _make_profiler
from stepprof._report import build_report, render
from stepprof._roofline import roofline
from stepprof._stats import quantile

from . import logfixtures as fx

FIELDS = ("compiles", "recompiles", "compile_ms", "graph_breaks", "recompile_reasons", "compiled")


def _fn(x):
    return (x.sin() * 2).cos()


def _compiled():
    """A fresh compiled function that recompiles at each new shape (no dynamic shapes)."""
    torch._dynamo.reset()
    return torch.compile(lambda x: _fn(x), backend="eager", dynamic=False)


def _run(log, shapes, *, warmup=1, before=None, between=None, inside=None, **kw):
    f = _compiled()
    if before is not None:
        before(f)
    with _make_profiler(log, warmup=warmup, collect_every_s=None, **kw) as prof:
        for i, n in enumerate(shapes):
            if between is not None:
                between(i, f)
            with prof.step():
                f(torch.ones(n))
                if inside is not None:
                    inside(i, f)
    return prof


def _steps(log):
    return list(stepprof.read(log, kind="step"))


def _report(log):
    return render(build_report([log]))


def _report_json(capsys, log):
    capsys.readouterr()
    assert main(["report", "--json", log]) == 0
    (run,) = orjson.loads(capsys.readouterr().out)["logs"][0]["runs"]
    return run


def test_three_shapes_compile_exactly_on_the_steps_that_recompiled(log, capsys):
    shapes = [4, 4, 5, 5, 6, 6, 4, 5, 6, 6]
    prof = _run(log, shapes)
    recs = _steps(log)
    assert [r["compiles"] for r in recs] == [1, 0, 1, 0, 1, 0, 0, 0, 0, 0]
    assert [r["recompiles"] for r in recs] == [0, 0, 1, 0, 1, 0, 0, 0, 0, 0]
    assert [r["compiled"] for r in recs] == [r["compiles"] > 0 for r in recs]
    assert all(r["compile_ms"] > 0 for r in recs if r["compiled"])
    assert all(r["compile_ms"] == 0 and r["recompile_reasons"] == [] for r in recs if not r["compiled"])
    assert all(r["graph_breaks"] == 0 for r in recs)
    # The failed guard, from torch's compilation metrics.
    assert "size mismatch at index 0. expected 4, actual 5" in recs[2]["recompile_reasons"][0]
    assert "expected 5, actual 6" in recs[4]["recompile_reasons"][0]
    # Flagged steps are left out of the figures like warm-up ones, and counted.
    s = prof.summary
    assert s.measured_steps == 9 and s.compile_steps == 2
    timed = sorted(r["wall_ms"] for r in recs[1:] if not r["compiled"])
    assert len(timed) == 7 and s.wall_ms.median == pytest.approx(quantile(timed, 0.5))
    assert "2 steps that compiled left out" in str(s)
    summary = next(stepprof.read(log, kind="summary"))
    assert summary["compile_steps"] == 2
    # The report agrees with the summary, and its spike diagnosis names the recompiles.
    run = _report_json(capsys, log)
    assert run["compile"]["steps"] == s.compile_steps == 2 and run["compile"]["step_list"] == [2, 4]
    assert run["compile"]["compiles"] == 3  # the warm-up step's first compile included
    assert run["figures"]["wall_ms"]["median"] == s.wall_ms.median
    spikes = next(d for d in run["diagnoses"] if d["kind"] == "spikes")
    assert any(e.startswith("step 2 recompiled:") and "size mismatch" in e for e in spikes["evidence"])
    assert any(e.startswith("step 4 recompiled:") for e in spikes["evidence"])
    assert any("mark_dynamic" in r for r in spikes["remedy"])
    text = _report(log)
    assert "compiled steps            2 of the measured, left out of the figures (3 compiles" in text
    assert "step 2 recompiled: " in text


def test_an_eager_run_never_mentions_it(log, capsys):
    """A run without torch.compile never mentions compilation: records, summary, report."""
    assert compiles.WATCH.listeners == ()
    with _make_profiler(log, warmup=1, collect_every_s=None) as prof:
        for i in range(30):
            with prof.step():
                torch.ones(64).sin()
                if i == 20:
                    time.sleep(0.05)  # a spike
    for r in _steps(log):
        assert not set(FIELDS) & set(r)
    with open(log, "rb") as f:
        raw = f.read().decode().replace('"boundary":"compiled"', "")  # (stepprof's own boundary, in C)
    assert "compil" not in raw.lower(), raw[raw.lower().find("compil") - 200:][:400]
    assert prof.summary.compile_steps is None and "compil" not in str(prof.summary).lower()
    text = _report(log)
    assert "Spikes: steps far above the median" in text  # the spike is diagnosed ...
    assert "host noise" in text  # ... and explained elsewhere
    assert "compil" not in text.lower()
    run = _report_json(capsys, log)
    assert run["compile"] is None
    assert "compil" not in orjson.dumps(run["diagnoses"]).decode().lower()


def test_a_spike_in_a_compiled_run_that_compiled_nothing_says_not_compilation(log):
    def spike(i, f):
        if i == 25:
            time.sleep(0.05)  # inside step 25: its own time spikes

    _run(log, [4] * 30, inside=spike)
    recs = _steps(log)
    assert recs[0]["compiled"] and not any(r["compiled"] for r in recs[1:])
    text = _report(log)
    assert "evidence: not compilation: these steps compiled nothing" in text
    assert "recompiled" not in text and "host noise" in text


def test_a_process_that_compiled_before_the_first_step_gets_the_fields_on_every_step(log):
    prof = _run(log, [4, 4, 4], before=lambda f: f(torch.ones(4)))
    recs = _steps(log)
    assert [r["compiles"] for r in recs] == [0, 0, 0]
    assert prof.summary.compile_steps == 0
    assert "compiled steps            0 of the measured" in _report(log)


def test_the_fields_start_at_the_first_step_that_compiled(log):
    shapes = [4, 4, 4, 5, 5]
    f = torch.compile(_fn, backend="eager", dynamic=False)
    torch._dynamo.reset()
    with _make_profiler(log, warmup=0, collect_every_s=None) as prof:
        for i, n in enumerate(shapes):
            with prof.step():
                if i >= 2:
                    f(torch.ones(n))
                else:
                    _fn(torch.ones(n))
    recs = _steps(log)
    assert [r.get("compiles") for r in recs] == [None, None, 1, 1, 0]
    assert prof.summary.compile_steps == 2


def test_a_compile_outside_any_step_counts_against_none(log):
    def outside(i, f):
        if i == 2:
            f(torch.ones(9))  # a recompile between steps

    prof = _run(log, [4, 4, 4, 4], between=outside)
    assert [r["compiles"] for r in _steps(log)] == [1, 0, 0, 0]
    assert prof._compiles.outside == 1


def test_torch_dynamo_reset_keeps_the_callbacks(log):
    def reset(i, f):
        if i == 2:
            torch._dynamo.reset()  # clears torch's callback lists: stepprof's come back

    _run(log, [4, 4, 4, 4], between=reset)
    assert [r["compiles"] for r in _steps(log)] == [1, 0, 1, 0]


def test_the_callbacks_leave_torch_at_close(log):
    prof = _make_profiler(log, collect_every_s=None)
    with prof.step():
        pass
    assert compiles._on_start in callback_handler.start_callbacks
    assert "clear" in vars(callback_handler)
    prof.close()
    assert compiles._on_start not in callback_handler.start_callbacks
    assert compiles._on_end not in callback_handler.end_callbacks
    assert "clear" not in vars(callback_handler) and compiles.WATCH.listeners == ()


def test_two_profilers_share_the_callbacks_until_the_last_closes(log, tmp_path):
    f = _compiled()
    a = _make_profiler(log, collect_every_s=None)
    b = _make_profiler(str(tmp_path / "b.jsonl"), collect_every_s=None)
    with a.step():
        f(torch.ones(3))
    with b.step():
        f(torch.ones(5))
    a.close()
    assert callback_handler.start_callbacks.count(compiles._on_start) == 1
    with b.step():
        f(torch.ones(7))
    b.close()
    assert compiles._on_start not in callback_handler.start_callbacks
    assert [r["compiles"] for r in _steps(log)] == [1]
    assert [r["compiles"] for r in _steps(str(tmp_path / "b.jsonl"))] == [1, 1]


def test_dynamo_imported_after_the_first_step_is_watched_from_the_next_harvest(log, monkeypatch):
    f = _compiled()
    hidden = sys.modules.pop("torch._dynamo.callback")
    try:
        prof = _make_profiler(log, collect_every_s=None)
        with prof.step():
            pass
        assert prof._compiles._waiting and compiles.WATCH.listeners == ()
    finally:
        sys.modules["torch._dynamo.callback"] = hidden
    with prof.step():  # its exit harvests: the hook joins there
        pass
    assert compiles.WATCH.listeners == (prof._compiles,)
    with prof.step():
        f(torch.ones(3))
    prof.close()
    assert [r.get("compiles") for r in _steps(log)] == [None, None, 1]


def test_a_compile_on_a_thread_without_steps_counts_against_the_training_step(log):
    f = _compiled()

    def elsewhere():
        t = threading.Thread(target=lambda: f(torch.ones(6)))
        t.start()
        t.join()

    with _make_profiler(log, collect_every_s=None) as prof:
        with prof.step():
            elsewhere()  # as autograd's threads compile a lazy backward
        with prof.step():
            pass
    assert [r["compiles"] for r in _steps(log)] == [1, 0]


def test_graph_breaks_are_counted_in_the_step(log):
    def broken(x):
        x = x.sin()
        torch._dynamo.graph_break()
        return x.cos()

    torch._dynamo.reset()
    f = torch.compile(broken, backend="eager")
    with _make_profiler(log, collect_every_s=None) as prof:
        for _ in range(2):
            with prof.step():
                f(torch.ones(3))
    recs = _steps(log)
    assert recs[0]["graph_breaks"] == 1 and recs[0]["compiles"] == 2  # the frame and its resume
    assert recs[1]["graph_breaks"] == 0


def test_a_failing_callback_never_breaks_the_compile(log, monkeypatch):
    def fail(*_):
        raise RuntimeError("boom")

    monkeypatch.setattr(compiles, "_graph_breaks", fail)
    prof = _run(log, [4, 5])
    assert [r.get("compiles") for r in _steps(log)] == [None, None]  # the events were lost ...
    assert prof.summary.measured_steps == 1 and prof.summary.compile_steps is None  # ... the steps ran


def test_recompile_reasons_are_capped_per_run(log):
    with torch._dynamo.config.patch(recompile_limit=64):
        prof = _run(log, list(range(2, 16)), warmup=0)
    recs = _steps(log)
    reasons = [why for r in recs for why in r["recompile_reasons"]]
    assert len(reasons) == compiles.REASONS_PER_RUN
    late = [r for r in recs if r["recompiles"] and not r["recompile_reasons"]]
    assert late and all("first 10 recompile reasons" in r["unavailable"]["recompile_reasons"] for r in late)
    assert prof.summary.compile_steps == 14


# -- the aggregate and the report, from records ---------------------------------------


def _rec(i, wall, *, compiled=None, warmup=False, reasons=()):
    r = {"kind": "step", "step": i, "warmup": warmup, "wall_ms": wall, "error": None}
    if compiled is not None:
        r.update(compiles=int(compiled), recompiles=int(bool(reasons)), compile_ms=30.0 if compiled else 0.0,
                 graph_breaks=0, recompile_reasons=list(reasons), compiled=compiled)
    return r


def test_the_aggregate_leaves_compile_steps_out_and_counts_them():
    agg = RunAggregate()
    agg.add(_rec(0, 100.0, compiled=True, warmup=True))
    for i in range(1, 6):
        agg.add(_rec(i, 50.0 if i == 3 else 2.0, compiled=i == 3, reasons=["guard x"] if i == 3 else ()))
    fields = agg.summary_fields()
    assert fields["measured_steps"] == 5 and fields["compile_steps"] == 1
    assert fields["wall_ms"].median == 2.0 and agg.timed_steps == 4
    assert agg.compiles == 2 and agg.compile_us == 60_000 and agg.recompile_reasons == [(3, "guard x")]
    # Split in two stretches and merged: the same.
    a, b = RunAggregate(), RunAggregate()
    a.add(_rec(0, 100.0, compiled=True, warmup=True))
    a.add(_rec(1, 2.0, compiled=False))
    for i in range(2, 6):
        b.add(_rec(i, 50.0 if i == 3 else 2.0, compiled=i == 3, reasons=["guard x"] if i == 3 else ()))
    a.merge(b)
    assert a.summary_fields()["compile_steps"] == 1 and a.recompile_reasons == [(3, "guard x")]
    assert a.compile_us == agg.compile_us


def test_only_compile_steps_measured_says_why_there_are_no_figures():
    agg = RunAggregate()
    agg.add(_rec(0, 5.0, compiled=True))
    assert agg.unavailable()["wall_ms"] == ONLY_COMPILE_STEPS


def test_no_compile_fields_no_compile_steps():
    agg = RunAggregate()
    agg.add(_rec(0, 5.0))
    assert agg.summary_fields()["compile_steps"] is None


# -- the roofline of a compiled step -------------------------------------------------


CAL = {"matmul_tflops": {"bf16": 720.0}, "copy_gbps": 3900.0, "launch_us": 6.0}


def _roof(step_ms, flops, op_bytes, *, compiled, ops=10):
    return roofline(step_ms=step_ms, flops_by_dtype={"bf16": flops}, op_bytes=op_bytes, ops=ops,
                    calibration=CAL, compiled=compiled)


def test_a_compiled_step_at_59pct_mfu_is_compute_bound_not_memory_bound():
    flops = 0.59 * 10.0e-3 * 720e12  # 59% of a 10 ms step at the calibrated rate
    op_bytes = 13e-3 * 3900e9  # the eager count: 13 ms at the copy bandwidth
    assert _roof(10.0, flops, op_bytes, compiled=False)["class"] == "memory-bound"
    r = _roof(10.0, flops, op_bytes, compiled=True)
    assert r["class"] == "compute-bound" and r["explained"] == pytest.approx(0.59)
    assert "upper bound for fused kernels" in r["caveat"] and "59%" in r["caveat"]


def test_a_compiled_memory_bound_above_the_step_names_no_class():
    r = _roof(10.0, 0.2 * 10e-3 * 720e12, 13e-3 * 3900e9, compiled=True)
    assert r["class"] is None and "exceeds the measured 10.00 ms step" in r["reason"]


def test_a_compiled_memory_bound_that_holds_with_the_caveat_stays():
    r = _roof(10.0, 0.2 * 10e-3 * 720e12, 8e-3 * 3900e9, compiled=True)
    assert r["class"] == "memory-bound" and "upper bound for fused kernels" in r["caveat"]


def _compiled_log(tmp_path, op_bytes):
    recs = fx.training_log(spikes=())
    for r in recs:
        if r["kind"] == "step":
            r.update(compiles=0, recompiles=0, compile_ms=0.0, graph_breaks=0, recompile_reasons=[],
                     compiled=False)
        elif r["kind"] == "flops":
            r["op_bytes"] = op_bytes
    return fx.write(str(tmp_path / "compiled.jsonl"), recs)


def test_the_report_never_recommends_torch_compile_to_a_compiled_run(tmp_path):
    # The H200 fixture's step: compute-bound at about 64% MFU; its eager byte count raised
    # past the compute bound, as in a compiled GPT-2 whose report said "memory-bound".
    log = _compiled_log(tmp_path, 5.5e-3 * 3900e9)
    (run,) = build_report([log]).logs[0].runs
    assert run.roofline["class"] == "compute-bound"
    roof = next(d for d in run.diagnoses if d.kind == "roofline")
    assert any("upper bound for fused kernels" in e for e in roof.evidence)
    text = _report(log)
    assert "torch.compile(" not in text and "(torch.compile)" not in text
    # The same log without the compile fields: the eager reading, with its remedy.
    recs = [{k: v for k, v in r.items() if k not in FIELDS} for r in stepprof.read(log)]
    eager = fx.write(str(tmp_path / "eager.jsonl"), recs)
    (run,) = build_report([eager]).logs[0].runs
    assert run.roofline["class"] == "memory-bound"
    assert "fuse elementwise ops (torch.compile)" in _report(eager)


def test_a_compiled_memory_bound_run_gets_remedies_without_torch_compile(tmp_path):
    recs = fx.training_log(spikes=())
    for r in recs:
        if r["kind"] == "step":
            r.update(compiles=0, recompiles=0, compile_ms=0.0, graph_breaks=0, recompile_reasons=[],
                     compiled=False)
        elif r["kind"] == "flops":
            r["flops_by_dtype"] = {"bf16": fx.FLOPS / 4}
            r["op_bytes"] = 6.5e-3 * 3900e9
    log = fx.write(str(tmp_path / "mem.jsonl"), recs)
    (run,) = build_report([log]).logs[0].runs
    roof = next(d for d in run.diagnoses if d.kind == "roofline")
    assert roof.title == "Roofline: memory-bound"
    assert not any("torch.compile" in r for r in roof.remedy)
    assert any("upper bound for fused kernels" in e for e in roof.evidence)


# -- CUDA ----------------------------------------------------------------------------


@pytest.mark.cuda
def test_reduce_overhead_replays_are_timed_by_the_events(tmp_path):
    """A CUDA-graph replay's gpu_ms is within 2% of an independent event span around it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).cuda()
    x = torch.randn(1024, 2048, device="cuda")
    torch._dynamo.reset()
    step = torch.compile(lambda: model(x).relu().sum(), mode="reduce-overhead")
    log = str(tmp_path / "ro.jsonl")
    spans = []
    with torch.no_grad(), stepprof.Profiler(log, warmup=5) as prof:
        for _ in range(30):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with prof.step():
                a.record()
                for _ in range(5):
                    torch.compiler.cudagraph_mark_step_begin()
                    step()
                b.record()
            spans.append((a, b))
    torch.cuda.synchronize()
    recs = _steps(log)
    assert any(r["compiled"] for r in recs[:5])  # compiled (and recorded the graph) in warm-up
    steady = [(r, spans[r["step"]]) for r in recs[10:] if not r["compiled"]]
    assert len(steady) >= 15
    gpu = sorted(r["gpu_ms"] for r, _ in steady)
    ref = sorted(a.elapsed_time(b) for _, (a, b) in steady)
    g, e = quantile(gpu, 0.5), quantile(ref, 0.5)
    assert abs(g - e) / e < 0.02, (g, e)


# -- the spike diagnosis looks elsewhere ----------------------------------------------


def _spiky_log(tmp_path, name, **extra_at_spike):
    recs = []
    for i in range(40):
        r = {"schema_version": 2, "kind": "step", "step": i, "name": "step", "warmup": False,
             "wall_ms": 2.0, "error": None, "syncs": {"count": 1}, "data_wait_ms": 0.1}
        if i == 30:
            r.update(wall_ms=20.0, **extra_at_spike)
        recs.append(r)
    return fx.write(str(tmp_path / name), recs)


def test_a_spike_with_extra_syncs_is_named_as_such_and_a_data_wait_explains_none(tmp_path):
    # The data wait is before the step's entry: it is not part of the spike's 20 ms.
    text = _report(_spiky_log(tmp_path, "wait.jsonl", data_wait_ms=17.0))
    assert "host noise" in text and "waited for data" not in text
    text = _report(_spiky_log(tmp_path, "syncs.jsonl", syncs={"count": 4}))
    assert "evidence: more syncs than the median 1: step 30 (4)" in text and "host noise" not in text
    text = _report(_spiky_log(tmp_path, "noise.jsonl"))
    assert "host noise" in text and "waited for data" not in text
    assert "compil" not in text.lower()


def test_recompile_reasons_are_capped_per_step(log):
    f = _compiled()
    with _make_profiler(log, collect_every_s=None):
        with stepprof.profile_step():
            for n in range(2, 7):  # one compile, four recompiles
                f(torch.ones(n))
    (r,) = _steps(log)
    assert r["compiles"] == 5 and r["recompiles"] == 4 and len(r["recompile_reasons"]) == 3
    assert "recompiled 4 times" in r["unavailable"]["recompile_reasons"]
