"""stepprof._aggregate.RunAggregate: the one aggregate behind the summary and the report.

The contract the recorder relies on: fed the records a ``Profiler`` writes, the
aggregate's ``summary_fields()`` equal the ``Summary`` that ``Profiler.close()`` returns.
"""

from __future__ import annotations

import attrs
import pytest
import torch

import stepprof
from stepprof._aggregate import NO_MEASURED_STEPS, NOT_REQUESTED_FLOPS, RunAggregate

from . import logfixtures as fx


def _aggregate(log: str) -> RunAggregate:
    agg = RunAggregate()
    for record in stepprof.read(log):
        agg.add(record)
    return agg


def _run_cpu_profiler(log: str, **kwargs) -> stepprof.Summary:
    """Six steps on the CPU: one warm-up, one failing, phases, two batch sizes."""
    model = torch.nn.Linear(32, 32)
    with stepprof.Profiler(log, warmup=1, **kwargs) as prof:
        for i in range(6):
            try:
                with prof.step(batch_size=8 if i % 2 else 16):
                    with prof.measure("forward"):
                        loss = model(torch.randn(16, 32)).sum()
                    with prof.measure("backward"):
                        loss.backward()
                    if i == 3:
                        raise ValueError("a failing step")
            except ValueError:
                pass
    return prof.summary


def _summary_fields(summary: stepprof.Summary) -> dict:
    fields = attrs.asdict(summary, recurse=False)
    del fields["log"]
    return fields


def test_summary_fields_are_exactly_the_summarys_constructor_arguments_but_log():
    names = {a.name for a in attrs.fields(stepprof.Summary)} - {"log"}
    assert set(RunAggregate().summary_fields()) == names


def test_a_cpu_profilers_log_aggregates_to_its_summary_field_by_field(tmp_path):
    log = str(tmp_path / "cpu.jsonl")
    summary = _run_cpu_profiler(log)
    assert (summary.steps, summary.warmup_steps, summary.error_steps) == (6, 1, 1)
    fields = _aggregate(log).summary_fields()
    expected = _summary_fields(summary)
    for name, value in expected.items():
        assert fields[name] == value, name
    # and the summary rebuilt from the fields is the one the profiler returned
    assert stepprof.Summary(log=log, **fields) == summary


def test_with_flops_the_counted_step_is_left_out_of_the_time_figures(tmp_path):
    log = str(tmp_path / "flops.jsonl")
    summary = _run_cpu_profiler(log, flops="auto")
    agg = _aggregate(log)
    fields = agg.summary_fields()
    expected = _summary_fields(summary)
    assert agg.flops_counted_step == 1 and fields["measured_steps"] == expected["measured_steps"] == 4
    # The counted step ran eagerly under FlopCounterMode: it is left out of every per-step
    # figure, of the profiler's summary as of the aggregate (the summary is built from it).
    steps = [r for r in stepprof.read(log, kind="step")]
    timed = [r for r in steps if not r["warmup"] and r["error"] is None and not r.get("flops_counted")]
    assert fields["wall_ms"] == stepprof.Percentiles.of([r["wall_ms"] for r in timed])
    for name, value in expected.items():
        assert fields[name] == value, name
    assert fields["tflops_per_s_median"] is not None
    assert stepprof.Summary(log=log, **fields).tflops_per_s_median == summary.tflops_per_s_median


def test_no_flops_requested_names_the_one_reason(tmp_path):
    log = str(tmp_path / "plain.jsonl")
    summary = _run_cpu_profiler(log)
    reasons = _aggregate(log).summary_fields()["unavailable"]
    assert reasons["tflops_per_s_median"] == reasons["mfu_median"] == NOT_REQUESTED_FLOPS
    assert summary.unavailable["mfu_median"] == NOT_REQUESTED_FLOPS


def test_only_warm_up_steps_give_every_figure_the_no_measured_steps_reason():
    agg = RunAggregate()
    for i in range(3):
        agg.add(fx.step_record(i, warmup=True, wall=5.0, gpu=5.0))
    fields = agg.summary_fields()
    assert fields["measured_steps"] == 0 and fields["wall_ms"] is None
    for name in ("wall_ms", "gpu_ms", "gpu_busy_median", "peak_allocated_bytes_max",
                 "samples_per_s_median", "overhead_us_median", "syncs_per_step_median"):
        assert fields["unavailable"][name] == NO_MEASURED_STEPS


def test_extra_reasons_from_the_profiler_are_added_last():
    fields = RunAggregate().summary_fields(extra_unavailable={"log": "disk full", "stepprof": "broke"})
    assert fields["unavailable"]["log"] == "disk full" and fields["unavailable"]["stepprof"] == "broke"


def test_merge_of_two_stretches_equals_one_pass():
    records = [r for r in fx.training_log(steps=200) if r["kind"] != "summary"]
    whole, first, second = RunAggregate(), RunAggregate(), RunAggregate()
    for i, r in enumerate(records):
        whole.add(r)
        (first if i < 77 else second).add(r)
    first.merge(second)
    assert first.summary_fields() == whole.summary_fields()
    assert first.figures() == whole.figures()


def test_memory_stays_bounded_whatever_the_step_count():
    agg = RunAggregate()
    base = fx.step_record(0, warmup=False, wall=7.0, gpu=7.0)
    for i in range(100_000):
        agg.add_step(dict(base, step=i, wall_ms=7.0 + (i % 97) * 0.01))
    held = sum(len(s.buf) + sum(map(len, s.levels)) for s in agg.sketches)
    assert held < 9 * 4 * agg.wall.EXACT and agg.approximate
    assert agg.figures().wall_ms.median == pytest.approx(7.48, abs=0.02)


def test_each_step_names_aggregate_has_its_steps_and_the_runs_other_records():
    agg = RunAggregate(index=3)
    agg.run_id = "r"
    agg.add({"kind": "memory", "trigger": "periodic", "residual_bytes": 5})
    for i in range(6):
        agg.add_step(dict(fx.step_record(i, warmup=False, wall=2.0 + i % 2, gpu=None), name="ab"[i % 2]))
    agg.add({"kind": "flops", "flops_per_step": 1e9})
    agg.index = 5  # a parallel read renumbers a run after reading it
    groups = agg.name_groups()
    assert list(groups) == ["a", "b"] and [g.steps for g in groups.values()] == [3, 3]
    assert {g.figures().wall_ms.median for g in groups.values()} == {2.0, 3.0}
    assert all(g.index == 5 and g.run_id == "r" and g.memory_last == agg.memory_last for g in groups.values())
    assert all(g.flops is None for g in groups.values()) and agg.flops is not None  # no step of theirs was counted


def test_a_later_stretch_without_step_indices_keeps_the_last_index():
    first, later = RunAggregate(), RunAggregate()
    for i in range(3):
        first.add_step(fx.step_record(i, warmup=False, wall=2.0, gpu=None))
    later.add_step(dict(fx.step_record(0, warmup=False, wall=2.0, gpu=None), step=None))
    first.merge(later)
    assert (first.steps, first.first_step, first.last_step) == (4, 0, 2)
