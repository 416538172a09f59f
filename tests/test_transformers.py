"""stepprof.integrations.transformers: the callback in a real Trainer.train() and the sweep, on CPU.

A tiny BERT built from a config (no download), an in-memory dataset, about 20 steps each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

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

SEQ = 16


def _model(seed: int = 0) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64)
    return BertForSequenceClassification(cfg)


def _dataset(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        {"input_ids": torch.randint(0, 100, (SEQ,), generator=g),
         "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": torch.tensor(i % 2)}
        for i in range(n)
    ]


def _args(tmp_path, **kw) -> TrainingArguments:
    settings = dict(output_dir=str(tmp_path / "out"), max_steps=20, per_device_train_batch_size=4,
                    logging_steps=5, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
                    dataloader_num_workers=0)
    settings.update(kw)
    return TrainingArguments(**settings)


class Capture(TrainerCallback):
    """What a report_to backend sees: the logs dict of each on_log."""

    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def _records(path, kind="step") -> list[dict]:
    with open(path) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


def test_one_record_per_optimizer_step_with_both_phases_and_the_batch_size(tmp_path):
    log = tmp_path / "run.jsonl"
    cb = StepprofCallback(log=str(log))
    trainer = Trainer(model=_model(), args=_args(tmp_path), train_dataset=_dataset(64), callbacks=[cb])
    trainer.train()
    steps = _records(log)
    assert [r["step"] for r in steps] == list(range(20))  # one per optimizer step
    assert all(r["batch_size"] == 4 and r["error"] is None for r in steps)
    for r in steps:
        fb, opt = r["phases"]["forward_backward"], r["phases"]["optimizer"]
        assert fb["count"] == 1 and opt["count"] == 1
        assert 0 < fb["wall_ms"] < r["wall_ms"] and 0 < opt["wall_ms"] < r["wall_ms"]
        assert r["samples_per_s"] > 0 and r["data_ms"] >= 0
        assert r["tokens"] == 4 * SEQ and r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * SEQ)
    assert steps[0]["data_wait_ms"] is None and all(r["data_wait_ms"] >= 0 for r in steps[1:])
    assert cb.summary is not None and cb.summary.measured_steps == 20 and cb.profiler.closed
    assert "training_step" not in vars(trainer) and "get_batch_samples" not in vars(trainer)  # unwrapped
    assert len(_records(log, "summary")) == 1


def test_gradient_accumulation_one_record_per_optimizer_step_micro_batches_counted(tmp_path):
    # 50 samples in batches of 4: 12 of 4 and one of 2 per epoch; with 2 micro-batches per
    # optimizer step, an epoch is 6 steps of 8 samples and one step of a single batch of 2.
    log = tmp_path / "run.jsonl"
    trainer = Trainer(model=_model(), args=_args(tmp_path, gradient_accumulation_steps=2),
                      train_dataset=_dataset(50), callbacks=[StepprofCallback(log=str(log))])
    trainer.train()
    steps = _records(log)
    assert len(steps) == 20 == trainer.state.global_step
    epoch = [8] * 6 + [2]
    assert [r["batch_size"] for r in steps] == (epoch * 3)[:20]
    assert [r["tokens"] for r in steps] == [n * SEQ for n in (epoch * 3)[:20]]  # the micro-batches' tokens
    assert [r["phases"]["forward_backward"]["count"] for r in steps] == ([2] * 6 + [1]) * 2 + [2] * 6
    assert all(r["phases"]["optimizer"]["count"] == 1 for r in steps)


def test_figures_reach_every_on_log_and_the_log_history_whatever_the_callback_order(tmp_path):
    capture = Capture()
    cb = StepprofCallback(log=None)
    # The user put the capturing callback (a report_to backend's stand-in) before stepprof's.
    trainer = Trainer(model=_model(), args=_args(tmp_path), train_dataset=_dataset(64),
                      callbacks=[capture, cb])
    order = list(trainer.callback_handler.callbacks)
    seen: list[list] = []
    capture.on_step_end = lambda *a, **k: seen.append(list(trainer.callback_handler.callbacks))
    trainer.train()
    assert trainer.callback_handler.callbacks == order and seen and all(o == order for o in seen)
    assert not {"training_step", "get_batch_samples", "log"} & set(vars(trainer))  # unwrapped
    logged = [logs for logs in capture.logs if "loss" in logs]
    assert len(logged) == 4  # logging_steps=5 over 20 steps
    for logs in logged:
        assert logs["stepprof/wall_ms"] > 0 and logs["stepprof/steps"] == 5  # all finished (CPU)
        assert type(logs["stepprof/steps"]) is int
        assert logs["stepprof/phases/forward_backward/wall_ms"] > 0
        assert logs["stepprof/phases/optimizer/wall_ms"] > 0
        assert logs["stepprof/samples_per_s"] > 0
        assert logs["stepprof/tokens_per_s"] == pytest.approx(logs["stepprof/samples_per_s"] * SEQ)
        assert "stepprof/gpu_ms" not in logs  # null on CPU: left out, never a fake figure
    history = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["stepprof/wall_ms"] for h in history] == [logs["stepprof/wall_ms"] for logs in logged]
    assert "stepprof/steps" not in capture.logs[-1]  # the final train log: no step since the last


def test_figures_reach_a_report_to_backend_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = _args(tmp_path, report_to=["tensorboard"])
    trainer = Trainer(model=_model(), args=args, train_dataset=_dataset(64),
                      callbacks=[StepprofCallback(log=None)])
    trainer.train()
    runs = [d for d, _, files in os.walk(tmp_path) if any("tfevents" in f for f in files)]
    assert runs
    acc = EventAccumulator(runs[0])
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "train/stepprof/wall_ms" in tags and "train/stepprof/phases/optimizer/wall_ms" in tags
    assert [e.step for e in acc.Scalars("train/stepprof/wall_ms")] == [5, 10, 15, 20]


def test_data_wait_holds_the_fetch_of_the_steps_micro_batches(tmp_path):
    class Slow(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.items = _dataset(32)
            self.fetched = 0

        def __len__(self) -> int:
            return len(self.items)

        def __getitem__(self, i):
            self.fetched += 1
            time.sleep(0.005)
            return self.items[i]

    log = tmp_path / "run.jsonl"
    data = Slow()
    trainer = Trainer(model=_model(), args=_args(tmp_path, max_steps=6, gradient_accumulation_steps=2),
                      train_dataset=data, callbacks=[StepprofCallback(log=str(log))])
    trainer.train()
    steps = _records(log)
    assert len(steps) == 6
    # accelerate's loader fetches one batch ahead, so one step's fetch may hold 1 to 3 batches;
    # over the run, data_ms holds every sample's 5 ms, and data_wait_ms holds data_ms.
    assert sum(r["data_ms"] for r in steps) >= 0.95 * data.fetched * 5
    assert all(r["data_wait_ms"] >= r["data_ms"] >= 4 * 5 for r in steps[1:])


def test_an_exception_in_training_step_records_the_step_and_closes_the_profiler(tmp_path):
    class Boom(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            if self.state.global_step == 3:
                raise ValueError("boom in step 3")
            return super().training_step(model, inputs, num_items_in_batch)

    log = tmp_path / "run.jsonl"
    cb = StepprofCallback(log=str(log))
    trainer = Boom(model=_model(), args=_args(tmp_path), train_dataset=_dataset(64), callbacks=[cb])
    with pytest.raises(ValueError, match="boom in step 3"):
        trainer.train()
    assert cb.profiler.closed and cb.summary.ended_by == "exception"
    steps = _records(log)
    assert [r["step"] for r in steps] == [0, 1, 2, 3]
    assert steps[3]["error"]["type"] == "ValueError" and steps[2]["error"] is None
    assert len(_records(log, "summary")) == 1
    assert "training_step" not in vars(trainer)
    # The same callback profiles the next train() as a new run.
    ok = Trainer(model=_model(), args=_args(tmp_path, max_steps=3), train_dataset=_dataset(64), callbacks=[cb])
    ok.train()
    assert cb.summary.measured_steps == 3 and cb.summary.ended_by == "close"
    assert len({r["run_id"] for r in _records(log)}) == 2


def test_an_exception_outside_training_step_leaves_the_step_open_until_the_next_train(tmp_path):
    model = _model()

    class Failing(torch.optim.AdamW):
        steps = 0

        def step(self, closure=None):
            Failing.steps += 1
            if Failing.steps == 3:
                raise RuntimeError("optimizer broke")
            return super().step(closure)

    log = tmp_path / "run.jsonl"
    cb = StepprofCallback(log=str(log))
    trainer = Trainer(model=model, args=_args(tmp_path), train_dataset=_dataset(64), callbacks=[cb],
                      optimizers=(Failing(model.parameters(), lr=1e-4), None))
    with pytest.raises(RuntimeError, match="optimizer broke"):
        trainer.train()
    assert not cb.profiler.closed  # the Trainer has no exception hook: the step is still open
    # A sweep meanwhile runs the Trainer's own training_step, not into the open step.
    Failing.steps = -100
    sweep(trainer, **_sweep_options())
    first = cb.profiler
    Failing.steps = -100
    trainer.args.max_steps = 2
    trainer.train()  # the next train() closes the old profiler, then profiles anew
    assert first.closed and first.summary.ended_by == "exception" and cb.summary.ended_by == "close"
    old = [r for r in _records(log) if r["run_id"] == _records(log)[0]["run_id"]]
    assert [r["step"] for r in old] == [0, 1, 2]
    assert old[2]["error"]["message"] == "profiler closed while the step was open"
    assert old[2]["phases"]["forward_backward"]["count"] == 1  # nothing from the sweep
    assert len(_records(log, "summary")) == 2


def test_an_internal_failure_is_a_warning_and_training_goes_on(tmp_path, monkeypatch):
    log = tmp_path / "run.jsonl"
    cb = StepprofCallback(log=str(log))
    trainer = Trainer(model=_model(), args=_args(tmp_path, max_steps=6), train_dataset=_dataset(64), callbacks=[cb])

    calls = {"n": 0}
    real = stepprof.Profiler.begin_phase

    def flaky(self, name):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("stepprof bug")
        return real(self, name)

    monkeypatch.setattr(stepprof.Profiler, "begin_phase", flaky)
    with pytest.warns(RuntimeWarning, match="stopped profiling after an internal error.*stepprof bug"):
        out = trainer.train()
    assert out.global_step == 6  # training went on
    assert cb.profiler.closed and "training_step" not in vars(trainer)
    assert len(_records(log, "summary")) == 1


def test_bad_options_raise_at_construction():
    with pytest.raises(stepprof.ConfigError, match="warmup"):
        StepprofCallback(log=None, warmup=-1)
    with pytest.raises(stepprof.UsageError, match="did you mean 'warmup'"):
        StepprofCallback(log=None, wramup=2)
    with pytest.raises(stepprof.ConfigError, match="on_sync"):
        StepprofCallback(log=None, on_sync="explode")


def test_hooks_alone_without_a_trainer_give_hook_phases_and_no_batch_size(tmp_path):
    """Hooks called by a loop that is not a Trainer's: the phases the hooks delimit, and
    batch_size null with the reason (the callback never saw a batch)."""
    log = tmp_path / "run.jsonl"
    cb = StepprofCallback(log=str(log))
    args, state, control = _args(tmp_path), transformers.TrainerState(), transformers.TrainerControl()
    cb.on_train_begin(args, state, control)
    for _ in range(3):
        cb.on_step_begin(args, state, control)
        time.sleep(0.001)
        cb.on_substep_end(args, state, control)  # a second micro-batch
        time.sleep(0.001)
        cb.on_pre_optimizer_step(args, state, control)
        cb.on_optimizer_step(args, state, control)
        cb.on_step_end(args, state, control)
    cb.on_train_end(args, state, control)
    steps = _records(log)
    assert len(steps) == 3
    for r in steps:
        assert r["batch_size"] is None and "not called from a transformers.Trainer" in r["unavailable"]["batch_size"]
        assert r["phases"]["forward_backward"]["count"] == 2 and r["phases"]["optimizer"]["count"] == 1


# -- the sweep --------------------------------------------------------------------------------------


def _state_bytes(trainer) -> list[tuple[str, bytes]]:
    out = [(n, p.detach().numpy().tobytes()) for n, p in trainer.model.state_dict().items()]
    if trainer.optimizer is not None:
        for pid, st in trainer.optimizer.state_dict()["state"].items():
            for k, v in st.items():
                out.append((f"opt.{pid}.{k}", v.numpy().tobytes() if torch.is_tensor(v) else repr(v).encode()))
    return out


def _sweep_options() -> dict:
    return dict(max_batch=8, progress=False, warmup=0, steps=1, min_time_s=0.0)


def test_sweep_returns_a_result_and_leaves_weights_and_optimizer_state_byte_identical(tmp_path):
    trainer = Trainer(model=_model(), args=_args(tmp_path, max_steps=2), train_dataset=_dataset(20))
    trainer.train()  # the optimizer now has state (AdamW's moments)
    assert trainer.optimizer is not None and trainer.optimizer.state_dict()["state"]
    trainer.model.eval()  # the sweep trains; the module's mode comes back too
    before = _state_bytes(trainer)
    loop_value = vars(trainer).get("current_gradient_accumulation_steps", "unset")  # newer Trainers' loops set it
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    opt_state = {pid: {k: v.clone() for k, v in st.items() if torch.is_tensor(v)}
                 for pid, st in trainer.optimizer.state_dict()["state"].items()}
    result = sweep(trainer, log=str(tmp_path / "sweep.jsonl"), **_sweep_options())
    assert isinstance(result, stepprof.SweepResult)
    assert result.max_fit == 8 and result.recommended in [p.batch_size for p in result.points]
    assert not any(p.oom for p in result.points) and result.points[-1].batch_size == 8
    assert _state_bytes(trainer) == before
    for n, p in trainer.model.named_parameters():
        assert torch.equal(p, params[n])
    for pid, st in trainer.optimizer.state_dict()["state"].items():
        for k, v in opt_state[pid].items():
            assert torch.equal(st[k], v)
    assert _records(tmp_path / "sweep.jsonl", "sweep_result")
    assert trainer.model.training is False
    # the loop's value put back (set, on the Trainers whose loop sets it), or still unset
    assert vars(trainer).get("current_gradient_accumulation_steps", "unset") == loop_value


def test_sweep_creates_the_optimizer_if_needed_and_drops_it_then_apply_sets_the_batch_size(tmp_path):
    trainer = Trainer(model=_model(), args=_args(tmp_path, max_steps=3), train_dataset=_dataset(40))
    assert trainer.optimizer is None
    before = _state_bytes(trainer)
    result = sweep(trainer, apply=True, **_sweep_options())
    assert trainer.optimizer is None and not hasattr(trainer, "current_gradient_accumulation_steps")
    assert _state_bytes(trainer) == before
    assert result.recommended is not None
    assert trainer.args.per_device_train_batch_size == result.recommended
    assert trainer._train_batch_size == result.recommended
    # The next train() runs at that batch size.
    log = tmp_path / "run.jsonl"
    trainer.add_callback(StepprofCallback(log=str(log)))
    trainer.train()
    assert [r["batch_size"] for r in _records(log)] == [result.recommended] * 3


def test_sweep_refuses_what_it_cannot_do(tmp_path):
    trainer = Trainer(model=_model(), args=_args(tmp_path), train_dataset=_dataset(8))
    with pytest.raises(stepprof.UsageError, match="takes a transformers.Trainer"):
        sweep(object())
    with pytest.raises(stepprof.ConfigError, match="takes no 'restore'"):
        sweep(trainer, restore=trainer.model)
    with pytest.raises(stepprof.ConfigError, match="'apply' must be True or False"):
        sweep(trainer, apply="yes")
    with pytest.raises(stepprof.UsageError, match="unknown option 'max_bach'; did you mean 'max_batch'"):
        sweep(trainer, max_bach=8)
    empty = Trainer(model=_model(), args=_args(tmp_path), train_dataset=None)
    with pytest.raises(stepprof.ConfigError, match="train_dataset"):
        sweep(empty)


def test_import_stepprof_leaves_the_frameworks_out():
    code = (
        "import sys, stepprof, stepprof.integrations; "
        "bad = [m for m in ('transformers', 'lightning', 'pytorch_lightning', 'accelerate') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stdout + out.stderr


def test_sweep_batches_from_an_iterable_dataset_with_a_length_read_it_on(tmp_path):
    from stepprof.integrations.transformers import _batch_maker

    class Stream(torch.utils.data.IterableDataset):
        def __init__(self) -> None:
            self.items = _dataset(3)

        def __iter__(self):
            return iter(self.items)

        def __len__(self) -> int:  # a length does not make it indexable
            return 3

    data = Stream()
    trainer = Trainer(model=_model(), args=_args(tmp_path), train_dataset=data)
    make = _batch_maker(trainer, data)
    ids = [item["input_ids"] for item in data.items]
    assert torch.equal(make(2)["input_ids"], torch.stack(ids[:2]))
    assert torch.equal(make(3)["input_ids"], torch.stack([ids[2], ids[0], ids[1]]))  # on, then over


def test_on_sync_raise_from_a_step_end_propagates_and_closes_the_profiler(tmp_path, monkeypatch):
    """A SyncBudgetExceeded raised at a step's end (the "trace" route defers it there) reaches
    the user, and the run is closed and the Trainer unwrapped first: the Trainer has no
    exception hook that would do it later."""
    log = tmp_path / "run.jsonl"
    cb = StepprofCallback(log=str(log), max_syncs=0, on_sync="raise")
    trainer = Trainer(model=_model(), args=_args(tmp_path), train_dataset=_dataset(64), callbacks=[cb])
    real = stepprof.Profiler.end_step
    ended = []

    def end_step(self, error=None):
        real(self, error)
        ended.append(1)
        if len(ended) == 3:
            raise stepprof.SyncBudgetExceeded("over budget", where="x.py:1", kind="item", count=1)

    monkeypatch.setattr(stepprof.Profiler, "end_step", end_step)
    with pytest.raises(stepprof.SyncBudgetExceeded, match="over budget"):
        trainer.train()
    assert cb.profiler.closed and cb.summary.ended_by == "exception"
    assert "training_step" not in vars(trainer) and "get_batch_samples" not in vars(trainer)
    assert len(_records(log)) == 3 and len(_records(log, "summary")) == 1


def test_a_training_step_set_on_the_trainer_instance_is_wrapped_and_put_back(tmp_path):
    log = tmp_path / "run.jsonl"
    trainer = Trainer(model=_model(), args=_args(tmp_path, max_steps=4), train_dataset=_dataset(32),
                      callbacks=[StepprofCallback(log=str(log))])
    calls = []
    own = trainer.training_step  # the class's, bound

    def patched(*args, **kwargs):  # as a library that patches the instance would
        calls.append(1)
        return own(*args, **kwargs)

    trainer.training_step = patched
    trainer.train()
    assert len(calls) == 4  # the wrapper called it
    assert vars(trainer)["training_step"] is patched  # and put it back, not deleted it
    assert all(r["phases"]["forward_backward"]["count"] == 1 for r in _records(log))


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("with_stepprof", [False, True])
def test_a_full_log_disk_under_warnings_as_errors_trains_every_step(tmp_path, capfd, with_stepprof):
    """Warnings as errors, the Trainer's own warnings let through as a project would: the same
    train() runs every step without stepprof (the control) and with a callback whose log is on a
    full disk, and leaves training_step unwrapped."""
    import warnings

    callbacks = [StepprofCallback(log="/dev/full")] if with_stepprof else []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", module="(transformers|accelerate|torch)")
        trainer = Trainer(model=_model(), args=_args(tmp_path, max_steps=12), train_dataset=_dataset(64),
                          callbacks=callbacks)
        trainer.train()
    assert trainer.state.global_step == 12
    assert "training_step" not in vars(trainer)  # the callback's wrapper is gone
    if with_stepprof:
        err = capfd.readouterr().err
        assert "StepprofWarning" in err and "/dev/full" in err
