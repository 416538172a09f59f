"""stepprof._report.render and the `stepprof report` command: the text, the JSON, the reasons."""

from __future__ import annotations

import json
import sys

import orjson
import pytest
import torch

import stepprof
from stepprof._report import build_report, render

from . import logfixtures as fx
from .report_helpers import cli, h200_log, report_dict  # noqa: F401 - h200_log is a fixture


def test_json_round_trips(capsys, h200_log):
    rc, out, _ = cli(capsys, "report", "--json", h200_log)
    assert rc == 0
    assert json.loads(out) == json.loads(orjson.dumps(report_dict([h200_log])))
    # and the text is rendered from the same report
    rc, text, _ = cli(capsys, "report", h200_log)
    assert rc == 0 and text == render(build_report([h200_log]))


def test_newer_schema_is_read_with_a_note(tmp_path):
    recs = [
        dict(fx.step_record(i, warmup=False, wall=5.0, gpu=5.0), schema_version=3, new_field=[1])
        for i in range(5)
    ]
    report = build_report([fx.write(str(tmp_path / "new.jsonl"), recs)])
    assert report.logs[0].newer_schema == 3
    assert "newer stepprof (schema 3)" in render(report)


def _cpu_log(tmp_path, device: str | None = "cpu") -> str:
    """A 4-step CPU log (1 warm-up step)."""
    log = str(tmp_path / "cpu.jsonl")
    with stepprof.Profiler(log, warmup=1, device=device) as prof:
        for _ in range(4):
            with prof.step(batch_size=8):
                torch.ones(8, 8).sum()
    return log


@pytest.mark.skipif(torch.cuda.is_available(), reason="the reasons a machine without CUDA gives")
def test_cpu_log_with_null_fields_names_the_reasons(tmp_path, capsys):
    log = _cpu_log(tmp_path, device=None)
    rc, out, _ = cli(capsys, "report", log)
    assert rc == 0
    assert "GPU ms                    n/a  (CUDA is not available)" in out
    run = report_dict([log])["logs"][0]["runs"][0]
    assert run["figures"]["gpu_ms"] is None and run["figures"]["wall_ms"] is not None
    assert run["memory"]["peak_allocated_bytes_max"] is None
    assert set(run["not_diagnosed"]) >= {"host-bound", "sync-heavy", "memory-headroom", "roofline"}


def test_cpu_log_reports_the_host_rss_its_reasons_point_to(tmp_path, capsys):
    log = _cpu_log(tmp_path)
    last = list(stepprof.read(log, kind="step"))[-1]["host_rss_bytes"]
    assert type(last) is int and last > 0
    run = report_dict([log])["logs"][0]["runs"][0]
    assert "see host_rss_bytes" in run["unavailable"]["peak_allocated_bytes"]
    assert run["memory"]["host_rss_bytes_last"] == last
    rc, out, _ = cli(capsys, "report", log)
    assert rc == 0 and "host RSS (last)" in out


@pytest.mark.parametrize("foreign", [
    {"schema_version": [1], "kind": "note"},                       # unhashable version
    {"schema_version": 1, "kind": "step", "wall_ms": 1.0, "device": ["cuda:0"]},
    {"schema_version": 1, "kind": "step", "wall_ms": 1.0, "name": {"a": 1}},
    {"schema_version": 1, "kind": "step", "wall_ms": 1.0, "rank": 0, "world_size": [2]},
    {"schema_version": 1, "kind": "sweep_result", "knee": "big", "recommended": "x"},
])
def test_a_foreign_record_with_odd_field_types_never_breaks_the_report(tmp_path, capsys, foreign):
    recs = fx.training_log(steps=20)
    recs.insert(10, foreign)
    path = fx.write(str(tmp_path / "odd.jsonl"), recs)
    rc, out, err = cli(capsys, "report", path)
    assert rc == 0 and "Traceback" not in err
    assert "-- run" not in out and ("20 steps" in out or "21 steps" in out)


