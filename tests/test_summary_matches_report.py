"""Profiler.close() and `stepprof report --json` read one log's figures from one RunAggregate.

So every figure they share is equal, to the last digit (``==``, never approx): the step
counts, the wall and GPU medians and p90s, samples/s, GPU busy, stepprof's overhead, the
peak, syncs per step, TFLOP/s, MFU and every phase figure.  The summary record in the log
is the returned Summary, written.
"""

from __future__ import annotations

import attrs
import orjson
import pytest
import torch

import stepprof
from stepprof._cli import main
from stepprof._roofline import save_calibration

from . import logfixtures as fx
from .conftest import make

#: The figures of ``Summary`` and where ``report --json`` keeps the same figure in a run.
SHARED = {
    "steps": ("steps",),
    "warmup_steps": ("warmup_steps",),
    "error_steps": ("error_steps",),
    "measured_steps": ("measured_steps",),
    "device": ("device",),
    "wall_ms": ("figures", "wall_ms"),
    "gpu_ms": ("figures", "gpu_ms"),
    "samples_per_s_median": ("figures", "samples_per_s", "median"),
    "gpu_busy_median": ("figures", "gpu_busy_median"),
    "overhead_us_median": ("figures", "overhead_us_median"),
    "peak_allocated_bytes_max": ("memory", "peak_allocated_bytes_max"),
    "syncs_per_step_median": ("figures", "syncs_per_step", "median"),
    "tflops_per_s_median": ("figures", "tflops_per_s_median"),
    "mfu_median": ("figures", "mfu_median"),
    "mfu_datasheet_median": ("figures", "mfu_datasheet_median"),
    "energy_j_per_step": ("figures", "energy_j_per_step"),
    "power_w_mean": ("figures", "power_w_mean"),
    "samples_per_j": ("figures", "samples_per_j"),
}


def _train(prof: stepprof.Profiler, steps: int = 9, on_step=None) -> None:
    """Phases (one nested), two batch sizes, and step 3 failing."""
    model = torch.nn.Linear(32, 32)
    for i in range(steps):
        try:
            with prof.step(batch_size=8 if i % 2 else 16):
                if on_step is not None:
                    on_step(i)
                with prof.measure("forward"):
                    out = model(torch.randn(16, 32))
                    with prof.measure("loss"):
                        loss = out.square().mean()
                with prof.measure("backward"):
                    loss.backward()
                if i == 3:
                    raise ValueError("a failing step")
        except ValueError:
            pass


def _report_run(capsys, log: str) -> dict:
    capsys.readouterr()
    assert main(["report", "--json", log]) == 0
    (run,) = orjson.loads(capsys.readouterr().out)["logs"][0]["runs"]
    return run


def _at(run: dict, path: tuple[str, ...]):
    value = run
    for key in path:
        value = None if value is None else value[key]
    return value


def _summary_value(summary: stepprof.Summary, name: str):
    value = getattr(summary, name)
    return attrs.asdict(value) if isinstance(value, stepprof.Percentiles) else value


def _assert_shared_figures_equal(summary: stepprof.Summary, run: dict, log: str) -> None:
    for name, path in SHARED.items():
        assert _summary_value(summary, name) == _at(run, path), name
    rows = {row.pop("name"): row for row in run["phases"]}
    assert list(rows) == list(summary.phases)
    for name, figures in summary.phases.items():
        assert attrs.asdict(figures) == rows[name], name
    # The log's summary record is the Summary, written (floats round-trip exactly).
    (line,) = stepprof.read(log, kind="summary")
    assert line == {"schema_version": stepprof.SCHEMA_VERSION, **summary.to_record()}
    assert run["summary_found"]


