"""Hostile logs: numbers that would size the report's work, and terminal escapes in its text."""

from __future__ import annotations

import time
import tracemalloc

from stepprof._report import build_report, render

from . import logfixtures as fx

MiB = 2**20


def _rank_log(path, rank, world, steps=20):
    recs = fx.training_log(steps=steps, flops=False)
    for r in recs:
        r.update(rank=rank, local_rank=rank, world_size=world)
    return fx.write(str(path), recs)


def _report_cost(paths):
    """(seconds, tracemalloc peak bytes, rendered text) of building and rendering the report."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        report = build_report(paths)
        text = render(report)
        took = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return took, peak, report, text


def test_a_huge_world_size_reports_the_missing_ranks_as_a_count_in_bounded_time_and_memory(tmp_path):
    logs = [_rank_log(tmp_path / "r3.jsonl", 3, 100_000_000_000), _rank_log(tmp_path / "r7.jsonl", 7, 100_000_000_000)]
    took, peak, report, text = _report_cost(logs)
    assert took < 1.0 and peak < 4 * MiB, (took, peak)
    (note,) = report.distributed.notes
    assert "99,999,999,998 rank(s)" in note and "0, 1, 2, 4, 5, 6, 8" in note
    assert "were not given" in text


def test_a_few_missing_ranks_are_all_named(tmp_path):
    logs = [_rank_log(tmp_path / "r1.jsonl", 1, 4)]
    report = build_report(logs)
    assert report.distributed.notes == ("logs of rank(s) 0, 2, 3 were not given",)


def test_ranks_outside_the_world_do_not_count_as_given(tmp_path):
    logs = [_rank_log(tmp_path / "a.jsonl", 0, 2), _rank_log(tmp_path / "b.jsonl", 5, 2)]
    assert build_report(logs).distributed.notes == ("logs of rank(s) 1 were not given",)
