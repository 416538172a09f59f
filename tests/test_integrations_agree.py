"""The two framework callbacks agree (issue 28, items 8-10), on the CPU: the figures their
loggers get, the whole input wait under gradient accumulation, and the framework's own step."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")
pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lightning.pytorch.loggers import Logger  # noqa: E402

import stepprof  # noqa: E402
from stepprof.integrations import lightning as sl  # noqa: E402
from stepprof.integrations import transformers as st  # noqa: E402
from stepprof.integrations._window import Window, figures, named  # noqa: E402

from . import test_lightning as tl  # noqa: E402
from . import test_transformers as tt  # noqa: E402

SLEEP_S = 0.004  # per sample: a slow loader, 16 ms a micro-batch of 4
ACCUMULATE = 2


def _steps(path) -> list[dict]:
    with open(path) as f:
        return [r for r in map(json.loads, f) if r["kind"] == "step"]


def test_the_window_logs_flops_memory_retries_and_an_int_step_count():
    w = Window()
    for i, (retries, reserved) in enumerate([(0, 10), (2, 30), (1, 20)]):
        w({"kind": "step", "step": i, "warmup": False, "wall_ms": 2.0, "gpu_ms": 1.0, "tflops_per_s": 100.0 + i,
           "mfu": 0.4 + i / 10, "reserved_bytes": reserved, "peak_allocated_bytes": reserved - 5,
           "host_rss_bytes": None, "allocator": {"num_alloc_retries": retries}, "phases": {"fwd": {"wall_ms": 1.0}}})
    figs = figures(w.drain())
    assert figs["stepprof/steps"] == 3 and type(figs["stepprof/steps"]) is int
    assert figs["stepprof/tflops_per_s"] == 101.0 and figs["stepprof/mfu"] == pytest.approx(0.5)
    assert figs["stepprof/reserved_bytes"] == 30 and figs["stepprof/peak_allocated_bytes"] == 25
    assert figs["stepprof/alloc_retries"] == 3
    assert "stepprof/host_rss_bytes" not in figs  # null in every step: left out, never 0
    assert named(figs, ".")["stepprof.phases.fwd.wall_ms"] == 1.0 and "stepprof.mfu" in named(figs, ".")


class DotLogger(Logger):
    """A logger whose group separator is '.' (Lightning's monitors join names with it)."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[tuple[int, dict]] = []

    name = "dot"
    version = 0
    group_separator = "."

    def log_metrics(self, metrics, step=None):
        self.metrics.append((step, dict(metrics)))

    def log_hyperparams(self, *args, **kwargs):
        pass


def test_lightning_names_its_figures_with_each_loggers_separator_and_logs_host_rss(tmp_path):
    dot = DotLogger()
    tl.trainer(tmp_path, [sl.StepprofCallback(None)], logger=dot, max_steps=10).fit(tl.Tiny())
    ours = [m for _, m in dot.metrics if any(k.startswith("stepprof") for k in m)]
    assert ours and all("stepprof.wall_ms" in m and "stepprof.phases.forward.wall_ms" in m for m in ours)
    assert not [k for m in ours for k in m if k.startswith("stepprof/")]
    assert all(type(m["stepprof.steps"]) is int and m["stepprof.host_rss_bytes"] > 0 for m in ours)


def _lightning_waits(tmp_path) -> list[dict]:
    log = str(tmp_path / "lightning.jsonl")
    tl.trainer(tmp_path, [sl.StepprofCallback(log)], max_steps=6, accumulate_grad_batches=ACCUMULATE).fit(
        tl.Tiny(sleep_s=SLEEP_S))
    return _steps(log)


def _hf_waits(tmp_path) -> list[dict]:
    class Slow(torch.utils.data.Dataset):
        items = tt._dataset(64)

        def __len__(self) -> int:
            return len(self.items)

        def __getitem__(self, i):
            time.sleep(SLEEP_S)
            return self.items[i]

    log = tmp_path / "hf.jsonl"
    trainer = tt.Trainer(model=tt._model(), args=tt._args(tmp_path, max_steps=6, gradient_accumulation_steps=ACCUMULATE),
                         train_dataset=Slow(), callbacks=[st.StepprofCallback(log=str(log))])
    trainer.train()
    return _steps(log)


def test_both_callbacks_count_the_whole_input_wait_under_gradient_accumulation(tmp_path):
    """Lightning fetches each micro-batch inside the step, Hugging Face fetches them all before
    it: each step's data_wait_ms holds both micro-batches' fetch in either."""
    fetch_ms = ACCUMULATE * tl.BATCH * SLEEP_S * 1e3  # a step's fetch: 32 ms
    lightning, hf = _lightning_waits(tmp_path), _hf_waits(tmp_path)
    for r in lightning[1:]:
        inside = r["data_wait_in_step_ms"]
        assert inside >= 0.9 * fetch_ms / ACCUMULATE and r["data_wait_ms"] >= 0.9 * fetch_ms
        assert r["phases"]["between_micro_batches"]["wall_ms"] == pytest.approx(inside, rel=0.05, abs=0.2)
    # accelerate's loader fetches one batch ahead, so one step's fetch may hold 1 to 3 batches
    light = sum(r["data_wait_ms"] for r in lightning[1:]) / (len(lightning) - 1)
    hug = sum(r["data_wait_ms"] for r in hf[1:]) / (len(hf) - 1)
    assert light >= 0.9 * fetch_ms and hug >= 0.9 * fetch_ms and 0.6 < light / hug < 1.6
    assert all("data_wait_in_step_ms" not in r for r in hf)  # its steps begin after the fetch


def test_the_reports_input_share_counts_the_wait_inside_a_step_once(tmp_path):
    log = str(tmp_path / "run.jsonl")
    with stepprof.Profiler(log, device="cpu", warmup=0) as prof:
        for _ in range(4):
            prof.begin_step(batch_size=4, global_step=7)
            prof.begin_phase("forward")
            time.sleep(0.01)  # the step's own work
            prof.end_phase()
            time.sleep(0.01)  # the wait for the second micro-batch, inside the step
            prof.add_batch(torch.zeros(4, 1), wait_s=0.01)
            prof.end_step()
            time.sleep(0.01)  # the wait before the next step
    steps = _steps(log)
    assert all(r["global_step"] == 7 and r["batch_size"] == 8 for r in steps)
    assert all(r["data_wait_in_step_ms"] == pytest.approx(10.0) for r in steps)
    assert all(r["data_wait_ms"] >= 19.5 for r in steps[1:])  # both waits
    share = prof.summary.input_wait_fraction
    # 20 ms of a 30 ms iteration (10 before, 10 of work, 10 inside): not 20 of 40 (the wait
    # inside counted twice), nor 10 of 30 (only the wait before the step)
    assert 0.6 < share < 0.72, share
    with stepprof.Profiler(None, device="cpu") as other:
        with pytest.raises(stepprof.UsageError, match="wait_s"):
            other.add_batch(torch.zeros(1), wait_s=0.1)  # outside a step: stepprof measures it


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_a_bad_global_step_is_refused(bad):
    with stepprof.Profiler(None, device="cpu") as prof:
        with pytest.raises(stepprof.UsageError, match="global_step"):
            prof.begin_step(global_step=bad)


def test_records_carry_the_frameworks_step_and_a_resumed_run_continues(tmp_path):
    """Lightning: the step it logs a batch's metrics at; Hugging Face: state.global_step after
    the step, which its logs use.  Resumed from a checkpoint, both go on from there."""
    first, second = str(tmp_path / "l1.jsonl"), str(tmp_path / "l2.jsonl")
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=5, save_top_k=-1)
    t1 = pl.Trainer(accelerator="cpu", logger=False, max_steps=5, enable_progress_bar=False,
                    enable_model_summary=False, callbacks=[sl.StepprofCallback(first), ckpt],
                    default_root_dir=str(tmp_path))
    t1.fit(tl.Tiny())
    t2 = pl.Trainer(accelerator="cpu", logger=False, max_steps=10, enable_progress_bar=False,
                    enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
                    callbacks=[sl.StepprofCallback(second)])
    t2.fit(tl.Tiny(), ckpt_path=ckpt.best_model_path or ckpt.last_model_path or
           os.path.join(str(tmp_path / "ckpt"), sorted(os.listdir(tmp_path / "ckpt"))[-1]))
    assert [r["global_step"] for r in _steps(first)] == list(range(5))
    assert [r["global_step"] for r in _steps(second)] == list(range(5, 10))
    assert [r["step"] for r in _steps(second)] == list(range(5))  # stepprof's own index restarts

    log = tmp_path / "hf.jsonl"
    args = tt._args(tmp_path, max_steps=6, save_strategy="steps", save_steps=3)
    tt.Trainer(model=tt._model(), args=args, train_dataset=tt._dataset(64),
               callbacks=[st.StepprofCallback(log=str(log))]).train()
    assert [r["global_step"] for r in _steps(log)] == list(range(1, 7))
    resumed = tmp_path / "hf2.jsonl"
    args = tt._args(tmp_path, max_steps=9, save_strategy="no")
    tt.Trainer(model=tt._model(), args=args, train_dataset=tt._dataset(64),
               callbacks=[st.StepprofCallback(log=str(resumed))]).train(resume_from_checkpoint=True)
    assert [r["global_step"] for r in _steps(resumed)] == list(range(7, 10))


def test_tensorboard_export_draws_at_the_frameworks_step(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from stepprof._export import export_tensorboard

    log = str(tmp_path / "run.jsonl")
    with stepprof.Profiler(log, device="cpu", warmup=0) as prof:
        for g in (100, 101, 102):
            prof.begin_step(batch_size=1, global_step=g)
            prof.end_step()
    export_tensorboard([log], str(tmp_path / "tb"))
    runs = [d for d, _, files in os.walk(tmp_path / "tb") if any("tfevents" in f for f in files)]
    acc = EventAccumulator(runs[0])
    acc.Reload()
    assert [e.step for e in acc.Scalars("stepprof/wall_ms")] == [100, 101, 102]
