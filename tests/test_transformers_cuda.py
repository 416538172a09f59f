"""The Hugging Face callback and sweep on a real GPU: BERT-base from its config (no download)."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import stepprof  # noqa: E402
from stepprof.integrations.transformers import StepprofCallback, sweep  # noqa: E402

pytestmark = pytest.mark.cuda

SEQ = 128
STEPS = 100
WARMUP = 5


class Samples(torch.utils.data.Dataset):
    """Random token ids of the real range and a real-length attention mask: never zeros."""

    def __init__(self, n: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1000, vocab, (n, SEQ), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long),
                "labels": self.labels[i]}


class EventSpans(TrainerCallback):
    """Our own CUDA events at the hooks where the step begins and ends."""

    def __init__(self) -> None:
        self.begins: list[torch.cuda.Event] = []
        self.ends: list[torch.cuda.Event] = []

    def _event(self) -> torch.cuda.Event:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def on_step_begin(self, args, state, control, **kwargs):
        self.begins.append(self._event())

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(self._event())


def _trainer(tmp_path, callbacks, steps=STEPS):
    torch.manual_seed(0)
    cfg = BertConfig()  # BERT-base: 12 layers, hidden 768, from the config alone
    model = BertForSequenceClassification(cfg)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=32,
        logging_steps=10, report_to=[], save_strategy="no", disable_tqdm=True, bf16=True,
        dataloader_num_workers=0,
    )
    return Trainer(model=model, args=args, train_dataset=Samples(2048, cfg.vocab_size), callbacks=callbacks)


def test_gpu_ms_matches_an_independent_event_span_over_the_same_steps(tmp_path):
    log = tmp_path / "run.jsonl"
    spans = EventSpans()
    cb = StepprofCallback(log=str(log), warmup=WARMUP)
    trainer = _trainer(tmp_path, [spans, cb])
    trainer.train()
    torch.cuda.synchronize()
    steps = [r for r in map(json.loads, open(log)) if r["kind"] == "step"]
    assert len(steps) == STEPS == len(spans.begins) == len(spans.ends)
    measured = [r for r in steps if not r["warmup"]]
    assert len(measured) == STEPS - WARMUP
    assert all(r["gpu_ms"] is not None and r["batch_size"] == 32 for r in measured)
    assert all(r["phases"]["forward_backward"]["gpu_ms"] > r["phases"]["optimizer"]["gpu_ms"] > 0 for r in measured)
    ours = sum(r["gpu_ms"] for r in measured)
    # Like with like.  stepprof's callback runs first (it moves itself first), so each of its
    # step events sits next to ours on the stream, with no device work between.  The steps do
    # not tile: between one step's end and the next one's begin lie the Trainer's logging and
    # the fetch of the next micro-batches, whose host-to-device copies run on the GPU, outside
    # any step.  So the reference is the span from the first measured step's begin to the
    # last one's end, less the gaps between consecutive steps, all from our events.
    first, last = WARMUP, STEPS - 1
    span = spans.begins[first].elapsed_time(spans.ends[last])
    gaps = sum(spans.ends[i].elapsed_time(spans.begins[i + 1]) for i in range(first, last))
    reference = span - gaps
    print(f"\nstepprof gpu_ms sum {ours:.3f} ms, event reference {reference:.3f} ms (span {span:.3f} less gaps {gaps:.3f}): {ours / reference - 1:+.3%}")
    assert abs(ours - reference) <= 0.02 * reference, (ours, reference, span, gaps)
    # The figures reached the Trainer's logs, GPU time included.
    # A log may find no step ready: each record waits for the energy sample after its step (up
    # to energy_every_s, 0.5 s, here longer than 10 steps), and goes to the next window.  So no
    # measured step written before the last log is lost, and each log that has figures has GPU time.
    logged = [h for h in trainer.state.log_history if "loss" in h]
    with_figures = [h for h in logged if "stepprof/steps" in h]
    assert len(with_figures) >= len(logged) // 2, logged
    assert all("stepprof/gpu_ms" in h for h in with_figures), with_figures
    assert sum(h["stepprof/steps"] for h in with_figures) >= len(measured) - 3 * 10, with_figures


def test_without_energy_sampling_every_log_after_the_first_has_figures(tmp_path):
    trainer = _trainer(tmp_path, [StepprofCallback(log=None, warmup=WARMUP, energy_every_s=None)])
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged and all("stepprof/gpu_ms" in h for h in logged[1:]), logged


def test_the_sweep_on_bert_base_recommends_a_batch_and_restores_the_weights(tmp_path):
    trainer = _trainer(tmp_path, [], steps=2)
    trainer.train()  # the optimizer has state to restore
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    result = sweep(trainer, max_batch=256, time_budget_s=60, progress=False, apply=True)
    assert isinstance(result, stepprof.SweepResult) and result.recommended is not None
    assert result.device.startswith("cuda")
    assert all(p.samples_per_s is not None for p in result.points if not p.oom)
    assert trainer.args.per_device_train_batch_size == result.recommended
    for n, p in trainer.model.named_parameters():
        assert torch.equal(p, params[n]), n
