"""stepprof report / plot / env / calibrate on CPU, and Profiler(flops=...)."""

from __future__ import annotations

import json
import os
import random
import sys

import orjson
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stepprof
from stepprof import _cli
from stepprof._log import ScanStats, scan
from stepprof._recorder import flops as flops_hook
from stepprof._report import Dist, build_report, render
from stepprof._roofline import save_calibration

from . import logfixtures as fx
from .conftest import make


def cli(capsys, *argv):
    rc = _cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def h200_log(tmp_path):
    return fx.write(str(tmp_path / "h200.jsonl"), fx.training_log())


# -- report: figures and diagnoses ------------------------------------------------------


def test_report_of_a_realistic_log_gives_figures_and_diagnoses(capsys, h200_log):
    rc, out, err = cli(capsys, "report", h200_log)
    assert rc == 0 and err == ""
    assert "200 steps (3 warm-up, 0 failed, 197 measured)" in out
    assert "wall ms" in out and "GPU ms" in out and "samples/s" in out
    assert "nvidia-smi (NVML)         3.91 GiB" in out
    assert "train.py:42  item  loss.item()" in out
    rep = build_report([h200_log])
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
    # MFU from the calibration, not a datasheet: FLOPs at 720 TFLOP/s over the median step.
    assert roof["mfu"] == pytest.approx(fx.FLOPS / 720e12 * 1e3 / run["figures"]["step_ms"]["median"])
    assert 0 < run["figures"]["mfu_median"] < 1
    assert run["not_diagnosed"]["host-bound"].startswith("ruled out")
    # The counted step (slower under FlopCounterMode) is left out of the figures.
    assert run["flops_counted_step"] == 3
    assert run["measured_steps"] == 197 and len(build_report([h200_log])["logs"]) == 1
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
    run = build_report([fx.write(str(tmp_path / "fp8.jsonl"), recs)])["logs"][0]["runs"][0]
    roof = run["roofline"]
    assert roof["compute_ms"] is None and roof["memory_ms"] is not None
    assert roof["class"] is None and roof["explained"] is None and "fp8" in roof["reason"]
    assert "roofline" not in [d["kind"] for d in run["diagnoses"]]
    assert "fp8" in run["not_diagnosed"]["roofline"]


def test_json_round_trips(capsys, h200_log):
    rc, out, _ = cli(capsys, "report", "--json", h200_log)
    assert rc == 0
    assert json.loads(out) == json.loads(orjson.dumps(build_report([h200_log])))
    # and the text is rendered from the same dict
    assert render(json.loads(out)) == render(build_report([h200_log]))


def test_host_bound_from_low_gpu_busy(tmp_path):
    recs = [fx.step_record(i, warmup=i < 2, wall=2.4, gpu=1.2, syncs=True) for i in range(50)]
    for r in recs:
        r["syncs"]["count"] = 0
        r["syncs"]["sites"] = []
    run = build_report([fx.write(str(tmp_path / "h.jsonl"), recs)])["logs"][0]["runs"][0]
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
    rep = build_report([path])
    run = rep["logs"][0]["runs"][0]
    assert run["measured_steps"] == 18 and run["syncs"] is None and run["allocator"] is None
    assert "older stepprof" in run["unavailable"]["syncs_per_step"]
    assert "sync-heavy" in run["not_diagnosed"] and "roofline" in run["not_diagnosed"]
    assert "flops='auto'" in run["not_diagnosed"]["roofline"]
    assert "syncs/step" in render(rep)


def test_newer_schema_is_read_with_a_note(tmp_path):
    recs = [
        dict(fx.step_record(i, warmup=False, wall=5.0, gpu=5.0), schema_version=2, new_field=[1])
        for i in range(5)
    ]
    rep = build_report([fx.write(str(tmp_path / "new.jsonl"), recs)])
    assert rep["logs"][0]["newer_schema"] == 2
    assert "newer stepprof (schema 2)" in render(rep)


