"""stepprof.frame: a log as a DataFrame with the right dtypes."""

from __future__ import annotations

import sys

import pytest
import torch

import stepprof
from stepprof._errors import MissingExtraError

from . import logfixtures as fx
from .conftest import make

pd = pytest.importorskip("pandas")


def _gpu_log(log, gpu, steps=3, **kw):
    with make(log, gpu, warmup=1, **kw) as prof:
        for _ in range(steps):
            with prof.step(batch_size=4):
                with prof.measure("forward"):
                    gpu.launch(1.0)
                with prof.measure("backward"):
                    gpu.launch(2.0)
        gpu.wait_idle()
    return prof.log


def test_step_frame_has_the_figures_dtypes_and_phase_columns(log, gpu):
    df = stepprof.frame(_gpu_log(log, gpu))
    assert len(df) == 3 and df["step"].tolist() == [0, 1, 2]
    assert df["step"].dtype == "int64" and df["batch_size"].dtype == "int64"
    assert df["wall_ms"].dtype == "float64" and df["gpu_ms"].dtype == "float64"
    assert df["warmup"].dtype == "bool" and df["warmup"].tolist() == [True, False, False]
    for name in ("forward", "backward"):
        for field in ("wall_ms", "gpu_ms", "peak_allocated_bytes", "count", "syncs"):
            assert f"phase.{name}.{field}" in df
    assert df["phase.forward.gpu_ms"].dtype == "float64"
    assert df["phase.backward.gpu_ms"].tolist() == pytest.approx([2.0, 2.0, 2.0])
    assert df["syncs"].tolist() == [0, 0, 0]                   # the count, not the dict
    assert "allocator.num_device_alloc" in df and "allocator" not in df
    assert df["unavailable"].map(type).eq(dict).all()          # kept whole
    assert df["log"].tolist() == [log] * 3 and df.columns[0] == "log"


def test_a_cpu_step_frame_has_nan_gpu_ms_and_nullable_ints(tmp_path):
    log = str(tmp_path / "cpu.jsonl")
    with stepprof.Profiler(log, device="cpu") as prof:   # the host, also where CUDA is up
        for _ in range(2):
            with prof.step():
                with prof.measure("forward"):
                    torch.ones(4).sum()
    df = stepprof.frame(log)
    assert df["step"].dtype == "int64" and df["wall_ms"].dtype == "float64"
    assert df["gpu_ms"].dtype == "float64" and df["gpu_ms"].isna().all()
    assert df["peak_allocated_bytes"].dtype == "Int64" and df["peak_allocated_bytes"].isna().all()
    assert df["batch_size"].dtype == "Int64" and df["host_rss_bytes"].dtype == "int64"
    assert df["phase.forward.gpu_ms"].dtype == "float64"


def test_nulls_in_an_int_column_make_it_nullable(tmp_path):
    recs = [fx.step_record(i, warmup=False, wall=5.0, gpu=5.0) for i in range(3)]
    recs[1]["peak_allocated_bytes"] = None
    recs[2]["gpu_ms"] = None
    df = stepprof.frame(fx.write(str(tmp_path / "n.jsonl"), recs))
    peak = df["peak_allocated_bytes"]
    assert peak.dtype == "Int64" and peak.isna().tolist() == [False, True, False]
    assert df["gpu_ms"].dtype == "float64" and df["gpu_ms"].isna().tolist() == [False, False, True]


def test_other_kinds_give_flat_frames(log, gpu):
    _gpu_log(log, gpu)
    summary = stepprof.frame(log, kind="summary")
    assert len(summary) == 1 and summary["steps"].dtype == "int64"
    assert summary["wall_ms_percentiles.median"].dtype == "float64"
    assert summary["gpu_ms_percentiles.p90"].dtype == "float64"
    memory = stepprof.frame(log, kind="memory")
    assert memory["trigger"].tolist() == ["after_warmup", "close"]
    assert memory["step"].dtype == "int64" and memory["reserved_bytes"].dtype == "int64"
    assert stepprof.frame(log, kind="sweep_point").empty


