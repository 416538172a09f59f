"""run_id: one per Profiler (and per sweep() call) on every record it writes; the report
and the plot group a log's records by it, so writers appending to one path at once stay
apart, and logs without it are split as before."""

from __future__ import annotations

import multiprocessing
import random
import re
import time
import tracemalloc

import attrs
import orjson
import pytest

import stepprof
from stepprof._report import read
from stepprof._report.build import report_log
from stepprof._report.read import OPEN_RUNS_KEPT, RunGrouper, Segment
from stepprof._report.sweeps import logged_sweeps
from stepprof._sanitise import STR_MAX

from . import logfixtures as fx
from .conftest import make
from .report_helpers import cli, report_dict

STEPS = 5000  # per process


def _append_steps(log: str, steps: int, barrier, ids) -> None:
    """A child process: a CPU profiler appending ``steps`` steps to ``log``, started with the other.

    Each step sleeps 0.2 ms, so the two overlap for about a second: about 50 harvests each.
    """
    import torch

    x = torch.ones(256)
    barrier.wait()
    with stepprof.Profiler(log, device="cpu") as prof:
        for _ in range(steps):
            with prof.step(batch_size=256):
                x.sum()
                time.sleep(0.0002)
    ids.put(prof.summary.run_id)


@pytest.fixture(scope="module")
def shared_log(tmp_path_factory):
    """Two processes, each with its own Profiler, appending 5,000 steps to one path at once."""
    log = str(tmp_path_factory.mktemp("shared") / "shared.jsonl")
    ctx = multiprocessing.get_context("spawn")
    barrier, ids = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_append_steps, args=(log, STEPS, barrier, ids)) for _ in range(2)]
    for p in procs:
        p.start()
    got = {ids.get(timeout=120) for _ in procs}
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return log, got


def _without_paths(rep):
    return orjson.loads(orjson.dumps(rep, option=orjson.OPT_NON_STR_KEYS))


def test_two_processes_appending_to_one_log_are_two_runs(shared_log, capsys):
    log, ids = shared_log
    records = list(stepprof.read(log))
    order = [r["run_id"] for r in records]
    switches = sum(a != b for a, b in zip(order, order[1:]))
    assert switches >= 10, "the two writers hardly interleaved: the test proves little"
    assert set(order) == ids and len(ids) == 2
    rc, out, _ = cli(capsys, "report", "--json", log)
    assert rc == 0
    runs = orjson.loads(out)["logs"][0]["runs"]
    first_seen = list(dict.fromkeys(order))
    assert [r["run_id"] for r in runs] == first_seen
    assert [r["steps"] for r in runs] == [STEPS, STEPS]
    assert [(r["first_step"], r["last_step"]) for r in runs] == [(0, STEPS - 1)] * 2
    assert all(r["summary_found"] for r in runs)
    rc, out, _ = cli(capsys, "report", log)
    assert rc == 0 and "did not close" not in out and "-- run 2 [" in out and "-- run 3" not in out


def test_without_run_ids_the_same_log_splits_into_bogus_runs(shared_log, tmp_path):
    """The issue's symptom, which the ids fix: the index rule alone cannot tell the writers apart."""
    log, _ = shared_log
    records = [{k: v for k, v in r.items() if k != "run_id"} for r in stepprof.read(log)]
    stripped = fx.write(str(tmp_path / "stripped.jsonl"), records)
    runs = report_dict([stripped])["logs"][0]["runs"]
    assert [r["steps"] for r in runs] != [STEPS, STEPS]
    assert not all(r["summary_found"] for r in runs)


@pytest.mark.parametrize("workers", range(1, 17))
def test_the_shared_log_read_in_parallel_gives_the_same_runs(shared_log, workers):
    log, _ = shared_log
    serial = attrs.asdict(report_log(log, workers=1))
    parallel = attrs.asdict(report_log(log, workers=workers))
    assert [r["steps"] for r in serial["runs"]] == [STEPS, STEPS]
    assert _without_paths(parallel) == _without_paths(serial)


def test_stepprof_report_reads_the_shared_log_in_parallel_past_the_threshold(shared_log, monkeypatch):
    log, _ = shared_log
    serial = report_dict([log])
    monkeypatch.setattr(read, "PARALLEL_BYTES", 1)
    monkeypatch.setattr(read.os, "cpu_count", lambda: 5)
    assert _without_paths(report_dict([log])) == _without_paths(serial)