def _cpu_log(tmp_path) -> str:
    """A 4-step CPU log (1 warm-up step)."""
    log = str(tmp_path / "cpu.jsonl")
    with stepprof.Profiler(log, warmup=1) as prof:
        for _ in range(4):
            with prof.step(batch_size=8):
                torch.ones(8, 8).sum()
    return log


def test_cpu_log_with_null_fields_names_the_reasons(tmp_path, capsys):
    log = _cpu_log(tmp_path)
    rc, out, _ = cli(capsys, "report", log)
    assert rc == 0
    assert "GPU ms                    n/a  (CUDA is not available)" in out
    run = build_report([log])["logs"][0]["runs"][0]
    assert run["figures"]["gpu_ms"] is None and run["figures"]["wall_ms"] is not None
    assert run["memory"]["peak_allocated_bytes_max"] is None
    assert set(run["not_diagnosed"]) >= {"host-bound", "sync-heavy", "memory-headroom", "roofline"}


def test_cpu_log_reports_the_host_rss_its_reasons_point_to(tmp_path, capsys):
    log = _cpu_log(tmp_path)
    last = list(stepprof.read(log, kind="step"))[-1]["host_rss_bytes"]
    assert type(last) is int and last > 0
    run = build_report([log])["logs"][0]["runs"][0]
    assert "see host_rss_bytes" in run["unavailable"]["peak_allocated_bytes"]
    assert run["memory"]["host_rss_bytes_last"] == last
    rc, out, _ = cli(capsys, "report", log)
    assert rc == 0 and "host RSS (last)" in out


def _headroom(tmp_path, **last_memory):
    recs = fx.training_log(steps=30)
    close = next(r for r in reversed(recs) if r["kind"] == "memory")
    close.update(last_memory)
    run = build_report([fx.write(str(tmp_path / "m.jsonl"), recs)])["logs"][0]["runs"][0]
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
    rep = build_report([fx.write(str(tmp_path / "w.jsonl"), recs)])
    run = rep["logs"][0]["runs"][0]
    why = "no measured steps (all were warm-up, failed, or none ran)"
    assert run["memory"]["peak_allocated_bytes_max"] is None
    assert run["unavailable"]["peak_allocated_bytes"] == why
    assert run["unavailable"]["overhead_us_median"] == why
    text = render(rep)
    assert f"peak allocated            n/a  ({why})" in text
    assert f"stepprof µs/step          n/a  ({why})" in text


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


def test_corrupt_and_truncated_lines_are_skipped_with_a_count(tmp_path, capsys):
    path = fx.write(
        str(tmp_path / "torn.jsonl"),
        fx.training_log(steps=30),
        [b"\xff\xfe garbage\n", b"[1, 2]\n", b"\n", b'{"schema_version": 1, "kind": "st'],
    )
    rc, out, _ = cli(capsys, "report", path)
    assert rc == 0
    assert "skipped 3 line(s)" in out
    assert build_report([path])["logs"][0]["skipped_lines"] == 3


def test_several_runs_in_one_log_and_several_logs(tmp_path, capsys):
    log = str(tmp_path / "two.jsonl")
    for _ in range(2):
        with stepprof.Profiler(log) as prof:
            for _ in range(3):
                with prof.step():
                    pass
    other = fx.write(str(tmp_path / "h.jsonl"), fx.training_log(steps=20))
    rep = build_report([log, other])
    assert [len(x["runs"]) for x in rep["logs"]] == [2, 1]
    rc, out, _ = cli(capsys, "report", log, other)
    assert rc == 0 and "-- run 2" in out and out.count("== ") == 2


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
    sw = build_report([log])["logs"][0]["sweeps"][0]
    assert sw["result"]["recommended"] == result.recommended
    assert [p["batch_size"] for p in sw["points"]] == [p.batch_size for p in result.points]


