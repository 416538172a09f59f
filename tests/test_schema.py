"""The record schema: the builders match what the profiler writes, no column changes type
between kinds."""

from __future__ import annotations

import pytest
import torch

import stepprof
from stepprof._schema import (
    ABSENT,
    RECORD_KINDS,
    SCHEMA_VERSION,
    step_record,
    summary_record,
)

from .conftest import make


def _rebuilt(record):
    """``record`` built again through step_record from its own fields."""
    fields = {k: v for k, v in record.items() if k not in ("schema_version", "kind")}
    return step_record(**fields)


def _cpu_log(log, **kw):
    model = torch.nn.Linear(8, 4)
    with stepprof.Profiler(log, warmup=1, device="cpu", **kw) as prof:
        for _ in range(3):
            with prof.step(batch_size=8):
                with prof.measure("forward"):
                    loss = model(torch.randn(8, 8)).sum()
                with prof.measure("backward"):
                    loss.backward()
        stepprof.memory_report("cpu")   # a memory record, logged by the active profiler
    return log


def test_schema_version_is_2_and_public():
    assert SCHEMA_VERSION == stepprof.SCHEMA_VERSION == 2
    assert RECORD_KINDS == {"step", "summary", "memory", "flops", "peak", "ranks", "sweep_point", "sweep_result"}


def test_step_record_rebuilds_a_cpu_step_exactly_in_order(tmp_path):
    log = _cpu_log(str(tmp_path / "cpu.jsonl"), flops_per_step=1000)
    steps = list(stepprof.read(log, kind="step"))
    assert steps and all("host_rss_bytes" in r and "flops" in r for r in steps)
    for r in steps:
        again = _rebuilt(r)
        assert again == r and list(again) == list(r)


def test_step_record_rebuilds_a_gpu_step_with_syncs_allocator_and_ranks(tmp_path, gpu, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    gather = lambda vec: (lambda: [list(vec), list(vec)])  # noqa: E731 - rank 1 is rank 0's twin
    with make(str(tmp_path / "run.jsonl"), gpu, ranks_every=2, gather=gather) as prof:
        for _ in range(3):
            with prof.step(batch_size=4):
                with prof.measure("forward"):
                    gpu.launch(1.0)
        gpu.wait_idle()
    steps = list(stepprof.read(prof.log, kind="step"))
    assert steps and all(r["syncs"] is not None and r["rank"] == 0 for r in steps)
    for r in steps:
        again = _rebuilt(r)
        assert again == r and list(again) == list(r)


def test_step_record_leaves_absent_optional_fields_out():
    r = step_record(
        step=0, name="step", warmup=False, device="cpu", start_unix_s=1.0, wall_ms=1.0, gpu_ms=None,
        gpu_busy=None, peak_allocated_bytes=None, reserved_bytes=None, batch_size=None,
        samples_per_s=None, data_wait_ms=None, phases={}, overhead_us=1.0, error=None, syncs=None,
        allocator=None, unavailable={},
    )
    assert r["schema_version"] == SCHEMA_VERSION and r["kind"] == "step"
    assert not {"host_rss_bytes", "flops", "tflops_per_s", "mfu", "flops_counted", "rank"} & set(r)
    with_nulls = step_record(**{k: v for k, v in r.items() if k not in ("schema_version", "kind")},
                             host_rss_bytes=None, flops=None, tflops_per_s=None, mfu=None)
    assert list(with_nulls)[-4:] == ["host_rss_bytes", "flops", "tflops_per_s", "mfu"]
    assert repr(ABSENT) == "ABSENT"


def test_summary_record_renames_the_percentiles_and_their_reasons(log, gpu):
    prof = make(log, gpu, warmup=5)
    s = prof.close()
    rec = s.to_record()
    assert rec == summary_record(s) and rec["kind"] == "summary"
    assert "wall_ms" not in rec and "gpu_ms" not in rec
    assert rec["wall_ms_percentiles"] is None and rec["gpu_ms_percentiles"] is None
    assert "no measured steps" in rec["unavailable"]["wall_ms_percentiles"]
    assert "wall_ms" in s.unavailable and s.wall_ms is None      # the Python names stay


def _json_type(value):
    if value is None:
        return None
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


def test_no_column_changes_json_type_between_kinds(tmp_path, gpu, monkeypatch):
    """Every kind stepprof writes, from real runs: a column name means one JSON type."""
    records = list(stepprof.read(_cpu_log(str(tmp_path / "cpu.jsonl"), flops_per_step=1000)))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    gather = lambda vec: (lambda: [list(vec), list(vec)])  # noqa: E731
    from tests.peak_snapshots import FakeAllocator

    gpu.index, gpu.history = 0, FakeAllocator(t_us=None, gpu=gpu)
    net = torch.nn.Linear(2, 2)
    with make(str(tmp_path / "gpu.jsonl"), gpu, ranks_every=2, gather=gather, flops_per_step=10,
              explain_peak=True, model=net) as prof:
        for _ in range(4):
            with prof.step(batch_size=4):
                with prof.measure("forward"):
                    gpu.history.alloc(1000)
                    net(torch.ones(2))
                    gpu.launch(1.0)
        gpu.wait_idle()
    records += stepprof.read(prof.log)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    model = torch.nn.Linear(4, 2)
    stepprof.sweep(lambda x: model(x).sum().backward(), lambda n: torch.randn(n, 4), max_batch=4,
                   progress=False, min_time_s=0, log=str(tmp_path / "sweep.jsonl"))
    records += stepprof.read(str(tmp_path / "sweep.jsonl"))
    assert {r["kind"] for r in records} == RECORD_KINDS
    seen: dict[str, dict[str, str]] = {}
    for r in records:
        for key, value in r.items():
            t = _json_type(value)
            if t is not None:
                seen.setdefault(key, {}).setdefault(t, r["kind"])
    assert {k: v for k, v in seen.items() if len(v) > 1} == {}


def test_pandas_reads_step_wall_ms_as_float_beside_summary_and_memory(tmp_path):
    pd = pytest.importorskip("pandas")
    log = _cpu_log(str(tmp_path / "cpu.jsonl"))
    df = pd.read_json(log, lines=True)
    assert {"step", "memory", "summary"} <= set(df["kind"])
    assert df[lambda d: d.kind == "step"]["wall_ms"].dtype == "float64"
    assert df[lambda d: d.kind == "summary"]["wall_ms_percentiles"].notna().all()
