"""Tokens: ``profile_step(tokens=N)``, or counted in the step's batch, and ``tokens_per_s``.

A batch's tokens are those of its ``input_ids`` (else its first 2-D integer tensor), the
unmasked ones when an ``attention_mask`` stands beside them; micro-batches add up.  A step
with tokens has ``tokens`` and ``tokens_per_s`` (tokens over the longer of wall and GPU time),
null with the reason where the count failed; a step without has neither field.  The summary,
``report --json`` and the callbacks' window agree on the median.
"""

from __future__ import annotations

import json
import statistics
from collections import UserDict

import pytest
import torch

import stepprof
from stepprof._batch import Tokens, count_tokens, total_tokens
from stepprof._cli import main as cli
from stepprof.integrations._window import Window, figures

from .conftest import make, steps

IDS = torch.arange(32, dtype=torch.int64).reshape(4, 8)
MASK = torch.ones(4, 8, dtype=torch.int64)
MASK[1, 5:] = 0  # a padded row: 3 pad tokens
MASK[3, 2:] = 0  # 6 more
UNMASKED = 32 - 3 - 6


class _Encoding(UserDict):
    """A Hugging Face ``BatchEncoding`` keeps its tensors in ``.data``."""


@pytest.mark.parametrize("batch, tokens", [
    (IDS, 32),
    ({"input_ids": IDS, "attention_mask": MASK}, UNMASKED),
    ({"input_ids": IDS, "attention_mask": MASK.bool()}, UNMASKED),
    (_Encoding(input_ids=IDS, attention_mask=MASK, labels=IDS), UNMASKED),
    ((IDS, IDS), 32),  # nanoGPT's (x, y): the inputs, not the targets too
    (({"input_ids": IDS[:2]}, torch.zeros(2)), 16),
    ([torch.randn(4, 3), IDS.int()], 32),  # int32 ids after a float feature
    ({"x": torch.randn(4, 8), "ids": IDS.short()}, 32),
])
def test_a_batch_s_tokens_are_counted(batch, tokens):
    counted = count_tokens(batch)
    assert counted is not None and counted.value() == (tokens, None)


@pytest.mark.parametrize("batch", [
    torch.randn(4, 3, 8, 8),  # images
    (torch.randn(4, 3, 8, 8), torch.arange(4)),  # images and 1-D labels
    torch.zeros(4, 8, dtype=torch.uint8),  # an image's dtype
    IDS[0],  # 1-D
    {"pixel_values": torch.randn(2, 3)},
    None, 3, "text",
])
def test_a_batch_without_tokens_has_none(batch):
    assert count_tokens(batch) is None


def test_a_mask_that_does_not_fit_its_ids_says_so():
    counted = count_tokens({"input_ids": IDS, "attention_mask": MASK[:, :7]})
    n, why = counted.value()
    assert n is None and "(4, 7)" in why and "(4, 8)" in why and "tokens=N" in why


class _Done:
    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def test_a_gpu_count_is_read_once_its_copy_completed():
    ready = Tokens(5, ((torch.tensor(7), _Done(True)),))
    assert ready.value() == (12, None)
    late = Tokens(5, ((torch.tensor(7), _Done(True)), (torch.tensor(1), _Done(False))))
    n, why = late.value()
    assert n is None and "still on the GPU" in why


def test_micro_batches_add_up_and_one_without_tokens_says_which():
    assert total_tokens([IDS, {"input_ids": IDS, "attention_mask": MASK}]).value() == (32 + UNMASKED, None)
    assert total_tokens([torch.randn(2, 3)]) is None
    n, why = total_tokens([IDS, torch.randn(4, 3)]).value()
    assert n is None and why.startswith("micro-batch 1:")


def _rates(records):
    return [r["tokens"] / (max(r["wall_ms"], r["gpu_ms"]) / 1e3) for r in records]


def test_tokens_per_s_is_tokens_over_the_step_span(log, gpu):
    with make(log, gpu, warmup=0) as prof:
        for i in range(4):
            with prof.step(batch={"input_ids": IDS, "attention_mask": MASK}):
                gpu.launch(2.0 if i % 2 else 0.5)  # the GPU time is the span on odd steps
                gpu.host(1.0)
        with prof.step(batch=IDS, tokens=1000):  # an explicit count wins
            gpu.launch(1.0)
        with prof.step(batch_size=4):  # no tokens: no fields
            gpu.launch(1.0)
    recs = steps(log)
    assert [r.get("tokens") for r in recs] == [UNMASKED] * 4 + [1000, None]
    assert "tokens" not in recs[-1] and "tokens_per_s" not in recs[-1]
    for r, rate in zip(recs[:5], _rates(recs[:5])):
        assert r["tokens_per_s"] == pytest.approx(rate, rel=1e-12)
        assert r["batch_size"] == 4 and "tokens_per_s" not in r["unavailable"]
    assert recs[1]["gpu_ms"] > recs[1]["wall_ms"]  # (its span is the GPU's time)
    assert prof.summary.tokens_per_s_median == pytest.approx(statistics.median(_rates(recs[:5])))


