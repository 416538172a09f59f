"""stepprof.integrations.lightning on a GPU: a ResNet-18 fit whose step GPU times add up to an
independent CUDA-event span, and the Lightning sweep on it."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")
torchvision = pytest.importorskip("torchvision")

import stepprof  # noqa: E402
from stepprof.integrations import lightning as sl  # noqa: E402

pytestmark = pytest.mark.cuda

WARMUP, STEPS, BATCH, SIDE = 5, 60, 1024, 64  # GPU-bound: the host stays ahead of the GPU


class GpuBatches(torch.utils.data.Dataset):
    """Whole batches of random images already on the GPU: no copy or collation makes the host
    wait on the device between steps, so the GPU stays busy across step boundaries."""

    def __init__(self, n: int) -> None:
        g = torch.Generator(device="cuda").manual_seed(0)
        self.x = torch.randn(4, BATCH, 3, SIDE, SIDE, device="cuda", generator=g)
        self.y = torch.randint(0, 10, (4, BATCH), device="cuda", generator=g)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return self.x[i % 4], self.y[i % 4]


class Images(torch.utils.data.Dataset):
    """Random images of the real shape, one sample at a time (for the sweep)."""

    def __init__(self, n: int = 2048) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 3, SIDE, SIDE, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class ResNet(pl.LightningModule):
    def __init__(self, batch_size: int = BATCH) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torchvision.models.resnet18(weights=None, num_classes=10)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(GpuBatches(STEPS), batch_size=None)


class Data(pl.LightningDataModule):
    def __init__(self, batch_size: int = BATCH) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        return torch.utils.data.DataLoader(Images(), batch_size=self.batch_size)


class Span(pl.Callback):
    """A CUDA event at the first measured step's start (placed before the stepprof callback, so
    its event comes just before the step's) or at the last one's end (placed after it)."""

    def __init__(self, at: str) -> None:
        self.at = at
        self.event: torch.cuda.Event | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.at == "start" and batch_idx == WARMUP:
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.at == "end" and batch_idx == STEPS - 1:
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()


def _trainer(tmp_path, callbacks=(), **kw) -> pl.Trainer:
    return pl.Trainer(
        accelerator="gpu", devices=1, max_steps=STEPS, logger=False, log_every_n_steps=50,
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=list(callbacks), default_root_dir=str(tmp_path), **kw,
    )


@pytest.fixture(autouse=True)
def quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")
        warnings.filterwarnings("ignore", message=".*(LeafSpec|num_workers|litlogger).*")
        yield


def test_the_steps_gpu_time_adds_up_to_an_independent_event_span(tmp_path):
    log = str(tmp_path / "run.jsonl")
    start, end = Span("start"), Span("end")
    cb = sl.StepprofCallback(log, warmup=WARMUP)
    _trainer(tmp_path, [start, cb, end]).fit(ResNet())
    torch.cuda.synchronize()
    span_ms = start.event.elapsed_time(end.event)
    with open(log) as f:
        steps = [r for r in map(json.loads, f) if r["kind"] == "step"]
    assert len(steps) == STEPS
    measured = [r for r in steps if not r["warmup"]]
    assert len(measured) == STEPS - WARMUP
    assert all(r["gpu_ms"] is not None and r["gpu_ms"] > 0 for r in measured)
    assert all(r["batch_size"] == BATCH for r in measured)
    assert all(r["phases"][p]["gpu_ms"] > 0 for r in measured for p in ("forward", "backward", "optimizer"))
    total = sum(r["gpu_ms"] for r in measured)
    print(f"\nstepprof gpu_ms sum {total:.3f} ms, independent event span {span_ms:.3f} ms: {total / span_ms - 1:+.3%}")
    assert total == pytest.approx(span_ms, rel=0.02), (total, span_ms)
    assert cb.summary.measured_steps == STEPS - WARMUP


def test_the_lightning_sweep_on_the_gpu_recommends_a_batch(tmp_path):
    model, data = ResNet(batch_size=32), Data(batch_size=32)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    result = sl.sweep(_trainer(tmp_path), model, data, max_batch=1024, time_budget_s=90,
                      progress=False, apply=True)
    assert isinstance(result, stepprof.SweepResult) and result.device.startswith("cuda")
    assert result.recommended is not None and data.batch_size == result.recommended
    assert all(p.peak_allocated_bytes for p in result.points if not p.oom)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k].cpu()) for k in before)
    assert next(model.parameters()).device.type == "cpu"  # back where it was