# -- a hand-made log: ids and no ids interleaved, at every split point ---------------------------


def _with_id(records, run_id):
    for r in records:
        r["run_id"] = run_id
    return records


def _labelled(label, records):
    return [(label, r) for r in records]


def _mixed_log(path):
    """Writers interleaved in chunks; returns the log and its runs (run_id, steps, summary
    found) in the order of their first records.

    ``a``: closed by its summary.  ``b``: no summary (crashed).  Records without an id: a
    0.1.0 run, closed, then one that crashed, then one whose index restarts (the old rules).
    ``c``: the same crashed run twice (a log copied onto itself): its index restarts, so two
    runs.  ``d``: closed, then its id written again (two runs).
    """
    rng = random.Random(7)
    crashed = [r for r in fx.training_log(steps=90, seed=6) if r["kind"] != "summary"]
    runs = {  # label -> (run_id, steps, summary found, records)
        "a": ("a" * 12, 300, True, fx.training_log(steps=300, seed=1)),
        "b": ("b" * 12, 250, False, [r for r in fx.training_log(steps=250, seed=2) if r["kind"] != "summary"]),
        "l1": (None, 120, True, fx.training_log(steps=120, seed=3)),
        "l2": (None, 80, False, [r for r in fx.training_log(steps=80, seed=4) if r["kind"] != "summary"]),
        "l3": (None, 60, True, fx.training_log(steps=60, seed=5)),
        "c1": ("c" * 12, 90, False, crashed),
        "c2": ("c" * 12, 90, False, [dict(r) for r in crashed]),
        "d1": ("d" * 12, 70, True, fx.training_log(steps=70, seed=8)),
        "d2": ("d" * 12, 40, True, fx.training_log(steps=40, seed=9)),
    }
    streams = []
    for labels in (["a"], ["b"], ["l1", "l2", "l3"], ["c1", "c2"], ["d1", "d2"]):
        stream = []
        for label in labels:
            rid, _, _, records = runs[label]
            stream += _labelled(label, _with_id(records, rid) if rid else records)
        streams.append(stream)
    out, first_seen = [], []
    while any(streams):
        s = rng.choice([s for s in streams if s])
        for _ in range(min(len(s), rng.randint(1, 60))):
            label, r = s.pop(0)
            if label not in first_seen:
                first_seen.append(label)
            out.append(r)
    fx.write(str(path), out, extra_lines=[b'{"kind": "step", "run_id": "a'])
    return str(path), [runs[label][:3] for label in first_seen]


def test_runs_are_grouped_by_id_and_records_without_one_by_the_old_rules(tmp_path):
    log, expected = _mixed_log(tmp_path / "mixed.jsonl")
    runs = report_log(log, workers=1).runs
    assert [(r.run_id, r.steps, r.summary_found) for r in runs] == expected
    assert [r.run for r in runs] == list(range(9)) and {r.first_step for r in runs} == {0}
    assert sum(r.run_id is None for r in runs) == 3


@pytest.mark.parametrize("workers", [2, 3, 4, 5, 7, 11, 16])
def test_the_mixed_log_read_in_byte_ranges_gives_the_serial_runs(tmp_path, workers):
    log, expected = _mixed_log(tmp_path / "mixed.jsonl")
    serial = attrs.asdict(report_log(log, workers=1))
    parallel = attrs.asdict(report_log(log, workers=workers))
    assert len(serial["runs"]) == len(expected)
    assert _without_paths(parallel) == _without_paths(serial)


def test_a_summary_at_the_start_of_a_byte_range_closes_the_run_it_belongs_to(tmp_path):
    """Every cut of a small two-writer log, one per line start: the same runs."""
    a = _with_id(fx.training_log(steps=6, seed=1, flops=False), "a" * 12)
    b = _with_id(fx.training_log(steps=5, seed=2, flops=False), "b" * 12)
    recs = [x for pair in zip(a, b) for x in pair] + a[len(b):]
    log = fx.write(str(tmp_path / "small.jsonl"), recs)
    data = open(log, "rb").read()
    starts = [0] + [i + 1 for i, c in enumerate(data) if c == 10][:-1]
    whole = Segment().read(log)
    want = [(r.run_id, r.steps, r.summary is not None) for r in whole.runs]
    assert want == [("a" * 12, 6, True), ("b" * 12, 5, True)]
    for cut in starts[1:]:
        seg = Segment().read(log, 0, cut)
        seg.stitch(Segment().read(log, cut, len(data)))
        assert [(r.run_id, r.steps, r.summary is not None) for r in seg.runs] == want, cut


