"""The loop around the step: data_wait_ms, stepprof.iterate, the inferred batch size, input-bound."""

from __future__ import annotations

import dataclasses
import statistics
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import stepprof
from stepprof._batch import infer_batch_size
from stepprof._report.build import build_report
from stepprof._report.render import render

from .conftest import make, steps
from .fakes import FakeGpu


class Sleepy(Dataset):
    """A dataset whose items each take ``sleep_s`` to load."""

    def __init__(self, n: int, sleep_s: float) -> None:
        self.n, self.sleep_s = n, sleep_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return torch.full((4,), float(i)), torch.tensor(i)


def _train(log: str, sleep_s: float, steps_n: int = 24) -> stepprof.Summary:
    model = torch.nn.Linear(4, 1)
    loader = DataLoader(Sleepy(8 * steps_n, sleep_s), batch_size=8, num_workers=0)
    with stepprof.Profiler(log, warmup=2, device="cpu") as prof:
        for x, y in stepprof.iterate(loader):
            with stepprof.profile_step(batch=(x, y)):
                model(x).sum().backward()
                time.sleep(0.004)  # a step of a few ms on any host, as a real one would be
    return prof.summary


def test_a_slow_loader_gives_its_data_wait_and_the_input_bound_diagnosis(log):
    summary = _train(log, sleep_s=0.005)  # 8 items x 5 ms = 40 ms to fetch each batch
    records = steps(log)
    waits = [r["data_wait_ms"] for r in records[1:]]
    assert statistics.median(waits) == pytest.approx(40.0, rel=0.15)
    assert records[0]["data_wait_ms"] is None and "first step" in records[0]["unavailable"]["data_wait_ms"]
    assert all(r["data_ms"] <= r["data_wait_ms"] + 0.5 for r in records[1:])
    assert all(r["batch_size"] == 8 for r in records)
    assert summary.input_wait_fraction > 0.3 and summary.data_wait_ms_median == pytest.approx(40.0, rel=0.15)
    report = build_report([log])
    run = report.logs[0].runs[0]
    (diag,) = [d for d in run.diagnoses if d.kind == "input-bound"]
    assert diag.title == "Input-bound: the loop waits for its next batch"
    assert any("num_workers" in r for r in diag.remedy)
    assert not any("pin_memory" in r or "GPU" in r for r in diag.remedy)  # a CPU run: no GPU remedies
    assert "Input-bound" in render(report) and "input wait (of loop)" in render(report)


def _waits_log(log, waits_ms, step_ms=5.0):
    gpu = FakeGpu()
    prof = make(log, gpu)
    for w in waits_ms:
        gpu.host(w)  # host time between steps
        with prof.step():
            gpu.host(step_ms)
    prof.close()
    (run,) = build_report([log]).logs[0].runs
    return run


def test_a_few_long_waits_are_input_stalls_not_an_input_bound_steady_state(log):
    """Issue 28: a median wait of 0.2 ms against a 5 ms step is no input-bound loop, whatever
    a worker's start-up stall does to the mean; the evidence keeps medians with medians."""
    run = _waits_log(log, [0.2] * 10 + [400.0] + [0.2] * 29)
    (diag,) = [d for d in run.diagnoses if d.kind == "input-bound"]
    assert diag.title == "Input stalls: a few long waits between steps, not the steady state"
    text = " ".join(diag.evidence)
    assert "median data_wait_ms 0.20 against a median step of 5.00 ms: 4% of a typical iteration" in text
    assert "over the run, waits take" in text and "(mean data_wait_ms 10.45" in text
    assert any("persistent_workers" in r for r in diag.remedy) and not any("num_workers=N" in r for r in diag.remedy)


def test_a_steady_wait_on_a_gpu_run_is_input_bound_with_the_gpu_remedies(log):
    run = _waits_log(log, [4.0] * 30)
    (diag,) = [d for d in run.diagnoses if d.kind == "input-bound"]
    assert diag.title.startswith("Input-bound")
    assert diag.evidence[0].startswith("median data_wait_ms 4.00 against a median step of 5.00 ms: 44%")
    assert any("pin_memory" in r for r in diag.remedy)


def test_a_fast_loader_is_not_input_bound(log):
    summary = _train(log, sleep_s=0.0, steps_n=40)
    assert summary.input_wait_fraction < 0.2
    run = build_report([log]).logs[0].runs[0]
    assert not [d for d in run.diagnoses if d.kind == "input-bound"]


def test_data_wait_is_the_time_since_the_previous_exit_without_iterate(log):
    gpu = FakeGpu()
    prof = make(log, gpu)
    for _ in range(3):
        gpu.host(7.0)  # host work between steps (a loader, logging...)
        with prof.step():
            gpu.host(1.0)
    prof.close()
    first, *rest = steps(log)
    assert first["data_wait_ms"] is None
    assert [r["data_wait_ms"] for r in rest] == [pytest.approx(7.0), pytest.approx(7.0)]
    assert all("data_ms" not in r for r in rest)  # no stepprof.iterate: no data_ms
    run = build_report([log]).logs[0].runs[0]
    (diag,) = [d for d in run.diagnoses if d.kind == "input-bound"]
    assert diag.title.startswith("Input-bound (likely)")  # it cannot tell the loader apart


def test_a_step_cut_short_leaves_the_next_wait_null(log):
    gpu = FakeGpu()
    prof = make(log, gpu)
    with prof.step():
        gpu.host(1.0)
    prof._boundaries.context().last_exit = 0  # as an interrupted exit leaves it
    gpu.host(5.0)
    with prof.step():
        gpu.host(1.0)
    prof.close()
    assert [r["data_wait_ms"] for r in steps(log)] == [None, None]


@dataclasses.dataclass
class Batch:
    tokens: torch.Tensor
    labels: torch.Tensor
    _cache: object = None


