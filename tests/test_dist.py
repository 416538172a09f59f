"""Distributed runs: rank fields, per-rank logs, the exchange and the straggler rule.

The pure rule and the exchange are driven in-process (a fake gather, the fake device);
two spawned gloo jobs (2 and 4 processes) check the whole path end to end.
"""

from __future__ import annotations

import math
import os
import time

import pytest
import torch.multiprocessing as mp

import stepprof
from stepprof import _dist
from stepprof._report import build_report, render

from . import dist_workers
from .conftest import make

NAN = float("nan")


# -- the rule --------------------------------------------------------------------------


def test_a_rank_with_a_longer_step_is_named_on_the_step():
    found = _dist.find_straggler([10.0, 10.2, 14.0, 9.9], [("gap", [0.1] * 4)])
    assert (found.rank, found.basis) == (2, "step")
    assert found.excess_ms == pytest.approx(14.0 - 10.1)


def test_lockstep_two_ranks_the_earliest_segment_names_the_cause():
    # Rank 1 spends 6 ms more in forward; rank 0 waits those 6 ms in backward's allreduce.
    # Both steps are 20 ms: the step alone cannot tell.
    found = _dist.find_straggler(
        [20.0, 20.0], [("gap", [0.2, 0.2]), ("forward", [5.0, 11.0]), ("backward", [14.0, 8.0])]
    )
    assert (found.rank, found.basis) == (1, "forward")
    assert found.excess_ms == pytest.approx(3.0)  # over the median (the mean of two)


def test_lockstep_a_slow_gap_is_named_on_the_gap():
    found = _dist.find_straggler(
        [20.0] * 4, [("gap", [0.1, 6.1, 0.1, 0.1]), ("forward", [5.0] * 4), ("backward", [14, 8, 14, 14])]
    )
    assert (found.rank, found.basis) == (1, "gap")


def test_waiting_longest_in_a_collective_is_not_straggling():
    # Rank 3 reached backward's allreduce 4 ms early (faster forward) and waited there:
    # its backward excess is compensated by its earlier deficit.
    found = _dist.find_straggler(
        [20.0] * 4, [("gap", [0.1] * 4), ("forward", [6.0, 6.0, 6.0, 2.0]), ("backward", [13, 13, 13, 17])]
    )
    assert found.rank is None
    assert "no rank's step time exceeded" in found.reason


def test_no_straggler_below_the_threshold():
    found = _dist.find_straggler([10.0, 10.5, 10.9], [("forward", [3.0, 3.5, 3.9])])
    assert found.rank is None and found.ratio == pytest.approx(10.9 / 10.5)


def test_unavailable_figures():
    found = _dist.find_straggler([10.0, NAN], [])
    assert found.rank is None and "rank(s) 1 had no measured step" in found.reason
    found = _dist.find_straggler([10.0, 10.0], [("gap", [NAN, 0.1]), ("forward", [3.0, 3.1])])
    assert found.rank is None and "not compared (unavailable on some rank): gap" in found.reason


def _row(exchange=1, wall=10.0, phases=(("forward", 4.0),), crc_names=None, steps=5):
    names = [n for n, _ in phases]
    window = [(None, wall, None, None, 0.1, dict(phases))] * steps
    vec, got = _dist.summarise_window(window, exchange)
    if crc_names is not None:
        vec[_dist._CRC] = float(__import__("zlib").crc32("\0".join(crc_names).encode()))
    assert got == names
    return vec


def test_ranks_record_figures_and_straggler():
    rows = [_row(wall=10.0), _row(wall=10.1), _row(wall=15.0)]
    rec = _dist.ranks_record(rows, ["forward"], step=9)
    assert rec["kind"] == "ranks" and rec["step"] == 9 and rec["world_size"] == 3
    assert rec["figures"]["wall_ms"] == {"min": 10.0, "median": 10.1, "max": 15.0, "slowest_rank": 2}
    assert rec["figures"]["gpu_ms"] is None and "gpu_ms" in rec["unavailable"]
    assert rec["per_rank"]["wall_ms"] == [10.0, 10.1, 15.0] and rec["per_rank"]["steps"] == [5, 5, 5]
    assert rec["step_basis"] == "wall_ms"
    assert (rec["straggler_rank"], rec["straggler_basis"]) == (2, "step")
    assert rec["threshold"] == _dist.STRAGGLER_RATIO
    assert "straggler_rank" not in rec["unavailable"]