def test_a_run_that_goes_on_after_a_signals_summary_is_one_run_with_the_later_summary(tmp_path):
    """SIGTERM's summary, then the user's handler lets training go on: the later steps and
    the summary written at close belong to the same run, read whole or cut anywhere."""
    recs = _with_id(fx.training_log(steps=6, seed=1, flops=False), "a" * 12)
    summary = next(r for r in recs if r["kind"] == "summary")
    steps = [r for r in recs if r["kind"] == "step"]
    early = {**summary, "steps": 3, "ended_by": "SIGTERM"}
    final = {**summary, "ended_by": "SIGTERM"}
    other = _with_id(fx.training_log(steps=4, seed=2, flops=False), "b" * 12)
    log = fx.write(str(tmp_path / "signal.jsonl"), steps[:3] + [early] + other + steps[3:] + [final])
    data = open(log, "rb").read()
    starts = [0] + [i + 1 for i, c in enumerate(data) if c == 10][:-1]
    for cut in starts:
        seg = Segment().read(log, 0, cut or None)
        if cut:
            seg.stitch(Segment().read(log, cut, len(data)))
        got = [(r.run_id, r.steps, (r.summary or {}).get("steps")) for r in seg.runs]
        assert got == [("a" * 12, 6, summary["steps"]), ("b" * 12, 4, 4)], cut


# -- every record a profiler writes ---------------------------------------------------------------