@pytest.mark.parametrize("batch, size", [
    (torch.zeros(8, 3), 8),
    ((torch.zeros(6, 3), torch.zeros(6)), 6),
    ([torch.zeros(5, 2), [torch.zeros(5)]], 5),
    ({"input_ids": torch.zeros(4, 16), "mask": torch.ones(4, 16), "meta": "x"}, 4),
    (Batch(torch.zeros(3, 7), torch.zeros(3)), 3),
])
def test_batch_size_is_the_leading_dimension_of_the_batchs_tensors(batch, size):
    assert infer_batch_size(batch) == (size, None)


@pytest.mark.parametrize("batch, why", [
    ((torch.zeros(8, 3), torch.zeros(4)), "disagree on their leading dimension (batch[0] has 8, batch[1] has 4)"),
    ({"x": torch.zeros(2)}, None),
    ([1, 2, 3], "holds no tensor with a leading dimension"),
    (torch.tensor(1.0), "holds no tensor with a leading dimension"),
])
def test_a_batch_whose_size_is_not_clear_is_not_guessed(batch, why):
    size, reason = infer_batch_size(batch)
    if why is None:
        assert size == 2
    else:
        assert size is None and why in reason and "pass batch_size=N" in reason


def test_where_the_batch_size_is_inferred_and_an_explicit_one_wins(log):
    gpu = FakeGpu()
    prof = make(log, gpu)
    with prof.step(batch=(torch.zeros(8, 3), torch.zeros(8))):
        pass
    with prof.step(batch=torch.zeros(8, 3), batch_size=2):  # explicit wins
        pass
    with prof.step(batch=(torch.zeros(8, 3), torch.zeros(4))):  # conflicting: null, with the reason
        pass

    @prof.measure
    def train_step(batch):
        pass

    class Trainer:
        @prof.measure
        def step(self, batch):
            pass

    train_step({"x": torch.zeros(5, 1)})
    Trainer().step([torch.zeros(6)])
    for batch in prof.iterate([torch.zeros(7, 2)]):
        with prof.step():
            pass
    prof.close()
    got = [(r["batch_size"], r["unavailable"].get("batch_size")) for r in steps(log)]
    assert [g[0] for g in got] == [8, 2, None, 5, 6, 7]
    assert "disagree" in got[2][1] and got[2][1] == steps(log)[2]["unavailable"]["samples_per_s"]


def test_iterate_hands_each_item_on_unchanged_and_is_reiterable(log):
    items = [object(), object(), object()]
    with stepprof.Profiler(None) as prof:
        wrapped = stepprof.iterate(items)
        assert len(wrapped) == 3
        assert list(wrapped) == items and list(wrapped) == items  # a second epoch
    with pytest.raises(stepprof.UsageError, match=r"iterate\(\) takes an iterable"):
        stepprof.iterate(42)
    assert prof.summary.steps == 0


def test_iterate_never_breaks_the_loop_when_recording_failed(log):
    gpu = FakeGpu()
    prof = make(log, gpu)
    prof._boundaries.note_batch = None  # an internal error: calling it raises TypeError
    assert list(prof.iterate([1, 2])) == [1, 2]
    prof.close()


def test_add_batch_sums_micro_batches_inside_a_step_and_feeds_the_next_step_outside_one(log):
    """``Profiler.add_batch``: gradient accumulation inside a step (one call per micro-batch, or
    all at once); outside a step, the next step's batch and fetch time, as ``iterate`` gives."""
    prof = make(log, FakeGpu())
    prof.begin_step(batch=torch.zeros(4, 3))   # the first micro-batch, at the step's entry
    prof.add_batch(torch.zeros(4, 3))
    prof.add_batch(torch.zeros(2, 3))
    prof.end_step()
    with prof.step():                           # all micro-batches in one call
        prof.add_batch(torch.zeros(3), torch.zeros(5))
    prof.begin_step()                           # one whose size cannot be inferred
    prof.add_batch(torch.zeros(4))
    prof.add_batch((torch.zeros(4), torch.zeros(2)))
    prof.add_batch(torch.zeros(9))               # stays null: the reason is the first failure's
    prof.end_step()
    prof.add_batch(torch.zeros(6), torch.zeros(1, 2), fetch_s=0.25)  # before the step: the next one's
    with prof.step():
        pass
    prof.close()
    recs = steps(log)
    assert [r["batch_size"] for r in recs] == [10, 8, None, 7]
    assert "disagree" in recs[2]["unavailable"]["batch_size"]
    assert recs[3]["data_ms"] == pytest.approx(250.0)
    assert recs[0].get("data_ms") is None


@pytest.mark.parametrize("call, match", [
    (lambda p: p.add_batch(), r"add_batch\(\) needs a batch"),
    (lambda p: p.add_batch(torch.zeros(2), fetch_s=-1), r"'fetch_s' must be a finite number of seconds >= 0 \(got -1\)"),
    (lambda p: p.add_batch(torch.zeros(2), fetch_s="1"), r"'fetch_s' must be"),
    (lambda p: p.watch(None), r"'watcher' must be callable \(got None\).*prof\.watch\(records\.append\)"),
])
def test_add_batch_and_watch_name_a_bad_argument(log, call, match):
    prof = make(log, FakeGpu())
    with pytest.raises((stepprof.UsageError, stepprof.ConfigError), match=match):
        call(prof)
    prof.close()


def test_watch_sees_every_step_record_as_written(log):
    prof = make(log, FakeGpu())
    seen = []
    prof.watch(seen.append)
    for _ in range(5):
        with prof.step(batch_size=2):
            pass
    prof.close()
    assert [r["step"] for r in seen] == [r["step"] for r in steps(log)] == list(range(5))
