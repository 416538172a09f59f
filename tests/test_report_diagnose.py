"""stepprof._report.diagnose: each diagnosis, its evidence and remedies, on hand-written logs."""

from __future__ import annotations

import pytest

from stepprof._report import build_report, render

from . import logfixtures as fx
from .report_helpers import cli, h200_log, report_dict  # noqa: F401 - h200_log is a fixture


def test_report_of_a_realistic_log_gives_figures_and_diagnoses(capsys, h200_log):
    rc, out, err = cli(capsys, "report", h200_log)
    assert rc == 0 and err == ""
    assert "200 steps (3 warm-up, 0 failed, 197 measured, 196 timed)" in out  # one FLOPs-counted
    assert "wall ms" in out and "GPU ms" in out and "samples/s" in out
    assert "nvidia-smi (NVML)         3.91 GiB" in out
    assert "train.py:42  item  loss.item()" in out
    rep = report_dict([h200_log])
    run = rep["logs"][0]["runs"][0]
    kinds = [d["kind"] for d in run["diagnoses"]]
    assert kinds == ["sync-heavy", "memory-headroom", "spikes", "roofline"]
    sync = run["diagnoses"][0]
    assert any("train.py:42" in e for e in sync["evidence"])
    spikes = run["diagnoses"][2]
    assert [s["step"] for s in run["spikes"]["early"]] == [5]
    assert [s["step"] for s in run["spikes"]["late"]] == [120]
    assert any("warmup" in r for r in spikes["remedy"])
    roof = run["roofline"]
    assert roof["class"] == "compute-bound"
    # The compute bound from the calibration, not a datasheet: FLOPs at 720 TFLOP/s.
    assert roof["compute_ms"] == pytest.approx(fx.FLOPS / 720e12 * 1e3)
    # One MFU (a decision of the redesign): the median of the steps' own mfu, which the
    # roofline's evidence quotes; the roofline no longer computes a second one.
    assert 0 < run["figures"]["mfu_median"] < 1 and "mfu" not in roof
    mfu_line = f"MFU {run['figures']['mfu_median']:.1%} of this GPU's calibrated"
    assert any(e.startswith(mfu_line) for e in run["diagnoses"][3]["evidence"])
    assert run["not_diagnosed"]["host-bound"].startswith("ruled out")
    # The counted step (slower under FlopCounterMode) is left out of the figures.
    assert run["flops_counted_step"] == 3
    assert run["measured_steps"] == 197 and len(report_dict([h200_log])["logs"]) == 1
    phases = {p["name"]: p for p in run["phases"]}
    assert phases["optimizer"]["peak_allocated_bytes_max"] == int(2.6 * fx.GIB)
    assert phases["optimizer"]["syncs_per_step"] == 1


def test_roofline_names_no_class_without_the_compute_bound(tmp_path):
    # fp8 FLOPs have no calibrated rate: the compute bound is unknown, so the largest known
    # bound (memory here) cannot name the class of a step that may well be compute-bound.
    recs = fx.training_log()
    for r in recs:
        if r["kind"] == "flops":
            r["flops_by_dtype"] = {"fp8": fx.FLOPS}
    run = report_dict([fx.write(str(tmp_path / "fp8.jsonl"), recs)])["logs"][0]["runs"][0]
    roof = run["roofline"]
    assert roof["compute_ms"] is None and roof["memory_ms"] is not None
    assert roof["class"] is None and roof["explained"] is None and "fp8" in roof["reason"]
    assert "roofline" not in [d["kind"] for d in run["diagnoses"]]
    assert "fp8" in run["not_diagnosed"]["roofline"]


def test_host_bound_from_low_gpu_busy(tmp_path):
    recs = [fx.step_record(i, warmup=i < 2, wall=2.4, gpu=1.2, syncs=True) for i in range(50)]
    for r in recs:
        r["syncs"]["count"] = 0
        r["syncs"]["sites"] = []
    run = report_dict([fx.write(str(tmp_path / "h.jsonl"), recs)])["logs"][0]["runs"][0]
    host = [d for d in run["diagnoses"] if d["kind"] == "host-bound"]
    assert host and "gpu_busy 0.50" in host[0]["evidence"][0]
    assert any("reduce-overhead" in r for r in host[0]["remedy"])
    assert "sync-heavy" not in [d["kind"] for d in run["diagnoses"]]


def test_older_schema_log_without_later_fields(tmp_path):
    """A log from before syncs, allocator and flops existed (and lines without schema_version)."""
    recs = [
        fx.step_record(i, warmup=i < 2, wall=7.0, gpu=7.1, syncs=False, schema=None if i % 2 else 1)
        for i in range(20)
    ]
    recs.append({"schema_version": 1, "kind": "summary", "steps": 20})
    path = fx.write(str(tmp_path / "old.jsonl"), recs)
    report = build_report([path])
    run = report.to_dict()["logs"][0]["runs"][0]
    assert run["measured_steps"] == 18 and run["syncs"] is None and run["allocator"] is None
    assert "older stepprof" in run["unavailable"]["syncs_per_step"]
    assert "sync-heavy" in run["not_diagnosed"] and "roofline" in run["not_diagnosed"]
    assert "flops='auto'" in run["not_diagnosed"]["roofline"]
    assert "syncs/step" in render(report)


def _headroom(tmp_path, **last_memory):
    recs = fx.training_log(steps=30)
    close = next(r for r in reversed(recs) if r["kind"] == "memory")
    close.update(last_memory)
    run = report_dict([fx.write(str(tmp_path / "m.jsonl"), recs)])["logs"][0]["runs"][0]
    (d,) = [d for d in run["diagnoses"] if d["kind"] == "memory-headroom"]
    return run, d["evidence"]


def test_headroom_never_takes_an_unknown_residual_for_zero(tmp_path):
    why = "reading torch's allocator statistics failed: RuntimeError: boom"
    run, ev = _headroom(tmp_path, residual_bytes=None, allocated_bytes=None,
                        unavailable={"residual_bytes": why, "allocated_bytes": why})
    assert run["memory"]["residual_bytes"] is None
    assert not any("0.0 MiB CUDA context" in e for e in ev), ev
    assert "CUDA context and other unknown" in ev[0]


def test_headroom_takes_a_negative_residual_as_about_zero(tmp_path):
    _, ev = _headroom(tmp_path, residual_bytes=-100 * 2**20)
    total = fx.memory_record(0, "close")["total_bytes"]
    assert f"of {total / 2**30:.2f} GiB usable" in ev[0] and "-100.0 MiB" not in ev[0], ev[0]


def test_a_run_without_measured_steps_gives_every_null_figure_its_reason(tmp_path):
    recs = [fx.step_record(i, warmup=True, wall=5.0, gpu=5.0) for i in range(3)]
    report = build_report([fx.write(str(tmp_path / "w.jsonl"), recs)])
    run = report.to_dict()["logs"][0]["runs"][0]
    why = "no measured steps (all were warm-up, failed, or none ran)"
    assert run["memory"]["peak_allocated_bytes_max"] is None
    assert run["unavailable"]["peak_allocated_bytes"] == why
    assert run["unavailable"]["overhead_us_median"] == why
    text = render(report)
    rows = [line for line in text.splitlines() if "n/a" in line and line.startswith("   ") and "  " in line.strip()]
    assert rows[0].endswith(f"n/a  ({why})")  # given in full once, then "as above" below it
    assert "peak allocated            n/a  (as above)" in text
    assert f"stepprof µs/step (mean)   n/a  ({why})" in text  # after the FLOPs rows: in full again
    assert run["unavailable"]["overhead_us_mean"] == why