def test_missing_log_is_a_clear_error(capsys, tmp_path):
    rc, out, err = cli(capsys, "report", str(tmp_path / "nope.jsonl"))
    assert rc == 2 and "No such file" in err and "Traceback" not in err


# -- the reader and the quantiles -----------------------------------------------------


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(
    st.lists(
        st.one_of(
            st.binary(max_size=40),
            st.from_regex(
                rb'\{"kind": "(step|memory|summary|flops|sweep_point)"[^\n]{0,30}\}', fullmatch=True
            ),
        ),
        max_size=30,
    )
)
def test_reader_never_raises_on_any_bytes(tmp_path, lines):
    path = tmp_path / "fuzz.jsonl"
    path.write_bytes(b"\n".join(line.replace(b"\n", b" ") for line in lines))
    stats = ScanStats()
    records = list(scan(path, stats))
    assert all(isinstance(r, dict) for r in records)
    assert len(records) + stats.skipped <= stats.lines
    build_report([str(path)])  # never raises either


_json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(
    st.lists(
        st.fixed_dictionaries(
            {
                "kind": st.sampled_from(
                    ["step", "memory", "summary", "flops", "sweep_point", "sweep_result", "x"]
                )
            },
            optional={
                k: _json_value
                for k in (
                    "step",
                    "wall_ms",
                    "gpu_ms",
                    "warmup",
                    "syncs",
                    "phases",
                    "allocator",
                    "batch_size",
                    "peak_allocated_bytes",
                    "flops_by_dtype",
                    "calibration",
                    "unavailable",
                    "error",
                    "thrash_zone",
                    "notes",
                    "tflops_per_s",
                    "schema_version",
                    "device",
                    "name",
                    "rank",
                    "world_size",
                    "knee",
                    "recommended",
                )
            },
        ),
        max_size=12,
    )
)
def test_report_survives_records_with_any_field_types(tmp_path, records):
    path = tmp_path / "typed.jsonl"
    path.write_bytes(
        b"".join(orjson.dumps(r, option=orjson.OPT_NON_STR_KEYS) + b"\n" for r in records if _dumpable(r))
    )
    rep = build_report([str(path)])
    render(rep)
    orjson.dumps(rep, option=orjson.OPT_NON_STR_KEYS)


def _dumpable(r):
    try:
        orjson.dumps(r)
        return True
    except TypeError:
        return False


def test_dist_is_exact_below_its_buffer_and_close_beyond():
    rng = random.Random(1)
    xs = [rng.lognormvariate(0, 1) for _ in range(1000)]
    d = Dist()
    for x in xs:
        d.add(x)
    d.settle()
    assert d.exact
    assert d.quantile(0.5) == stepprof.Percentiles.of(xs).median
    big = [rng.random() for _ in range(300_000)]
    d = Dist()
    for i, x in enumerate(big):
        d.add(x)
        if i % 4096 == 0:
            d.settle()
    d.settle()
    assert not d.exact and d.count == len(big)
    s = sorted(big)
    for q in (0.1, 0.5, 0.9):
        v = d.quantile(q)
        rank = sum(1 for x in s if x <= v) / len(s)
        assert abs(rank - q) < 0.002
    assert d.max() == max(big)
    assert abs(d.count_above(0.9) - sum(1 for x in big if x > 0.9)) < 0.002 * len(big)
    # bounded: what it holds does not grow with the stream
    assert len(d.buf) + sum(len(level) for level in d.levels) < 4 * Dist.EXACT


# -- plot ---------------------------------------------------------------------------


