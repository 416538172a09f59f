"""The summary of the step records (stepprof._recorder.sinks)."""

from __future__ import annotations

import pytest

import stepprof
from stepprof._recorder.sinks import SummarySink

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
    assert line["measured_steps"] == 11 and line["wall_ms_percentiles"]["median"] == pytest.approx(6.0)
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


def _record(wall_ms, **kw):
    record = {"kind": "step", "warmup": False, "error": None, "device": "cuda:0", "wall_ms": wall_ms,
              "overhead_us": 1.0, "gpu_ms": wall_ms, "gpu_busy": 1.0, "batch_size": 4,
              "samples_per_s": 10.0, "peak_allocated_bytes": 100,
              "syncs": {"count": 0, "mechanism": "warn"}, "unavailable": {}}
    record.update(kw)
    return record


def test_the_summary_sink_sums_step_records_alone():
    """The summary is a function of the records: the sink folds them into a RunAggregate."""
    sink = SummarySink()
    sink.add(_record(50.0, warmup=True))
    sink.add(_record(9.0, error={"type": "ValueError", "message": "x"}))
    sink.add(_record(1.0))
    sink.add(_record(3.0, samples_per_s=None, unavailable={"samples_per_s": "no batch_size was given"}))
    sink.add(_record(2.0, tflops_per_s=5.0, mfu=None, flops_counted=True))
    s = sink.summary(log=None, ended_by="close", device="cuda:0", stopped=None, log_failed=None, flops_reason="not counted")
    assert (s.steps, s.warmup_steps, s.error_steps, s.measured_steps) == (5, 1, 1, 3)
    assert s.wall_ms.median == 2.0 and s.samples_per_s_median == 10.0
    assert "samples_per_s_median" not in s.unavailable  # other steps still give the median
    assert s.tflops_per_s_median is None  # the counted step's times include the counter's
    assert s.unavailable["tflops_per_s_median"] == s.unavailable["mfu_median"] == "not counted"
    assert s.sync_mechanism == "warn" and s.syncs_per_step_median == 0


def test_the_summary_sink_holds_bounded_memory_at_any_step_count():
    sink = SummarySink()
    for i in range(70_000):
        sink.add_step(_record(1.0 + (i % 89) * 0.01, step=i))
    agg = sink.aggregate
    held = sum(len(s.buf) + sum(map(len, s.levels)) for s in agg.sketches)
    assert held < 9 * 4 * agg.wall.EXACT and agg.approximate
    s = sink.summary(log=None, ended_by="close", device="cuda:0", stopped=None, log_failed=None, flops_reason=None)
    assert s.measured_steps == 70_000 and s.wall_ms.median == pytest.approx(1.44, abs=0.01)