def test_the_summary_the_report_and_the_window_agree(log, gpu, capsys):
    window = Window()
    with make(log, gpu, warmup=1) as prof:
        prof.watch(window)
        for i in range(7):
            with prof.step(tokens=100 * (i + 1)):
                gpu.launch(1.0 + i % 3)
    timed = [r for r in steps(log) if not r["warmup"]]
    median = statistics.median(r["tokens_per_s"] for r in timed)
    assert prof.summary.tokens_per_s_median == pytest.approx(median)
    assert "tokens/s" in str(prof.summary)
    assert figures(window.drain())["stepprof/tokens_per_s"] == pytest.approx(median)
    capsys.readouterr()
    assert cli(["report", log, "--json"]) == 0
    (run,) = json.loads(capsys.readouterr().out)["logs"][0]["runs"]
    assert run["figures"]["tokens_per_s_median"] == pytest.approx(median)
    assert cli(["report", log]) == 0
    assert "tokens/s (median)" in capsys.readouterr().out


def test_a_run_without_tokens_says_how_to_get_them(log, gpu, capsys):
    with make(log, gpu, warmup=0) as prof:
        with prof.step(batch=torch.randn(4, 3)):
            gpu.launch(1.0)
    assert prof.summary.tokens_per_s_median is None
    assert "tokens=N" in prof.summary.unavailable["tokens_per_s_median"]
    assert "tokens" not in steps(log)[0]
    assert cli(["report", log]) == 0
    assert "tokens/s" not in capsys.readouterr().out  # no row for a figure no step had


def test_iterate_add_batch_and_a_measured_function_count_them(log, gpu):
    loader = [{"input_ids": IDS, "attention_mask": MASK}, IDS]
    with make(log, gpu, warmup=0) as prof:
        for batch in prof.iterate(loader):
            with prof.step():
                gpu.launch(1.0)

        @prof.measure
        def train_step(batch):
            gpu.launch(1.0)

        train_step((IDS, IDS))
        prof.begin_step(batch=IDS)  # gradient accumulation: the micro-batches add up
        prof.add_batch({"input_ids": IDS, "attention_mask": MASK})
        prof.end_step()
        prof.begin_step(tokens=50)  # a given count is the step's own: add_batch adds no tokens
        prof.add_batch(IDS)
        prof.end_step()
        prof.begin_step(batch=IDS)
        prof.add_batch(torch.randn(4, 3))  # a micro-batch without tokens: null, with the reason
        prof.end_step()
    recs = steps(log)
    assert [r["tokens"] for r in recs] == [UNMASKED, 32, 32, 32 + UNMASKED, 50, None]
    assert [r["batch_size"] for r in recs[:5]] == [4, 4, 4, 8, 4]
    assert recs[-1]["tokens_per_s"] is None and "add_batch" in recs[-1]["unavailable"]["tokens"]


@pytest.mark.parametrize("bad", [-1, 2.5, "100", True])
def test_a_bad_token_count_is_refused_with_the_fix(log, gpu, bad):
    with make(log, gpu) as prof:
        for opener in (prof.step, stepprof.profile_step, prof.begin_step):
            with pytest.raises(stepprof.ConfigError, match=r"'tokens' must be an int >= 0 or None \(got "):
                opener(tokens=bad)


@pytest.mark.cuda
def test_a_padded_batch_on_the_gpu_is_counted_there_without_a_sync(tmp_path):
    log = str(tmp_path / "gpu.jsonl")
    batch = {"input_ids": IDS.cuda(), "attention_mask": MASK.cuda()}
    x = torch.randn(256, 256, device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.get_sync_debug_mode()
    with stepprof.Profiler(log, warmup=1, syncs="off", energy_every_s=None) as prof:
        torch.cuda.set_sync_debug_mode("error")  # a sync inside a step would raise
        try:
            for _ in range(6):
                with prof.step(batch=batch):
                    for _ in range(20):
                        x = x @ x
                        x = x / x.norm()
        finally:
            torch.cuda.set_sync_debug_mode(before)
    recs = steps(log)
    assert [r["tokens"] for r in recs] == [UNMASKED] * 6
    for r, rate in zip(recs, _rates(recs)):
        assert r["tokens_per_s"] == pytest.approx(rate, rel=1e-12)
