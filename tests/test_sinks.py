"""The summary of the step records (stepprof._recorder.sinks)."""

from __future__ import annotations

import pytest

import stepprof

from .conftest import make, steps


def test_warmup_and_summary_statistics(log, gpu):
    prof = make(log, gpu, warmup=2)
    walls = [100, 100, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]   # warm-up steps are slow
    for w in walls:
        with prof.step(batch_size=10):
            gpu.host(w)
    s = prof.close()
    recs = steps(log)
    assert [r["warmup"] for r in recs] == [True, True] + [False] * 11
    assert (s.steps, s.warmup_steps, s.measured_steps) == (13, 2, 11)
    assert s.wall_ms.median == pytest.approx(6.0)
    assert s.wall_ms.p10 == pytest.approx(2.0)
    assert s.wall_ms.p90 == pytest.approx(10.0)
    assert s.samples_per_s_median == pytest.approx(10 / 6e-3)
    (line,) = list(stepprof.read(log, kind="summary"))
    assert line["measured_steps"] == 11 and line["wall_ms"]["median"] == pytest.approx(6.0)
    assert line["schema_version"] == stepprof.SCHEMA_VERSION
    assert "6.00 ms" in str(s) and "11 measured steps" in str(s)


def test_summary_is_null_with_reasons_when_nothing_was_measured(log, gpu):
    s = make(log, gpu, warmup=5).close()
    assert s.steps == 0 and s.wall_ms is None and s.gpu_ms is None
    assert "no measured steps" in s.unavailable["wall_ms"]


def test_summary_gpu_busy_that_no_step_had_is_null_with_the_reason(log, gpu):
    prof = make(log, gpu)
    for _ in range(3):
        with prof.step(batch_size=2):
            gpu.launch(1.0)         # device work, no host time: wall_ms is 0, gpu_busy null
    s = prof.close()
    assert all(r["gpu_busy"] is None and r["unavailable"]["gpu_busy"] for r in steps(log))
    assert s.gpu_ms.median == pytest.approx(1.0) and s.gpu_busy_median is None
    assert s.unavailable["gpu_busy_median"] == "wall time was zero"