def test_ranks_record_mismatched_phases_and_counts():
    rows = [_row(), _row(crc_names=["forward", "other"])]
    rec = _dist.ranks_record(rows, ["forward"], step=4)
    assert rec["phases"] == {} and "phase names differ" in rec["unavailable"]["phases"]
    rec = _dist.ranks_record([_row(exchange=1), _row(exchange=2, wall=30.0)], ["forward"], step=4)
    assert rec["straggler_rank"] is None
    assert "call profile_step the same number of times" in rec["unavailable"]["straggler_rank"]


def test_ranks_record_a_rank_with_an_empty_window():
    # Rank 1 finalised no measured step in this window (its steps still running, say): its
    # empty vector is not evidence that the phase names or the timing basis differ.
    empty, _ = _dist.summarise_window([], 1)
    rec = _dist.ranks_record([_row(), empty], ["forward"], step=4)
    assert "rank(s) 1 had no measured step" in rec["unavailable"]["straggler_rank"]
    assert "phases" not in rec["unavailable"], rec["unavailable"]
    assert rec["phases"]["forward"] == {"min": 4.0, "median": 4.0, "max": 4.0, "slowest_rank": 0}
    rec = _dist.ranks_record([empty, _dist.summarise_window([], 1)[0]], [], step=4)
    assert "phases" not in rec["unavailable"], rec["unavailable"]
    rec = _dist.ranks_record([empty, _row()], [], step=4)
    assert "recording rank had no measured step" in rec["unavailable"]["phases"]


def test_rank_log_path():
    assert _dist.rank_log_path("run.jsonl", 3) == "run.rank3.jsonl"
    assert _dist.rank_log_path(os.path.join("a.b", "run"), 0) == os.path.join("a.b", "run.rank0")


