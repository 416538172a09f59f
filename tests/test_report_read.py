"""stepprof._report.read: logs into runs, torn lines, any field types, the parallel read."""

from __future__ import annotations

import os

import attrs
import orjson
import pytest

import stepprof
from stepprof._report.build import report_log

from . import logfixtures as fx
from .report_helpers import cli, report_dict


def test_corrupt_and_truncated_lines_are_skipped_with_a_count(tmp_path, capsys):
    path = fx.write(
        str(tmp_path / "torn.jsonl"),
        fx.training_log(steps=30),
        [b"\xff\xfe garbage\n", b"[1, 2]\n", b"\n", b'{"schema_version": 1, "kind": "st'],
    )
    rc, out, _ = cli(capsys, "report", path)
    assert rc == 0
    assert "skipped 3 line(s)" in out
    assert report_dict([path])["logs"][0]["skipped_lines"] == 3


def test_several_runs_in_one_log_and_several_logs(tmp_path, capsys):
    log = str(tmp_path / "two.jsonl")
    for _ in range(2):
        with stepprof.Profiler(log) as prof:
            for _ in range(3):
                with prof.step():
                    pass
    other = fx.write(str(tmp_path / "h.jsonl"), fx.training_log(steps=20))
    rep = report_dict([log, other])
    assert [len(x["runs"]) for x in rep["logs"]] == [2, 1]
    rc, out, _ = cli(capsys, "report", log, other)
    assert rc == 0 and "-- run 2" in out and out.count("== ") == 2


def _dumpable(r):
    try:
        orjson.dumps(r)
        return True
    except TypeError:
        return False


def _without_paths(rep):
    return orjson.loads(orjson.dumps(rep, option=orjson.OPT_NON_STR_KEYS))


@pytest.mark.parametrize("workers", [2, 3, 7, 16])
def test_reading_in_parallel_byte_ranges_gives_the_same_report(tmp_path, workers):
    """A large log is read as byte ranges in parallel and stitched: the report is the same.

    The log has three runs: one closed by its summary, one a crashed run with no summary
    whose successor restarts the step index, and a last one; plus a torn line, an unknown
    kind and a sweep.  Every split point must land somewhere different relative to them.
    """
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
    one = attrs.asdict(report_log(log, workers=1))
    many = attrs.asdict(report_log(log, workers=workers))
    assert len(one["runs"]) == 3
    assert one["skipped_lines"] == 1 and one["other_kinds"] == {"from_the_future": 1}
    assert _without_paths(many) == _without_paths(one)


def _multi_run_log(path, steps=(150, 90, 120)):
    """Three runs: closed by its summary, crashed (no summary; the next restarts the index), last."""
    records = fx.training_log(steps=steps[0], seed=1)
    records += [r for r in fx.training_log(steps=steps[1], seed=2) if r["kind"] != "summary"]
    records += fx.training_log(steps=steps[2], seed=3, spikes=(40,))
    return fx.write(str(path), records)


@pytest.mark.parametrize("workers", [2, 3, 5])
def test_a_multi_run_log_over_the_parallel_threshold_gives_the_serial_report(tmp_path, monkeypatch, workers):
    """`stepprof report` reads a log of PARALLEL_BYTES or more in parallel: the report is the same."""
    from stepprof._report import read

    log = _multi_run_log(tmp_path / "multi.jsonl")
    serial = report_dict([log])
    monkeypatch.setattr(read, "PARALLEL_BYTES", 1)
    monkeypatch.setattr(read.os, "cpu_count", lambda: workers)
    parallel = report_dict([log])
    assert len(serial["logs"][0]["runs"]) == 3
    assert _without_paths(parallel) == _without_paths(serial)