def test_sweep_log_prints_the_table_and_recommendation(tmp_path, capsys):
    log = str(tmp_path / "sweep.jsonl")
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def train_step(x):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    result = stepprof.sweep(
        train_step,
        lambda n: torch.randn(n, 16),
        max_batch=16,
        restore=(model, opt),
        progress=False,
        min_time_s=0,
        log=log,
    )
    rc, out, _ = cli(capsys, "report", log)
    assert rc == 0
    assert f"recommended {result.recommended:,}" in out
    assert str(result).splitlines()[1] in out  # the table header
    sw = report_dict([log])["logs"][0]["sweeps"][0]
    assert sw["result"]["recommended"] == result.recommended
    assert [p["batch_size"] for p in sw["points"]] == [p.batch_size for p in result.points]


def test_missing_log_is_a_clear_error(capsys, tmp_path):
    rc, out, err = cli(capsys, "report", str(tmp_path / "nope.jsonl"))
    assert rc == 2 and "No such file" in err and "Traceback" not in err


def test_import_and_report_do_not_import_torch(tmp_path):
    """`import stepprof`, `stepprof.read` and `stepprof report` start without torch (seconds)."""
    log = fx.write(str(tmp_path / "t.jsonl"), fx.training_log(steps=30))
    code = (
        "import sys, stepprof\n"
        "assert 'torch' not in sys.modules, 'import stepprof imported torch'\n"
        f"assert len(list(stepprof.read({log!r}))) > 30\n"
        "from stepprof._cli import main\n"
        f"assert main(['report', {log!r}]) == 0\n"
        "assert 'torch' not in sys.modules, 'stepprof report imported torch'\n"
        "stepprof.profile_step\n"
        "assert 'torch' in sys.modules\n"
    )
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_gpu_coverage_counts_the_timed_steps_and_names_the_missing_ones_reason(tmp_path):
    """A FLOP-counted step (left out of the figures) is no step without GPU figures, and a
    timed step the CUDA events missed is named with its own reason, not ``overhead_budget``."""
    counted = [fx.step_record(i, warmup=i < 2, wall=7.0, gpu=7.0, flops=True, counted=i == 2) for i in range(8)]
    missed = fx.step_record(8, warmup=False, wall=7.0, gpu=None)
    missed["unavailable"] = {"gpu_ms": "no CUDA event was recorded at a boundary: the stream was capturing a CUDA graph"}
    full = render(build_report([fx.write(str(tmp_path / "full.jsonl"), counted)]))
    assert "6 measured, 5 timed" in full and "GPU figures on" not in full
    report = build_report([fx.write(str(tmp_path / "missed.jsonl"), [*counted, missed])])
    run = report.logs[0].runs[0]
    assert (run.measured_steps, run.timed_steps, run.gpu_steps) == (7, 6, 5)
    line = next(x for x in render(report).splitlines() if "GPU figures on" in x)
    assert line.split("GPU figures on")[1].strip() == f"5 of 6 timed steps ({missed['unavailable']['gpu_ms']})"


def test_the_summary_counts_its_timed_steps_and_states_gpu_coverage_against_them():
    """The summary carries ``timed_steps``; its text compares GPU coverage with them."""
    from stepprof._aggregate import RunAggregate
    from stepprof._records import Summary

    agg = RunAggregate(0)
    for i in range(8):
        agg.add_step(fx.step_record(i, warmup=i < 2, wall=7.0, gpu=7.0, flops=True, counted=i == 2))
    fields = agg.summary_fields()
    assert (fields["measured_steps"], fields["timed_steps"], fields["gpu_steps"]) == (6, 5, 5)
    assert "GPU figures on" not in str(Summary(log=None, **fields))
    agg.add_step(fx.step_record(8, warmup=False, wall=7.0, gpu=None))
    text = str(Summary(log=None, **agg.summary_fields()))
    assert "GPU figures on 5 of 6 timed steps" in text
    assert Summary(log=None, **agg.summary_fields()).to_record()["timed_steps"] == 6