@pytest.mark.parametrize("kw, message", [
    ({"ranks_every": -1}, "'ranks_every' must be an int >= 0 (got -1)"),
    ({"ranks_every": 2.5}, "'ranks_every' must be an int >= 0 (got 2.5)"),
    ({"ranks_every": True}, "'ranks_every'"),
    ({"log_ranks": "first"}, "'log_ranks' must be 'all'"),
])
def test_bad_arguments(kw, message):
    with pytest.raises(stepprof.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        stepprof.Profiler(None, **kw)


@pytest.mark.parametrize("group, message", [
    ("gloo", "'group' must be a torch.distributed process group"),
    (0, "'group' must be a torch.distributed process group"),
    (-100, "this rank (0) is not a member of 'group'"),  # what new_group returns to non-members
])
def test_bad_group(monkeypatch, tmp_path, group, message):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(stepprof.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        stepprof.Profiler(str(tmp_path / "run.jsonl"), group=group)
    assert repr(group) in str(e.value)
    assert os.listdir(tmp_path) == []  # before the log was opened


# -- in-process, with torchrun's variables and a fake gather ------------------------------


@pytest.fixture
def rank0(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")


class FakeGather:
    """Rank 0's all_gather: rank 1's row is rank 0's with ``slow`` ms more in forward."""

    def __init__(self, slow: float = 0.0, complete: bool = True) -> None:
        self.calls: list[list[float]] = []
        self.slow = slow
        self.complete = complete

    def __call__(self, vec):
        self.calls.append(list(vec))
        other = list(vec)
        if not math.isnan(other[_dist._PH0]):
            other[_dist._PH0] += self.slow
            other[_dist._GPU] += self.slow
        return lambda: [list(vec), other] if self.complete else None


def test_records_carry_the_rank_and_each_rank_its_log(rank0, tmp_path, gpu):
    gather = FakeGather(slow=3.0)
    log = str(tmp_path / "run.jsonl")
    with make(log, gpu, ranks_every=2, gather=gather) as prof:
        for _ in range(6):
            with prof.step():
                with prof.measure("forward"):
                    gpu.launch(2.0)
                gpu.host(0.5)
                with prof.measure("backward"):
                    gpu.launch(3.0)
            gpu.host(7.0)  # between steps: the device finishes the step, then idles 2.5 ms
        gpu.wait_idle()
    assert prof.log == str(tmp_path / "run.rank0.jsonl") and not os.path.exists(log)
    records = list(stepprof.read(prof.log))
    assert {r["kind"] for r in records} == {"step", "memory", "summary", "ranks"}
    assert all((r["rank"], r["local_rank"], r["world_size"]) == (0, 0, 2) for r in records)
    assert len(gather.calls) == 3  # at the exits of steps 1, 3 and 5
    ranks = [r for r in records if r["kind"] == "ranks"]
    assert len(ranks) == 3 and [r["step"] for r in ranks] == [1, 3, 5]
    last = ranks[-1]
    assert last["step_basis"] == "gpu_ms"
    assert (last["straggler_rank"], last["straggler_basis"]) == (1, "step")
    assert last["phases"]["forward"]["slowest_rank"] == 1
    assert last["figures"]["gap_ms"]["median"] == pytest.approx(2.5)  # device idle between steps
    assert last["window_steps"]["min"] == 2
    assert len(gpu.released) == gpu.marks_made  # the gap's events went back to the pool
    assert gpu.syncs == 1  # close's one synchronisation; the exchange added none


def test_no_rank_fields_outside_a_distributed_run(log, gpu):
    with make(log, gpu, ranks_every=1) as prof:
        with prof.step():
            pass
    assert prof._exchange is None
    assert all("rank" not in r for r in stepprof.read(log))


def test_log_ranks_zero_keeps_no_log_on_other_ranks(monkeypatch, tmp_path, gpu):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    gather = FakeGather()
    with make(str(tmp_path / "run.jsonl"), gpu, ranks_every=1, log_ranks="zero", gather=gather) as prof:
        with prof.step():
            pass
    assert prof.log is None and os.listdir(tmp_path) == []
    assert len(gather.calls) == 1  # it still takes part in the exchange


def test_close_waits_a_bounded_time_for_ranks_that_never_join(rank0, log, gpu):
    gather = FakeGather(complete=False)
    prof = make(log, gpu, ranks_every=1, gather=gather, close_wait_s=0.05)
    for _ in range(2):
        with prof.step():
            gpu.launch(1.0)
    prof.close()
    (ranks,) = [r for r in stepprof.read(prof.log, kind="ranks")][:1]
    assert ranks["straggler_rank"] is None
    assert "did not join the exchange within 0.05 s" in ranks["unavailable"]["straggler_rank"]
    assert len(list(stepprof.read(prof.log, kind="ranks"))) == 2
    assert len(gather.calls) == 2  # close started no collective of its own


def test_a_rank_whose_recording_failed_still_takes_part(rank0, log, gpu):
    gather = FakeGather()
    prof = make(log, gpu, ranks_every=2, gather=gather)
    with pytest.warns(RuntimeWarning, match="internal error"):
        for i in range(8):
            gpu.fail_on = "reset_peak" if i == 3 else None
            with prof.step():
                with prof.measure("forward"):
                    pass
    prof.close()
    assert len(gather.calls) == 4  # steps 1, 3 (failed inside), 5 and 7


@pytest.mark.parametrize("fail_on", ["reset_peak", "mark", "read_memory", "unwatch_syncs"])
@pytest.mark.parametrize("phases", [0, 1, 3])
def test_a_step_where_recording_fails_counts_once_in_the_exchange(rank0, gpu, fail_on, phases):
    # Recording fails inside step 3 (as it opens, in a phase, or as it ends).  That step
    # must still count exactly once: not zero times (no token), nor once per later phase.
    gather = FakeGather()
    prof = make(None, gpu, ranks_every=1, phase_peaks_every=1, gather=gather)
    with pytest.warns(RuntimeWarning, match="internal error"):
        for i in range(6):
            gpu.fail_on = fail_on if i == 3 else None
            with prof.step():
                for p in range(phases):
                    with prof.measure(f"phase{p}"):
                        pass
    prof.close()
    assert [int(v[_dist._EXCHANGE]) for v in gather.calls] == [1, 2, 3, 4, 5, 6]


def test_a_failed_collective_is_recorded(rank0, log, gpu):
    def gather(vec):
        def pending():
            raise RuntimeError("connection closed by peer")
        return pending

    with make(log, gpu, ranks_every=1, gather=gather) as prof:
        with prof.step():
            pass
    (rec,) = stepprof.read(prof.log, kind="ranks")
    assert "connection closed by peer" in rec["unavailable"]["straggler_rank"]


# -- real processes on gloo ------------------------------------------------------------


def _spawn(fn, world, tmp_path, slow, timeout=120.0):
    """Run ``fn`` in ``world`` processes; fail (never hang) if they have not ended in ``timeout`` s."""
    ctx = mp.start_processes(fn, args=(world, str(tmp_path / "store"), str(tmp_path), slow),
                             nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join(5)
            pytest.fail(f"{fn.__name__}: {world} processes still running after {timeout:g} s")


def _logs(tmp_path, name, world):
    return [str(tmp_path / f"{name}.rank{r}.jsonl") for r in range(world)]


def test_two_processes_identity_straggler_and_report(tmp_path):
    _spawn(dist_workers.independent, 2, tmp_path, 1)
    for name in ("slow", "none"):
        for rank, path in enumerate(_logs(tmp_path, name, 2)):
            records = list(stepprof.read(path))
            assert records and all(
                (r["rank"], r["local_rank"], r["world_size"]) == (rank, rank, 2) for r in records
            )
            steps = [r for r in records if r["kind"] == "step"]
            assert len(steps) == dist_workers.STEPS
        ranks = list(stepprof.read(_logs(tmp_path, name, 2)[0], kind="ranks"))
        assert len(ranks) == dist_workers.STEPS // dist_workers.EVERY
        assert not list(stepprof.read(_logs(tmp_path, name, 2)[1], kind="ranks"))  # rank 0 only
        named = [(r["straggler_rank"], r["straggler_basis"]) for r in ranks]
        if name == "slow":
            assert named == [(1, "step")] * len(ranks)
        else:
            assert named == [(None, None)] * len(ranks), [r["unavailable"] for r in ranks]
    # The raising rank kept the exchange going: every exchange completed.
    assert all(r["figures"]["wall_ms"] is not None for r in stepprof.read(_logs(tmp_path, "slow", 2)[0], kind="ranks"))
    assert sorted(os.listdir(tmp_path)).count("zero.rank0.jsonl") == 1
    assert not os.path.exists(tmp_path / "zero.rank1.jsonl")
    assert list(stepprof.read(str(tmp_path / "zero.rank0.jsonl"), kind="ranks"))
    report = build_report(_logs(tmp_path, "slow", 2))
    d = report.to_dict()["distributed"]
    assert [r["rank"] for r in d["ranks"]] == [0, 1]
    assert d["exchanges"]["straggler_counts"] == {"1": 3}
    assert d["from_medians"]["straggler_rank"] == 1
    text = render(report)
    assert "== ranks: 2 log(s) of world size 2" in text and "straggler named: rank 1 in 3" in text


def test_four_processes_in_lockstep_name_the_forward_straggler(tmp_path):
    _spawn(dist_workers.lockstep, 4, tmp_path, 2)
    for rank, path in enumerate(_logs(tmp_path, "ddp", 4)):
        assert all((r["rank"], r["world_size"]) == (rank, 4) for r in stepprof.read(path))
    ranks = list(stepprof.read(_logs(tmp_path, "ddp", 4)[0], kind="ranks"))
    assert len(ranks) == dist_workers.STEPS // dist_workers.EVERY
    for r in ranks:
        # DDP's allreduce evens out the step times: the rule finds the cause in forward.
        assert r["step_ratio"] < _dist.STRAGGLER_RATIO
        assert (r["straggler_rank"], r["straggler_basis"]) == (2, "forward"), r["unavailable"]
    d = build_report(_logs(tmp_path, "ddp", 4)).to_dict()["distributed"]
    assert (d["from_medians"]["straggler_rank"], d["from_medians"]["basis"]) == (2, "forward")


def test_a_subgroup_names_the_straggler_by_its_global_rank(tmp_path):
    # Ranks 1 and 2 exchange on a group of their own; rank 2 is slow.  Group rank 0 is
    # global rank 1, which writes the ranks records; they must name global rank 2.
    _spawn(dist_workers.subgroup, 3, tmp_path, 2)
    ranks = list(stepprof.read(str(tmp_path / "sub.rank1.jsonl"), kind="ranks"))
    assert len(ranks) == dist_workers.STEPS // dist_workers.EVERY
    for r in ranks:
        assert r["world_size"] == 2 and r["group_ranks"] == [1, 2] and r["rank"] == 1
        assert (r["straggler_rank"], r["straggler_basis"]) == (2, "step"), r["unavailable"]
        assert r["figures"]["wall_ms"]["slowest_rank"] == 2
    assert not list(stepprof.read(str(tmp_path / "sub.rank2.jsonl"), kind="ranks"))