def test_every_record_kind_a_profiler_writes_carries_its_run_id(tmp_path, monkeypatch, nvml, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    gpu = nvml.gpu
    gather = lambda vec: (lambda: [list(vec), list(vec)])  # noqa: E731 - rank 1 is rank 0's twin
    log = str(tmp_path / "run.jsonl")
    with make(log, gpu, warmup=1, ranks_every=2, gather=gather, flops_per_step=1e9, memory_every=2) as prof:
        for _ in range(6):
            with prof.step(batch_size=4):
                with prof.measure("forward"):
                    gpu.launch(1.0)
        stepprof.memory_report()
        gpu.wait_idle()
    rid = prof.summary.run_id
    assert re.fullmatch("[0-9a-f]{12}", rid)
    records = list(stepprof.read(prof.log))
    assert {r["kind"] for r in records} == {"step", "memory", "flops", "ranks", "summary"}
    assert {r["run_id"] for r in records} == {rid}
    for r in records:  # after the record's own fields, before the rank fields the writer adds
        keys = list(r)
        assert keys.index("run_id") < keys.index("rank") == len(keys) - (3 if r["kind"] != "ranks" else 2)
    assert prof.summary.to_record()["run_id"] == rid
    run = report_dict([prof.log])["logs"][0]["runs"][0]
    assert run["run_id"] == rid
    rc, out, _ = cli(capsys, "report", prof.log)
    assert rc == 0 and f"-- [{rid}] " in out


def test_each_profiler_has_its_own_id_and_one_without_a_log_has_one_too(tmp_path):
    log = str(tmp_path / "two.jsonl")
    summaries = []
    for _ in range(2):
        with stepprof.Profiler(log, device="cpu") as prof:
            with prof.step():
                pass
        summaries.append(prof.summary)
    with stepprof.Profiler(None, device="cpu") as quiet:
        with quiet.step():
            pass
    ids = [s.run_id for s in summaries] + [quiet.summary.run_id]
    assert len(set(ids)) == 3 and all(re.fullmatch("[0-9a-f]{12}", i) for i in ids)
    assert [r["run_id"] for r in report_dict([log])["logs"][0]["runs"]] == ids[:2]


# -- untrusted ids ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [5, 1.5, True, [1, "a"], {"a": 1}, None, 2**63 - 1])
def test_a_run_id_that_is_not_a_str_counts_as_none(tmp_path, bad):
    recs = fx.training_log(steps=40, seed=1)
    for r in recs[::2]:
        r["run_id"] = bad
    log = fx.write(str(tmp_path / "bad.jsonl"), recs)
    (run,) = report_log(log).runs
    assert run.run_id is None and run.steps == 40 and run.summary_found


def test_a_huge_run_id_is_cut_to_the_string_cap_in_json_and_shorter_in_the_text(tmp_path, capsys):
    huge = "\x1b[2J" + "x" * 200_000
    log = fx.write(str(tmp_path / "huge.jsonl"), _with_id(fx.training_log(steps=20), huge))
    (run,) = report_dict([log])["logs"][0]["runs"]
    assert run["run_id"] == huge[: STR_MAX - 1] + "…" and run["steps"] == 20
    rc, out, _ = cli(capsys, "report", log)
    head = next(line for line in out.splitlines() if line.startswith("-- "))
    assert rc == 0 and head.startswith("-- [\\x1b[2Jxxx") and "…]" in head and len(head) < 200


def test_distinct_ids_past_the_cap_stay_bounded_and_linear():
    """100,000 ids, each once, then 2 x OPEN_RUNS_KEPT ids in turn (each record evicts one)."""
    made = [0]

    def new_run(rid):
        made[0] += 1
        return "run"

    def records(n, ids):
        for i in range(n):
            yield {"kind": "step", "step": i, "run_id": f"{i % ids:012x}"}

    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        grouper = RunGrouper(new_run)
        run_of = grouper.run_of
        for r in records(100_000, 100_000):
            run_of("step", r)
        assert len(grouper.open) == OPEN_RUNS_KEPT and made[0] == 100_000
        for r in records(100_000, 2 * OPEN_RUNS_KEPT):
            run_of("step", r)
        assert len(grouper.open) == OPEN_RUNS_KEPT and made[0] == 200_000  # evicted: each a new run
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 30  # linear: a few seconds under tracemalloc on a loaded machine
    assert peak < 2**20  # the open table (OPEN_RUNS_KEPT ids), not the 200,000 seen


def test_a_log_of_many_distinct_ids_reports_each_as_a_run(tmp_path, monkeypatch):
    recs = [{"schema_version": 2, "kind": "step", "step": 0, "wall_ms": 1.0, "run_id": f"{i:012x}"}
            for i in range(3000)]
    log = fx.write(str(tmp_path / "many.jsonl"), recs)
    monkeypatch.setattr(read, "OPEN_RUNS_KEPT", 100)
    monkeypatch.setattr(read, "RUNS_KEPT", 5000)  # every run kept (tests/test_report_read.py tests the cap)
    serial = report_log(log, workers=1)
    assert len(serial.runs) == 3000 and {r.run_id for r in serial.runs} == {r["run_id"] for r in recs}
    parallel = report_log(log, workers=4)
    assert [r.run_id for r in parallel.runs] == [r.run_id for r in serial.runs]


def test_sweeps_are_grouped_by_their_id(tmp_path):
    def sweep(rid, sizes):
        pts = [{"kind": "sweep_point", "trial": i + 1, "phase": "grow", "batch_size": n, "oom": False,
                "samples_per_s": 10.0 * n, "step_ms": 1.0, "run_id": rid} for i, n in enumerate(sizes)]
        return pts, {"kind": "sweep_result", "knee": sizes[-1], "run_id": rid, "stopped": "max_batch"}

    (p1, r1), (p2, r2) = sweep("s1", [1, 2, 4]), sweep("s2", [8, 16])
    interleaved = [p1[0], p2[0], p1[1], p2[1], r2, p1[2], r1]
    sweeps = logged_sweeps(interleaved)
    assert [[p.batch_size for p in s.points] for s in sweeps] == [[8, 16], [1, 2, 4]]
    assert [s.result_record["run_id"] for s in sweeps] == ["s2", "s1"]
    many = logged_sweeps(
        {"kind": "sweep_point", "batch_size": 1, "oom": False, "run_id": str(i)} for i in range(5000)
    )
    assert len(many) == 5000 and all(s.result is None for s in many)


def test_stepprof_plot_groups_the_shared_log_as_the_report_does(shared_log):
    from stepprof._plot import _read

    log, _ = shared_log
    runs, sweeps, stats = _read(log)
    assert [len(r.step) for r in runs] == [STEPS, STEPS] and not sweeps and stats.skipped == 0
    assert all(list(r.step) == [float(i) for i in range(STEPS)] for r in runs)
