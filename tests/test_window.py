"""The integrations' window: step records from the collector, medians at the framework's log step."""

from __future__ import annotations

import threading

from stepprof.integrations._window import Window, figures
from tests.conftest import make


def test_window_gets_each_measured_step_record_and_logs_medians(log, gpu):
    window = Window()
    prof = make(log, gpu, warmup=1)
    prof.watch(window)
    seen_on = []
    prof.watch(lambda r: seen_on.append(threading.current_thread().name))
    for i in range(5):
        with prof.step(batch_size=4):
            with prof.measure("forward"):
                gpu.launch(1.0 + i); gpu.host(0.5 + i)
    prof.close()
    records = window.drain()
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # the warm-up step is left out
    assert window.drain() == []
    got = figures(records)
    assert got["stepprof/steps"] == 4.0
    walls = sorted(r["wall_ms"] for r in records)
    assert got["stepprof/wall_ms"] == (walls[1] + walls[2]) / 2
    assert got["stepprof/samples_per_s"] > 0
    assert "stepprof/phases/forward/wall_ms" in got
    gpus = sorted(r["gpu_ms"] for r in records)
    assert got["stepprof/gpu_ms"] == (gpus[1] + gpus[2]) / 2
    assert len(seen_on) == 4 + 1  # every step record, warm-up included, reaches a watcher


def test_a_watcher_that_raises_is_dropped_and_the_run_goes_on(log, gpu, recwarn):
    prof = make(log, gpu)
    window = Window()

    def bad(record):
        raise ValueError("boom")

    prof.watch(bad)
    prof.watch(window)
    for _ in range(3):
        with prof.step():
            pass
    summary = prof.close()
    assert summary.measured_steps == 3
    assert len(window.drain()) == 3
    assert any("watcher" in str(w.message) for w in recwarn.list)


def test_figures_of_an_empty_window_are_empty_and_a_null_figure_is_left_out():
    assert figures([]) == {}
    got = figures([{"wall_ms": 2.0, "gpu_ms": None, "peak_allocated_bytes": None,
                    "phases": {"fwd": {"wall_ms": 1.0, "gpu_ms": None}}}])
    assert got == {"stepprof/steps": 1.0, "stepprof/wall_ms": 2.0, "stepprof/phases/fwd/wall_ms": 1.0}