def test_a_cpu_run_closes_to_the_figures_of_its_report(tmp_path, capsys):
    log = str(tmp_path / "cpu.jsonl")
    prof = stepprof.Profiler(log, warmup=2, flops_per_step=4.0e6, device="cpu")
    # The CPU has no calibration (`stepprof calibrate` measures CUDA GPUs), so MFU would be
    # null: give the FLOPs hook the ideal time that a calibration would have given.
    prof._flops.ideal_ms, prof._flops.mfu_reason = 0.001, None
    with prof:
        _train(prof)
    summary = prof.summary
    assert (summary.steps, summary.warmup_steps, summary.error_steps, summary.measured_steps) == (9, 2, 1, 6)
    assert summary.device == "cpu"
    assert summary.tflops_per_s_median is not None and summary.mfu_median is not None
    assert list(summary.phases) == ["forward/loss", "forward", "backward"]
    forward = summary.phases["forward"]
    assert forward.steps == 6 and forward.runs_per_step == 1.0 and forward.wall_ms_median > 0
    # Without CUDA a phase has no GPU time, peak or syncs: null, and the summary says why.
    assert forward.gpu_ms_median is forward.peak_allocated_bytes_max is forward.syncs_per_step is None
    assert {"phases.gpu_ms", "phases.peak_allocated_bytes_max", "phases.syncs_per_step"} <= set(
        summary.unavailable
    )
    _assert_shared_figures_equal(summary, _report_run(capsys, log), log)


def test_a_fake_cuda_run_closes_to_the_figures_of_its_report(tmp_path, capsys, monkeypatch, gpu):
    """GPU time, busy, peaks and syncs from the fake device; MFU from a calibration."""
    monkeypatch.setenv("STEPPROF_CACHE_DIR", str(tmp_path / "cache"))
    calibration = {k: v for k, v in fx.CALIBRATION.items() if k != "calibration_version"}
    save_calibration({**calibration, "device_name": "Fake GPU"})
    monkeypatch.setattr("stepprof._recorder.flops.device_name", lambda index: "Fake GPU")
    monkeypatch.setattr(gpu, "index", 0)
    log = str(tmp_path / "fake.jsonl")
    prof = make(log, gpu, warmup=2, flops="auto")

    def device_work(i: int) -> None:
        gpu.host(1.0 + 0.1 * i)
        gpu.alloc((i + 1) * 1024)
        gpu.launch(2.0 + 0.3 * (i % 4))
        gpu.sync()
        gpu.free((i + 1) * 1024)

    with prof:
        _train(prof, steps=12, on_step=device_work)
    summary = prof.summary
    assert summary.error_steps == 1 and summary.measured_steps == 9  # the counted step is measured...
    assert summary.gpu_ms is not None and summary.gpu_busy_median is not None
    assert summary.peak_allocated_bytes_max is not None and summary.syncs_per_step_median is not None
    assert summary.tflops_per_s_median is not None and summary.mfu_median is not None
    counted = [r for r in stepprof.read(log, kind="step") if r.get("flops_counted")]
    assert [r["step"] for r in counted] == [2]
    # ...but left out of every per-step figure: its times include FlopCounterMode's cost.
    timed = [r for r in stepprof.read(log, kind="step")
             if not r["warmup"] and r["error"] is None and not r.get("flops_counted")]
    assert summary.wall_ms == stepprof.Percentiles.of([r["wall_ms"] for r in timed])
    assert summary.phases["forward"].steps == len(timed)
    assert summary.phases["forward"].gpu_ms_median is not None
    _assert_shared_figures_equal(summary, _report_run(capsys, log), log)


@pytest.mark.parametrize("warmup", [0, 3])
def test_summary_fields_of_the_aggregate_rebuild_the_summary(tmp_path, warmup):
    """No figure of the Summary comes from anywhere but the aggregate (and the log path)."""
    from stepprof._aggregate import RunAggregate

    log = str(tmp_path / "run.jsonl")
    with stepprof.Profiler(log, warmup=warmup) as prof:
        _train(prof, steps=5)
    agg = RunAggregate()
    for record in stepprof.read(log):
        agg.add(record)
    assert stepprof.Summary(log=log, **agg.summary_fields()) == prof.summary
