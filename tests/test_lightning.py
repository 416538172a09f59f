"""stepprof.integrations.lightning: the callback in a real Trainer.fit on the CPU, and the sweep."""

from __future__ import annotations

import copy
import csv
import glob
import json
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

import stepprof  # noqa: E402
from stepprof._rules import span_ms  # noqa: E402
from stepprof.integrations import lightning as sl  # noqa: E402

STEPS = 20
BATCH = 4


class Samples(torch.utils.data.Dataset):
    """Random regression samples; ``sleep_s`` per sample makes a slow loader."""

    def __init__(self, n: int = 512, sleep_s: float = 0.0) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)
        self.sleep_s = sleep_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return self.x[i], self.y[i]


class Tiny(pl.LightningModule):
    def __init__(self, batch_size: int = BATCH, fail_at: int | None = None, sleep_s: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        if self.hparams.fail_at is not None and batch_idx == self.hparams.fail_at:
            raise ValueError("bad batch")
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(Samples(sleep_s=self.hparams.sleep_s), batch_size=self.hparams.batch_size)


class Manual(Tiny):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()


class Data(pl.LightningDataModule):
    def __init__(self, batch_size: int = BATCH) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        return torch.utils.data.DataLoader(Samples(), batch_size=self.batch_size)


def trainer(tmp_path, callbacks=(), *, logger=False, **kw) -> pl.Trainer:
    kw.setdefault("max_steps", STEPS)
    kw.setdefault("devices", 1)
    return pl.Trainer(
        accelerator="cpu", logger=logger, log_every_n_steps=5, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False, callbacks=list(callbacks),
        default_root_dir=str(tmp_path), **kw,
    )


def records(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]  # every line whole


def step_records(path) -> list[dict]:
    return [r for r in records(path) if r["kind"] == "step"]


@pytest.fixture(autouse=True)
def quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")
        warnings.filterwarnings("ignore", message=".*(LeafSpec|num_workers|litlogger).*")
        yield


# -- the callback -------------------------------------------------------------------------------


@pytest.mark.parametrize("accumulate", [1, 2])
def test_one_record_per_optimizer_step_with_its_phases(tmp_path, accumulate):
    log = str(tmp_path / "run.jsonl")
    cb = sl.StepprofCallback(log, warmup=2)
    trainer(tmp_path, [cb], accumulate_grad_batches=accumulate).fit(Tiny())
    steps = step_records(log)
    assert len(steps) == STEPS  # max_steps counts optimizer steps
    assert cb.profiler.closed and cb.summary.measured_steps == STEPS - 2
    for r in steps:
        assert r["error"] is None
        assert r["batch_size"] == BATCH * accumulate
        phases = r["phases"]
        assert {"forward", "backward", "optimizer"} <= set(phases)
        assert phases["forward"]["count"] == phases["backward"]["count"] == accumulate
        assert phases["optimizer"]["count"] == 1
        assert all(p["wall_ms"] > 0 for p in phases.values())
        if accumulate > 1:
            assert phases[sl.BETWEEN]["count"] == accumulate - 1
        else:
            assert sl.BETWEEN not in phases
        inner = sum(p["wall_ms"] for p in phases.values())
        assert inner <= r["wall_ms"] * 1.001
        assert r["gpu_ms"] is None  # accelerator="cpu": the callback profiles the trainer's device
        assert r["samples_per_s"] == pytest.approx(r["batch_size"] / (span_ms(r["wall_ms"], r["gpu_ms"]) / 1e3), rel=1e-6)


def test_the_figures_reach_the_lightning_logger(tmp_path):
    cb = sl.StepprofCallback(None)
    trainer(tmp_path, [cb], logger=CSVLogger(str(tmp_path), name="csv")).fit(Tiny())
    (path,) = glob.glob(str(tmp_path / "csv" / "**" / "metrics.csv"), recursive=True)
    with open(path) as f:
        rows = list(csv.DictReader(f))
    ours = [r for r in rows if r.get("stepprof/wall_ms")]
    assert ours, "no stepprof/wall_ms row"
    assert all(float(r["stepprof/wall_ms"]) > 0 and float(r["stepprof/steps"]) >= 1 for r in ours)
    assert all(float(r["stepprof/phases/forward/wall_ms"]) > 0 for r in ours)
    # logged at Lightning's logging steps (every 5), each window holding the 5 steps since the
    # last: on the CPU every step is complete when its window is logged, none lags behind
    assert [(int(r["step"]), float(r["stepprof/steps"])) for r in ours] == [(4, 5), (9, 5), (14, 5), (19, 5)]


def test_data_wait_is_the_wait_for_the_next_batch(tmp_path):
    log = str(tmp_path / "run.jsonl")
    sleep_s = 0.005  # per sample: 20 ms per batch of 4
    trainer(tmp_path, [sl.StepprofCallback(log)], max_steps=6).fit(Tiny(sleep_s=sleep_s))
    waits = [r["data_wait_ms"] for r in step_records(log)[1:]]
    assert len(waits) == 5 and min(waits) >= 0.9 * BATCH * sleep_s * 1e3
    fast = str(tmp_path / "fast.jsonl")
    trainer(tmp_path, [sl.StepprofCallback(fast)], max_steps=6).fit(Tiny())
    assert max(r["data_wait_ms"] for r in step_records(fast)[1:]) < 0.5 * BATCH * sleep_s * 1e3


def test_an_exception_in_training_step_closes_the_profiler_with_a_whole_log(tmp_path):
    log = str(tmp_path / "run.jsonl")
    cb = sl.StepprofCallback(log)
    with pytest.raises(ValueError, match="bad batch"):
        trainer(tmp_path, [cb]).fit(Tiny(fail_at=5))
    assert cb.profiler.closed
    recs = records(log)
    steps = [r for r in recs if r["kind"] == "step"]
    assert len(steps) == 6 and all(r["error"] is None for r in steps[:5])
    assert steps[5]["error"] == {"type": "ValueError", "message": "bad batch"}
    assert recs[-1]["kind"] == "summary" and recs[-1]["ended_by"] == "exception"


def test_manual_optimization_gets_one_record_per_training_batch(tmp_path):
    log = str(tmp_path / "run.jsonl")
    trainer(tmp_path, [sl.StepprofCallback(log)], max_steps=8).fit(Manual())
    steps = step_records(log)
    assert len(steps) == 8
    for r in steps:
        assert r["batch_size"] == BATCH
        assert set(r["phases"]) == {"forward", "backward"}  # no hook marks a manual step's end
        assert r["phases"]["backward"]["count"] == 1


def test_an_internal_failure_is_a_warning_and_training_goes_on(tmp_path, monkeypatch):
    log = str(tmp_path / "run.jsonl")
    cb = sl.StepprofCallback(log)
    model = Tiny()
    seen = []

    def broken(name):
        raise RuntimeError("stepprof bug")

    start = cb.on_train_start

    def on_train_start(trainer, pl_module):
        start(trainer, pl_module)
        monkeypatch.setattr(cb.profiler, "begin_phase", broken)

    monkeypatch.setattr(cb, "on_train_start", on_train_start)
    monkeypatch.setattr(model, "on_train_batch_end", lambda *a: seen.append(1))
    with pytest.warns(RuntimeWarning, match=r"stopped profiling after an error in on_train_batch_start .*stepprof bug"):
        trainer(tmp_path, [cb], max_steps=5).fit(model)
    assert len(seen) == 5 and cb.profiler.closed  # every batch trained; the log closed
    assert records(log)[-1]["kind"] == "summary"


def test_bad_options_raise_at_construction():
    with pytest.raises(stepprof.UsageError, match="unknown option 'warmpu'; did you mean 'warmup'"):
        sl.StepprofCallback(None, warmpu=3)
    with pytest.raises(stepprof.ConfigError, match="'warmup'"):
        sl.StepprofCallback(None, warmup=-1)
    with pytest.raises(stepprof.ConfigError, match="'syncs'"):
        sl.StepprofCallback(None, syncs="sometimes")


def test_import_stepprof_imports_no_framework():
    code = (
        "import sys, stepprof, stepprof.integrations; "
        "bad = [m for m in ('lightning', 'pytorch_lightning', 'transformers') if m in sys.modules]; "
        "assert not bad, bad"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)  # orjson may live there
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": path})


# -- the sweep ----------------------------------------------------------------------------------


def _state(model: torch.nn.Module, optimizers) -> list[tuple[str, torch.Tensor]]:
    out = [(f"param:{k}", v.detach().clone()) for k, v in model.state_dict().items()]
    out += [(f"grad:{k}", p.grad.clone()) for k, p in model.named_parameters() if p.grad is not None]
    for i, o in enumerate(optimizers):
        for pid, state in o.state_dict()["state"].items():
            out += [(f"opt{i}:{pid}:{k}", copy.deepcopy(v)) for k, v in state.items() if isinstance(v, torch.Tensor)]
    return out


def _identical(a, b) -> bool:
    return [k for k, _ in a] == [k for k, _ in b] and all(
        x.dtype == y.dtype and x.device == y.device and torch.equal(x, y)
        and x.cpu().numpy().tobytes() == y.cpu().numpy().tobytes()
        for (_, x), (_, y) in zip(a, b)
    )


def test_the_sweep_returns_a_result_and_leaves_model_and_optimizer_byte_identical(tmp_path):
    model = Tiny()
    t = trainer(tmp_path, max_steps=1)
    t.fit(model)  # one step: Adam's state is not empty
    assert t.optimizers and t.optimizers[0].state
    model.eval()
    before = _state(model, t.optimizers)
    assert any(k.startswith("opt0:") for k, _ in before)
    result = sl.sweep(t, model, max_batch=32, progress=False, log=str(tmp_path / "sweep.jsonl"))
    assert isinstance(result, stepprof.SweepResult)
    assert result.recommended is not None and [p.batch_size for p in result.points][0] == 1
    assert max(p.batch_size for p in result.points) == 32
    assert _identical(before, _state(model, t.optimizers))
    assert not model.training and "log" not in model.__dict__  # mode back, self.log unmuted
    kinds = [r["kind"] for r in records(tmp_path / "sweep.jsonl")]
    assert kinds[-1] == "sweep_result" and kinds.count("sweep_point") == len(result.points)


def test_the_sweep_before_a_fit_uses_configure_optimizers_and_detaches_the_trainer(tmp_path):
    model = Tiny()
    before = _state(model, [])
    result = sl.sweep(trainer(tmp_path), model, max_batch=8, progress=False)
    assert result.recommended in {p.batch_size for p in result.points}
    assert model._trainer is None
    assert _identical(before, _state(model, []))


def test_the_sweep_restores_what_restore_adds_given_as_a_list_as_stepprof_sweep_takes_it(tmp_path):
    model = Tiny()
    other = torch.nn.Linear(2, 2)
    before = other.weight.detach().clone()

    def step(self, batch, batch_idx):  # a step that also trains a module outside the model
        other.weight.data.add_(1.0)
        return Tiny.training_step(self, batch, batch_idx)

    model.training_step = step.__get__(model)
    sl.sweep(trainer(tmp_path), model, max_batch=4, progress=False, restore=[other])
    assert torch.equal(other.weight, before)


def test_apply_sets_the_batch_size_where_lightning_reads_it(tmp_path):
    model, data = Tiny(batch_size=2), Data(batch_size=2)
    result = sl.sweep(trainer(tmp_path), model, data, max_batch=16, progress=False, apply=True)
    assert result.recommended is not None
    assert model.hparams.batch_size == data.batch_size == result.recommended


def test_apply_without_a_batch_size_attribute_raises_before_sweeping(tmp_path):
    class NoBatch(Tiny):
        def __init__(self):
            pl.LightningModule.__init__(self)
            self.net = torch.nn.Linear(8, 1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(Samples(), batch_size=4)

    with pytest.raises(stepprof.ConfigError, match=r"apply=True, but neither the model.*has 'batch_size'"):
        sl.sweep(trainer(tmp_path), NoBatch(), apply=True, progress=False)
    with pytest.raises(stepprof.UsageError, match="unknown option 'max_bach'"):
        sl.sweep(trainer(tmp_path), Tiny(), max_bach=8)
    with pytest.raises(stepprof.ConfigError, match="automatic optimization"):
        sl.sweep(trainer(tmp_path), Manual())


def test_make_batch_draws_real_samples_cycling_through_the_dataset(tmp_path):
    loader = torch.utils.data.DataLoader(Samples(n=5), batch_size=2)
    make = sl._batch_maker(loader, Tiny(), torch.device("cpu"))
    x, y = make(12)
    assert x.shape == (12, 8) and y.shape == (12, 1)
    assert torch.equal(x[:5], loader.dataset.x) and torch.equal(x[5:10], loader.dataset.x)


def test_make_batch_reads_an_iterable_dataset_on_and_starts_over_at_its_end():
    class Four(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([(torch.full((8,), float(i)), torch.zeros(1)) for i in range(4)])

        def __len__(self) -> int:  # a length does not make it indexable
            return 4

    make = sl._batch_maker(torch.utils.data.DataLoader(Four(), batch_size=2), Tiny(), torch.device("cpu"))
    assert make(4)[0][:, 0].tolist() == [0, 1, 2, 3]  # the iterator is now at its end
    assert make(2)[0][:, 0].tolist() == [0, 1]  # started over, not "no sample"
    assert make(5)[0][:, 0].tolist() == [2, 3, 0, 1, 2]

    class Empty(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(())

    empty = sl._batch_maker(torch.utils.data.DataLoader(Empty(), batch_size=2), Tiny(), torch.device("cpu"))
    with pytest.raises(stepprof.ConfigError, match="train dataset has no sample"):
        empty(2)


@pytest.mark.parametrize("conf, n", [
    ("opt", 1), ("list", 1), ("dict", 1), ("lists", 1), ("dicts", 2), (None, 0),
])
def test_the_optimizers_of_each_configure_optimizers_form(conf, n):
    p = torch.nn.Parameter(torch.ones(1))
    opt, opt2 = torch.optim.SGD([p], lr=0.1), torch.optim.SGD([p], lr=0.2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    forms = {
        "opt": opt, "list": [opt], "dict": {"optimizer": opt, "lr_scheduler": sched},
        "lists": ([opt], [sched]), "dicts": ({"optimizer": opt}, {"optimizer": opt2}), None: None,
    }
    got = sl._optimizers_of(forms[conf])
    assert len(got) == n and all(isinstance(o, torch.optim.Optimizer) for o in got)


def test_under_ddp_each_rank_writes_its_log_and_rank_zero_logs_the_figures(tmp_path):
    """Two CPU processes (gloo, ddp_spawn): stepprof's distributed support, through Lightning."""
    cb = sl.StepprofCallback(str(tmp_path / "run.jsonl"), ranks_every=5)
    t = trainer(tmp_path, [cb], logger=CSVLogger(str(tmp_path), name="csv"), max_steps=10,
                devices=2, strategy="ddp_spawn")
    t.fit(Tiny())
    for rank in (0, 1):
        recs = records(tmp_path / f"run.rank{rank}.jsonl")
        steps = [r for r in recs if r["kind"] == "step"]
        assert len(steps) == 10 and all(r["rank"] == rank and r["world_size"] == 2 for r in steps)
        assert recs[-1]["kind"] == "summary"
    assert any(r["kind"] == "ranks" for r in records(tmp_path / "run.rank0.jsonl"))
    (path,) = glob.glob(str(tmp_path / "csv" / "**" / "metrics.csv"), recursive=True)
    with open(path) as f:
        assert any(r.get("stepprof/wall_ms") for r in csv.DictReader(f))


def test_the_finders_bench_runs_on_the_cpu(tmp_path, monkeypatch):
    """bench/finders_lightning.py --quick: the script itself (its figures mean nothing on the CPU)."""
    import inspect

    from lightning.pytorch.tuner import Tuner

    if "max_val" not in inspect.signature(Tuner.scale_batch_size).parameters:
        pytest.skip("the bench bounds Lightning's finder with scale_batch_size(max_val=), new in Lightning 2.6")
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
    monkeypatch.syspath_prepend(bench)
    import importlib

    mod = importlib.import_module("finders_lightning")
    out = tmp_path / "finders.json"
    monkeypatch.setattr(sys, "argv", ["finders_lightning.py", "--quick", "--max-batch", "8", "--repeats", "1",
                                      "--time-s", "0.01", "--out", str(out)])
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    with warnings.catch_warnings():
        assert mod.main() == 0
    got = json.loads(out.read_text())
    assert [f["finder"] for f in got["finders"]] == ["lightning-power", "lightning-binsearch", "stepprof"]
    assert all(f["picked"] and f["wall_s"] > 0 and f["samples_per_s"] for f in got["finders"])


def test_on_sync_raise_from_a_step_end_stops_the_fit_and_closes_the_profiler(tmp_path, monkeypatch):
    """A SyncBudgetExceeded that the step raises at its end (the "trace" route's, deferred
    there) is the user's: it ends the fit as any exception does, not as an internal failure."""
    log = str(tmp_path / "run.jsonl")
    cb = sl.StepprofCallback(log, max_syncs=0, on_sync="raise")
    start = cb.on_train_start

    def on_train_start(trainer, pl_module):
        start(trainer, pl_module)
        real = cb.profiler.end_step

        def end_step(error=None):
            real(error)
            if len(records_seen) == 2:
                raise stepprof.SyncBudgetExceeded("over budget", where="x.py:1", kind="item", count=1)
            records_seen.append(1)

        monkeypatch.setattr(cb.profiler, "end_step", end_step)

    records_seen: list[int] = []
    monkeypatch.setattr(cb, "on_train_start", on_train_start)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "stopped profiling" warning
        with pytest.raises(stepprof.SyncBudgetExceeded, match="over budget"):
            trainer(tmp_path, [cb]).fit(Tiny())
    assert cb.profiler.closed and cb.summary.ended_by == "exception"
    assert len(step_records(log)) == 3 and records(log)[-1]["kind"] == "summary"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("with_stepprof", [False, True])
def test_a_full_log_disk_under_warnings_as_errors_trains_every_step(tmp_path, capfd, with_stepprof):
    """Warnings as errors (pytest's ``filterwarnings = error``), Lightning's own warnings let
    through as a project would: the same fit trains every step without stepprof (the control)
    and with a callback whose log is on a full disk."""
    model = Tiny()
    callbacks = [sl.StepprofCallback("/dev/full")] if with_stepprof else []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", module="lightning")
        warnings.filterwarnings("ignore", message=".*(LeafSpec|num_workers|litlogger).*")
        t = trainer(tmp_path, callbacks)
        t.fit(model)
    assert t.global_step == STEPS
    if with_stepprof:
        err = capfd.readouterr().err
        assert "StepprofWarning" in err and "/dev/full" in err
