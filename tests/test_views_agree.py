"""Every view of a log names the same figures: the summary and `stepprof report` (one
aggregate), `stepprof plot`, `stepprof export` and a framework callback's window.

Each applies stepprof._rules (the run-record kinds, the timed-step rule, the step span, the
spike rule); these logs are the cases where the views once disagreed: an even step count (the
plot took the upper middle value), a compiled step (the plot counted it as a spike), and two
threads stepping at once (a late step split the run in two).
"""

from __future__ import annotations

import pytest

from stepprof import _plot
from stepprof._export import export_chrome
from stepprof._report.build import report_log
from stepprof.integrations._window import Window, figures

from . import logfixtures as fx

RID = "a" * 12


def _log(path, walls, *, order=None, compiled=(), warmup=0):
    recs = [fx.step_record(i, warmup=i < warmup, wall=w, gpu=w * 0.9, flops=False) for i, w in enumerate(walls)]
    for i in compiled:
        recs[i].update(compiles=1, recompiles=0, compile_ms=40.0, graph_breaks=0, recompile_reasons=[],
                       compiled=True)
    if order is not None:
        recs = [recs[i] for i in order]
    summary = fx.training_log(steps=1, warmup=0, flops=False)[-1]
    for r in (*recs, summary):
        r["run_id"] = RID
    return fx.write(str(path), [*recs, summary])


def _views(log):
    (run,) = report_log(log, workers=1).runs
    runs, _, _ = _plot._read(log)
    window = Window()
    for r in fx_records(log):
        window(r)
    return run, runs, figures(window.drain())


def fx_records(log):
    import orjson

    with open(log, "rb") as f:
        return [orjson.loads(line) for line in f if line.strip()]


def test_an_even_step_count_has_the_same_median_in_every_view(tmp_path):
    log = _log(tmp_path / "even.jsonl", [10.0, 5.0] * 5)
    run, (series,), window = _views(log)
    assert run.figures.wall_ms.median == pytest.approx(7.5)  # the mean of the two middle values
    assert _plot.run_figures(series).median_wall_ms == pytest.approx(7.5)
    assert window["stepprof/wall_ms"] == pytest.approx(7.5)


def test_a_compiled_step_is_left_out_of_every_view_and_is_no_spike(tmp_path):
    walls = [5.0] * 30
    walls[3] = 60.0   # compiled: slow, but not a spike of the steady state
    walls[20] = 40.0  # a real spike
    log = _log(tmp_path / "compiled.jsonl", walls, compiled=(3,), warmup=1)
    run, (series,), window = _views(log)
    plotted = _plot.run_figures(series)
    assert run.spikes is not None and run.spikes.count == 1
    assert [s.step for s in (*run.spikes.early, *run.spikes.late)] == [20]
    assert [int(i) for i, _ in plotted.spikes] == [20]
    assert run.figures.wall_ms.median == plotted.median_wall_ms == pytest.approx(5.0)
    assert window["stepprof/steps"] == run.measured_steps - 1  # the compiled step left out there too
    assert window["stepprof/wall_ms"] == pytest.approx(5.0)


def test_a_step_written_late_by_a_second_thread_stays_in_its_run_in_every_view(tmp_path):
    # Thread 2's step 2 closed after the training thread's steps 3..7: written after them.
    order = [0, 1, 3, 4, 5, 6, 7, 2, 8, 9]
    log = _log(tmp_path / "threads.jsonl", [5.0 + 0.1 * i for i in range(10)], order=order)
    rep = report_log(log, workers=1)
    assert [(r.run_id, r.steps, r.summary_found) for r in rep.runs] == [(RID, 10, True)]
    runs, _, _ = _plot._read(log)
    assert len(runs) == 1 and sorted(runs[0].step) == list(range(10))
    exported = export_chrome([log], str(tmp_path / "trace.json"))
    assert (exported.runs, exported.steps) == (1, 10)


def test_a_log_copied_onto_itself_is_still_two_runs(tmp_path):
    """A step index the run has seen already starts a new run (a late step is one it skipped)."""
    recs = fx_records(_log(tmp_path / "once.jsonl", [5.0] * 6))
    recs = [r for r in recs if r["kind"] == "step"]
    log = fx.write(str(tmp_path / "twice.jsonl"), recs + [dict(r) for r in recs])
    assert [r.steps for r in report_log(log, workers=1).runs] == [6, 6]
    assert [len(s.step) for s in _plot._read(log)[0]] == [6, 6]