def test_plot_without_matplotlib_prints_a_one_line_hint(monkeypatch, capsys, h200_log, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    rc, out, err = cli(capsys, "plot", h200_log, "-o", str(tmp_path / "x.png"))
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "pip install 'stepprof[plot]'" in err


def test_plot_step_and_sweep_logs(capsys, h200_log, tmp_path):
    pytest.importorskip("matplotlib")
    out_png = str(tmp_path / "steps.png")
    rc, out, err = cli(capsys, "plot", h200_log, "-o", out_png)
    assert rc == 0, err
    with open(out_png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    big = fx.write(str(tmp_path / "big.jsonl"), fx.training_log(steps=9000, spikes=(50, 4000, 8000)))
    assert cli(capsys, "plot", big, "-o", str(tmp_path / "big.png"))[0] == 0
    log = str(tmp_path / "sweep.jsonl")
    model = torch.nn.Linear(16, 4)
    stepprof.sweep(
        lambda x: model(x).sum().backward(),
        lambda n: torch.randn(n, 16),
        max_batch=16,
        restore=(model,),
        progress=False,
        min_time_s=0,
        log=log,
    )
    assert cli(capsys, "plot", log, "-o", str(tmp_path / "sweep.png"))[0] == 0
    assert os.path.getsize(tmp_path / "sweep.png") > 10_000


def test_plot_sweep_of_a_log_without_a_sweep_says_so(capsys, h200_log, tmp_path):
    """The log has steps: the error must not say it has none, and must say how to plot them."""
    pytest.importorskip("matplotlib")
    rc, out, err = cli(capsys, "plot", h200_log, "--sweep", "-o", str(tmp_path / "x.png"))
    assert rc == 2 and "Traceback" not in err
    assert "no sweep records" in err and "no step" not in err and "without --sweep" in err
    assert not os.path.exists(tmp_path / "x.png")


def test_plot_to_a_path_without_extension_writes_the_path_it_names(capsys, h200_log, tmp_path):
    pytest.importorskip("matplotlib")
    out_path = str(tmp_path / "steps")
    rc, out, err = cli(capsys, "plot", h200_log, "-o", out_path)
    assert rc == 0, err
    assert out == f"stepprof: wrote {out_path}\n"
    with open(out_path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_to_a_format_matplotlib_cannot_write_is_a_clear_error(capsys, h200_log, tmp_path):
    pytest.importorskip("matplotlib")
    out_path = str(tmp_path / "steps.pgn")
    rc, out, err = cli(capsys, "plot", h200_log, "-o", out_path)
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "-o" in err and repr(out_path) in err and ".png" in err
    assert not os.path.exists(out_path)


# -- env and calibrate on a CPU -------------------------------------------------------


def test_env_prints_and_json(capsys):
    rc, out, _ = cli(capsys, "env")
    assert rc == 0
    for key in (
        "torch",
        "PYTORCH_CUDA_ALLOC_CONF",
        "expandable segments",
        "NVML status",
        "sync detection",
        "calibration cache",
    ):
        assert key in out
    rc, out, _ = cli(capsys, "env", "--json")
    env = json.loads(out)
    assert env["torch"] == torch.__version__ and env["syncs"]["default"] == "warn"


def test_env_shows_a_calibration_figure_it_lacks_as_na_never_0(monkeypatch, tmp_path, capsys):
    from stepprof import _cuda

    monkeypatch.setenv("STEPPROF_CACHE_DIR", str(tmp_path / "cache"))
    save_calibration({"device_name": "NVIDIA H200", "matmul_tflops": {"bf16": 700.0, "fp32": None}})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(_cuda, "device_facts", lambda i: {
        "name": "NVIDIA H200", "capability": "9.0", "total_memory_bytes": 140 * 2**30, "multiprocessors": 132})
    rc, out, err = cli(capsys, "env")
    assert rc == 0 and "Traceback" not in err, err
    line = next(x for x in out.splitlines() if x.strip().startswith("calibration ") and "bf16" in x)
    assert "bf16 700 TFLOP/s" in line and "fp32 n/a" in line
    assert "copy n/a" in line and "n/a µs/op" in line and " 0 GB/s" not in line


def test_env_reads_the_allocator_config(monkeypatch, capsys):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    env = json.loads(cli(capsys, "env", "--json")[1])
    assert env["allocator"]["expandable_segments"] is True


def test_calibrate_without_cuda_is_a_clear_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    rc, out, err = cli(capsys, "calibrate")
    assert rc == 2 and "CUDA is not available" in err and "Traceback" not in err


def test_module_entry_point_runs_report(h200_log):
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-m", "stepprof", "report", "--json", h200_log],
        capture_output=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["logs"][0]["runs"][0]["measured_steps"] == 197


# -- Profiler(flops=...) ------------------------------------------------------------


def _mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    return model, torch.optim.AdamW(model.parameters())


EXPECTED = 2 * 32 * 64 * 128 * 2 + 2 * 32 * 128 * 8 * 3  # fwd+weight grads of both, input grad of the second


def test_flops_auto_counts_one_step_on_the_cpu(log):
    model, opt = _mlp()
    with stepprof.Profiler(log, warmup=2, flops="auto") as prof:
        for _ in range(5):
            with prof.step(batch_size=32):
                model(torch.randn(32, 64)).square().mean().backward()
                opt.step()
                opt.zero_grad()
        assert prof._flops.retired  # off the step boundaries after the count
    recs = list(stepprof.read(log))
    flops = [r for r in recs if r["kind"] == "flops"]
    assert len(flops) == 1 and flops[0]["flops_per_step"] == EXPECTED
    assert flops[0]["flops_by_dtype"] == {"fp32": EXPECTED} and flops[0]["step"] == 2 and flops[0]["ops"] > 0
    steps = [r for r in recs if r["kind"] == "step"]
    assert [r["flops"] for r in steps] == [None, None, EXPECTED, EXPECTED, EXPECTED]
    assert [r.get("flops_counted") for r in steps] == [None, None, True, None, None]
    assert all(r["mfu"] is None and "CPU" in r["unavailable"]["mfu"] for r in steps[2:])
    assert steps[3]["tflops_per_s"] == pytest.approx(EXPECTED / (steps[3]["wall_ms"] * 1e-3) / 1e12)
    assert prof.summary.tflops_per_s_median is not None and prof.summary.mfu_median is None
    assert recs.index(flops[0]) == recs.index(steps[2]) + 1


def test_no_flops_requested_leaves_records_and_boundaries_alone(log):
    with stepprof.Profiler(log) as prof:
        assert prof._flops is None and prof._boundaries._begin_hooks == ()
        with prof.step():
            pass
    rec = next(stepprof.read(log, kind="step"))
    assert "flops" not in rec and "mfu" not in rec
    assert "not requested" in prof.summary.unavailable["mfu_median"]


def test_flops_arguments_are_checked():
    with pytest.raises(stepprof.ConfigError, match="'flops' must be 'auto' or None"):
        stepprof.Profiler(None, flops="yes")
    with pytest.raises(stepprof.ConfigError, match="'flops_per_step' must be a positive"):
        stepprof.Profiler(None, flops_per_step=-1)
    with pytest.raises(stepprof.ConfigError, match="not both"):
        stepprof.Profiler(None, flops="auto", flops_per_step=10)


def test_mfu_uses_the_cached_calibration(log, gpu, monkeypatch, tmp_path):
    monkeypatch.setenv("STEPPROF_CACHE_DIR", str(tmp_path / "cache"))
    save_calibration({k: v for k, v in fx.CALIBRATION.items() if k != "calibration_version"})
    monkeypatch.setattr(flops_hook, "device_name", lambda index: "NVIDIA H200")
    gpu.index = 0
    model, opt = _mlp()
    with make(log, gpu, warmup=1, flops="auto") as prof:
        for _ in range(4):
            with prof.step(batch_size=32):
                gpu.launch(2.0)
                model(torch.randn(32, 64)).square().mean().backward()
                gpu.host(1.0)
    steps = list(stepprof.read(log, kind="step"))
    ideal = EXPECTED / 52e12 * 1e3  # fp32 matmuls at float32 precision "highest": the fp32 rate
    for r in steps[2:]:
        assert r["mfu"] == pytest.approx(ideal / max(r["wall_ms"], r["gpu_ms"]))
    flops = next(stepprof.read(log, kind="flops"))
    assert flops["calibration"]["matmul_tflops"]["fp32"] == 52.0 and flops["ideal_ms"] == pytest.approx(ideal)


def test_flops_given_by_the_user(log, gpu, monkeypatch, tmp_path):
    monkeypatch.setenv("STEPPROF_CACHE_DIR", str(tmp_path / "cache"))
    with make(log, gpu, flops_per_step=1e12) as prof:
        with prof.step():
            gpu.launch(5.0)
            gpu.host(1.0)
    rec = next(stepprof.read(log, kind="step"))
    assert rec["flops"] == 1e12 and rec["tflops_per_s"] == pytest.approx(1e12 / 5e-3 / 1e12, rel=0.05)
    assert rec["mfu"] is None and "calibration" in rec["unavailable"]["mfu"]


def test_a_failing_counted_step_is_counted_again(log):
    model, opt = _mlp()
    with stepprof.Profiler(log, flops="auto") as prof:
        with pytest.raises(ValueError):
            with prof.step():
                model(torch.randn(32, 64)).sum()
                raise ValueError("boom")
        with prof.step():
            model(torch.randn(32, 64)).square().mean().backward()
    flops = next(stepprof.read(log, kind="flops"))
    assert flops["step"] == 1 and flops["flops_per_step"] == EXPECTED


def test_flops_auto_keeps_torch_compile_compiled(log):
    model, _ = _mlp()
    compiles, runs = [], []

    def backend(gm, example_inputs):
        compiles.append(1)

        def run(*args):
            runs.append(1)
            return gm.forward(*args)

        return run

    compiled = torch.compile(model, backend=backend)
    x = torch.randn(32, 64)
    with stepprof.Profiler(log, warmup=1, flops="auto") as prof:
        for _ in range(4):
            with prof.step():
                compiled(x).sum()
    assert len(compiles) == 1
    assert len(runs) == 3  # warm-up, then the two steps after the eagerly counted one
    assert next(stepprof.read(log, kind="flops"))["flops_per_step"] == 2 * 32 * 64 * 128 + 2 * 32 * 128 * 8


@pytest.fixture
def fp32_precision():
    """Restores torch's TF32 flags of the API added in torch 2.9 after a test sets them."""
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip("this torch has no fp32_precision flags")
    flags = [torch.backends, torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.cudnn.rnn]
    saved = [f.fp32_precision for f in flags]
    yield
    for f, value in zip(flags, saved, strict=True):
        f.fp32_precision = value


def test_flops_auto_reads_torchs_fp32_precision_api_and_never_breaks_the_step(log, fp32_precision):
    # torch >= 2.9's way to allow TF32; torch.get_float32_matmul_precision() and
    # torch.backends.cudnn.allow_tf32 raise RuntimeError once it is used.
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    torch.backends.cudnn.conv.fp32_precision = "ieee"
    model, _ = _mlp()
    conv = torch.nn.Conv2d(3, 4, 3)
    with stepprof.Profiler(log, warmup=0, flops="auto") as prof:
        with prof.step():
            model(torch.randn(32, 64)).square().mean().backward()
            conv(torch.randn(1, 3, 8, 8))
    flops = next(stepprof.read(log, kind="flops"))
    assert flops["flops_by_dtype"] == {"tf32": EXPECTED, "fp32": 2 * 4 * 6 * 6 * 3 * 3 * 3}
    assert next(stepprof.read(log, kind="step"))["error"] is None


def test_an_error_in_the_counter_is_a_reason_and_the_step_goes_on(log, monkeypatch):
    from stepprof import _roofline

    def broken(dtype, conv):
        raise RuntimeError("no dtype")

    monkeypatch.setattr(_roofline, "_dtype_key", broken)
    model, _ = _mlp()
    with stepprof.Profiler(log, warmup=0, flops="auto") as prof:
        with prof.step():
            model(torch.randn(32, 64)).sum()
    assert prof._flops.retired
    flops = next(stepprof.read(log, kind="flops"))
    assert flops["flops_per_step"] is None and "no dtype" in flops["unavailable"]["flops_per_step"]
    assert next(stepprof.read(log, kind="step"))["error"] is None


def test_a_step_that_ran_under_the_counter_is_flagged_although_the_count_failed(log, monkeypatch):
    from stepprof import _roofline

    stop = _roofline.FlopCount.stop

    def stop_then_fail(self):
        stop(self)
        raise RuntimeError("left uncleanly")

    monkeypatch.setattr(_roofline.FlopCount, "stop", stop_then_fail)
    model, _ = _mlp()
    with stepprof.Profiler(log, warmup=1, flops="auto") as prof:
        for _ in range(3):
            with prof.step():
                model(torch.randn(32, 64)).sum()
    steps = list(stepprof.read(log, kind="step"))
    # Step 1 ran eagerly under FlopCounterMode: its times include the counter's cost.
    assert [r.get("flops_counted") for r in steps] == [None, True, None]
    assert "left uncleanly" in steps[1]["unavailable"]["flops"]


def _without_paths(rep):
    return orjson.loads(orjson.dumps(rep))


@pytest.mark.parametrize("workers", [2, 3, 7, 16])
def test_reading_in_parallel_byte_ranges_gives_the_same_report(tmp_path, workers):
    """A large log is read as byte ranges in parallel and stitched: the report is the same.

    The log has three runs: one closed by its summary, one a crashed run with no summary
    whose successor restarts the step index, and a last one; plus a torn line, an unknown
    kind and a sweep.  Every split point must land somewhere different relative to them.
    """
    from stepprof import _report

    records = fx.training_log(steps=150, seed=1)
    crashed = [r for r in fx.training_log(steps=90, seed=2) if r["kind"] != "summary"]
    records += crashed + fx.training_log(steps=120, seed=3, spikes=(40,))
    records.insert(200, {"schema_version": 1, "kind": "from_the_future", "x": 1})
    records += [
        {"schema_version": 1, "kind": "sweep_point", "batch_size": 2 ** i, "oom": False,
         "samples_per_s": 100.0 * 2 ** i, "step_ms": 10.0, "peak_allocated_bytes": 2 ** (20 + i)}
        for i in range(5)
    ]
    log = fx.write(str(tmp_path / "big.jsonl"), records, extra_lines=[b'{"kind": "step", "tor'])
    one = _report.report_log(log, workers=1)
    many = _report.report_log(log, workers=workers)
    for rep in (one, many):
        rep.pop("_sweep_objects")
    assert len(one["runs"]) == 3
    assert one["skipped_lines"] == 1 and one["other_kinds"] == {"from_the_future": 1}
    assert _without_paths(many) == _without_paths(one)


def test_dist_merge_matches_one_stream():
    from stepprof._report import Dist

    rng = random.Random(0)
    xs = [rng.lognormvariate(0, 1) for _ in range(3 * Dist.EXACT + 123)]
    whole, a, b = Dist(), Dist(), Dist()
    for i, x in enumerate(xs):
        whole.add(x)
        (a if i < len(xs) // 3 else b).add(x)
        if i % 4096 == 0:
            for d in (whole, a, b):
                d.settle()
    a.merge(b)
    assert a.count == whole.count == len(xs)
    exact = sorted(xs)
    for q in (0.1, 0.5, 0.9):
        true = exact[int(q * (len(xs) - 1))]
        rank = sum(1 for x in exact if x <= a.quantile(q)) / len(xs)
        assert abs(rank - q) < 0.002, (q, true, a.quantile(q))


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