def test_several_logs_are_one_frame_with_their_rank(tmp_path, gpu, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    paths = []
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        paths.append(_gpu_log(str(tmp_path / "run.jsonl"), gpu, ranks_every=0))
    assert paths == [str(tmp_path / "run.rank0.jsonl"), str(tmp_path / "run.rank1.jsonl")]
    df = stepprof.frame(paths)
    assert df["rank"].tolist() == [0, 0, 0, 1, 1, 1] and df["rank"].dtype == "int64"
    assert df["log"].tolist() == [paths[0]] * 3 + [paths[1]] * 3
    assert df["step"].dtype == "int64"


@pytest.mark.parametrize("bad", [None, 3, b"run.jsonl", [], ["a.jsonl", None]])
def test_a_log_that_is_not_a_path_is_named(bad):
    match = r"'log' must be the path of a stepprof log.*\(got .*\); e\.g\. stepprof\.frame\('run\.jsonl'\)"
    with pytest.raises(stepprof.ConfigError, match=match):
        stepprof.frame(bad)


@pytest.mark.parametrize("bad", ["steps", 3, None])
def test_an_unknown_kind_is_named(tmp_path, bad):
    match = rf"'kind' must be a record kind, one of 'flops'.*\(got {bad!r}\); e\.g\. stepprof\.frame\(log, kind='step'\)"
    with pytest.raises(stepprof.ConfigError, match=match):
        stepprof.frame(tmp_path / "x.jsonl", kind=bad)


def test_without_pandas_the_error_gives_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(MissingExtraError, match=r"needs pandas.*pip install 'stepprof\[frame\]'"):
        stepprof.frame(tmp_path / "x.jsonl")


def test_steps_that_each_bring_new_phase_names_are_framed_linearly_in_bounded_columns(tmp_path):
    import time

    from stepprof._frame import COLUMNS_KEPT

    from . import readerlogs

    log = readerlogs.write_lines(str(tmp_path / "p.jsonl"), readerlogs.changing_phases(2000, names=50))
    t0 = time.process_time()
    with pytest.warns(stepprof.StepprofWarning, match=r"left out 100,000\+ field\(s\) first seen after the first 1,024"):
        df = stepprof.frame(log)
    took = time.process_time() - t0
    assert df.shape == (2000, COLUMNS_KEPT) and took < 15, (df.shape, took)
    assert df["phase.p0.0.wall_ms"][0] == 0.1 and pd.isna(df["phase.p0.0.wall_ms"][1])
    assert df["step"].dtype == "int64" and df["wall_ms"].tolist() == [7.0] * 2000


def test_an_int_past_int64_in_a_float_field_makes_a_float_column(tmp_path):
    recs = [dict(fx.step_record(i, warmup=False, wall=5.0, gpu=5.0), flops=2**64 - 1) for i in range(2)]
    df = stepprof.frame(fx.write(str(tmp_path / "f.jsonl"), recs))
    assert str(df["flops"].dtype) == "float64" and df["flops"][0] == float(2**64 - 1)


def test_dtypes_come_from_the_declaration_whatever_the_values():
    """A column's dtype is its field's declared type (stepprof/_fields.py), also where every
    value is null or an integral float: no name says what a field is."""
    from stepprof._fields import BOOL, FLOAT, INT, RECORDS, STR, MapOf, Obj, Scalar
    from stepprof._frame import _column, _declared

    want = {FLOAT: ("float64", "float64"), INT: ("int64", "Int64"), BOOL: ("bool", "boolean"), STR: ("object", "object")}
    sample = {FLOAT: 3, INT: 4, BOOL: True, STR: "x"}  # FLOAT given an int: still float64

    def columns(t, prefix):
        for f in t.fields:
            name = f"{prefix}{f.name}"
            if type(f.type) is Scalar:
                yield name, f.type
            elif type(f.type) is Obj:
                yield from columns(f.type, name + ".")
            elif type(f.type) is MapOf and type(f.type.value) is Obj:
                yield from columns(f.type.value, name + ".somekey.")

    seen = 0
    for kind, record in RECORDS.items():
        for name, scalar in columns(Obj(record.fields), ""):
            if kind == "step" and name.startswith("phases."):
                name = "phase." + name[len("phases."):]
            assert _declared(kind, name) is scalar, (kind, name)
            full, with_nulls = want[scalar]
            assert str(_column(pd, _declared(kind, name), [sample[scalar]] * 2).dtype) == full, (kind, name)
            assert str(_column(pd, _declared(kind, name), [sample[scalar], None]).dtype) == with_nulls, (kind, name)
            assert str(_column(pd, _declared(kind, name), [None, None]).dtype) == with_nulls, (kind, name)
            seen += 1
    assert seen > 150
    assert _declared("step", "syncs") is INT and _declared("step", "log") is STR
    assert _declared("step", "a_newer_field") is None
    assert str(_column(pd, None, [1, 2.5]).dtype) == "float64" and str(_column(pd, None, [None]).dtype) == "object"


def test_a_phase_name_with_dots_keeps_its_figures_dtypes(tmp_path):
    from stepprof._fields import FLOAT, INT
    from stepprof._frame import _declared

    assert _declared("step", "phase.layer.1.wall_ms") is FLOAT
    assert _declared("step", "phase.a.b.c.count") is INT
    assert _declared("summary", "phases.block.0.wall_ms_median") is FLOAT
    assert _declared("step", "phase.layer.1.not_a_field") is None
    log = str(tmp_path / "dots.jsonl")
    with stepprof.Profiler(log, device="cpu") as prof:
        for _ in range(2):
            with prof.step():
                with prof.measure("layer.1"):
                    pass
    df = stepprof.frame(log)
    assert str(df["phase.layer.1.wall_ms"].dtype) == "float64"
    assert str(df["phase.layer.1.gpu_ms"].dtype) == "float64" and df["phase.layer.1.gpu_ms"].isna().all()