def test_a_parallel_read_merges_sketches_compacted_to_different_depths(tmp_path, monkeypatch):
    """The first byte range holds a few steps of the second run, the next one thousands:
    their sketches compacted to different depths, which merging once failed on (IndexError)."""
    from stepprof._report import read
    from stepprof._stats import QuantileSketch

    monkeypatch.setattr(QuantileSketch, "EXACT", 64)  # compact early: a small log is enough
    log = _multi_run_log(tmp_path / "deep.jsonl", steps=(9000, 9500, 50))
    serial = report_dict([log])["logs"][0]
    monkeypatch.setattr(read, "PARALLEL_BYTES", 1)
    monkeypatch.setattr(read.os, "cpu_count", lambda: 2)
    parallel = report_dict([log])["logs"][0]
    assert [r["measured_steps"] for r in parallel["runs"]] == [r["measured_steps"] for r in serial["runs"]]
    for one, other in zip(serial["runs"], parallel["runs"], strict=True):
        assert other["approximate_quantiles"] == one["approximate_quantiles"]
        wall, wall_parallel = one["figures"]["wall_ms"], other["figures"]["wall_ms"]
        for q in ("p10", "median", "p90"):
            assert wall_parallel[q] == pytest.approx(wall[q], rel=0.01)
    assert serial["runs"][1]["approximate_quantiles"]


@pytest.mark.parametrize("workers", [1, 2, 5])
def test_a_log_of_very_many_runs_keeps_the_last_ones_and_counts_the_rest(tmp_path, monkeypatch, workers, capsys):
    """Each run costs the report about 13 KB, so a log of many one-line runs would need far more
    memory than its size: the report keeps the last RUNS_KEPT runs and says how many came before."""
    from stepprof._report import read as read_module

    monkeypatch.setattr(read_module, "RUNS_KEPT", 50)
    recs = []
    for i in range(400):  # runs without an id (index restarts) and with one, alternating
        rec = {"schema_version": 2, "kind": "step", "step": 0, "wall_ms": float(i + 1)}
        if i % 2:
            rec["run_id"] = f"{i:012x}"
        recs.append(rec)
    log = str(tmp_path / "many.jsonl")
    with open(log, "w") as f:
        f.writelines(orjson.dumps(r).decode() + "\n" for r in recs)
    rep = report_log(log, workers=workers)
    assert rep.runs_dropped == 350 and len(rep.runs) == 50
    assert [r.run for r in rep.runs] == list(range(350, 400))
    assert [r.steps for r in rep.runs] == [1] * 50
    rc, out, _ = cli(capsys, "report", log)
    assert rc == 0 and "350 earlier run(s) not shown: the report keeps a log's last 50 runs" in out


def test_the_reports_memory_stays_bounded_on_a_log_of_100k_one_line_runs(tmp_path):
    """The issue's case: 100,000 one-line runs (a 5.8 MB log) took 1.3 GB; now the kept runs bound it."""
    import resource
    import subprocess
    import sys

    log = str(tmp_path / "runs.jsonl")
    with open(log, "w") as f:
        f.writelines('{"schema_version":2,"kind":"step","step":0,"wall_ms":1.0}\n' for _ in range(100_000))
    code = (
        "import resource, sys; from stepprof._report.build import report_log; "
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; "
        f"rep = report_log({log!r}, workers=1); "
        "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; "
        "print(rep.runs_dropped, len(rep.runs), (after - before) // 1024)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    dropped, kept, grown_mib = map(int, out)
    assert (dropped, kept) == (99_000, 1000)
    assert grown_mib < 100, grown_mib  # was 1.3 GB


def test_rank_logs_read_side_by_side_give_the_serial_report(tmp_path, monkeypatch):
    """Several logs (a rank's each), each under PARALLEL_BYTES and more than it together: read
    side by side, a process a core; the report is the serial one, the cross-rank section too."""
    from stepprof._report import read

    paths = []
    for rank in range(3):
        records = fx.training_log(steps=60 + 20 * rank, seed=rank, spikes=(30,) if rank == 1 else ())
        for r in records:
            r.update(rank=rank, local_rank=rank, world_size=3)
        paths.append(fx.write(str(tmp_path / f"rank{rank}.jsonl"), records))
    serial = report_dict(paths)
    sizes = [os.path.getsize(p) for p in paths]
    monkeypatch.setattr(read, "PARALLEL_BYTES", max(sizes) + 1)
    monkeypatch.setattr(read.os, "cpu_count", lambda: 2)
    pools = []
    real = read.forked_pool
    monkeypatch.setattr(read, "forked_pool", lambda n: pools.append(n) or real(n))
    side_by_side = report_dict(paths)
    assert pools == [2]
    assert [len(log["runs"]) for log in serial["logs"]] == [1, 1, 1] and serial["distributed"] is not None
    assert _without_paths(side_by_side) == _without_paths(serial)
    assert [log["path"] for log in side_by_side["logs"]] == paths
