"""On a GPU, Lightning and Hugging Face with gradient accumulation: MFU, TFLOP/s and reserved
memory reach their TensorBoard loggers, and ``stepprof export --tensorboard`` draws at the
framework's own steps (issue 28, items 8 and 10)."""

from __future__ import annotations

import json
import os

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")
pytest.importorskip("transformers")
pytest.importorskip("tensorboard")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from stepprof._export import export_tensorboard  # noqa: E402
from stepprof.integrations import lightning as sl  # noqa: E402
from stepprof.integrations import transformers as st  # noqa: E402

from . import test_transformers as tt  # noqa: E402
from .test_report_cuda import calibrated  # noqa: E402,F401 - the fixture: one `stepprof calibrate`

pytestmark = pytest.mark.cuda

STEPS, ACCUMULATE, BATCH, WIDTH = 12, 2, 256, 2048


def _scalars(root) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for d, _, files in os.walk(root):
        if any("tfevents" in f for f in files):
            acc = EventAccumulator(d, size_guidance={"scalars": 0})
            acc.Reload()
            for tag in acc.Tags()["scalars"]:
                out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out


def _global_steps(log) -> list[int]:
    with open(log) as f:
        return [r["global_step"] for r in map(json.loads, f) if r["kind"] == "step"]


def _check(logged, prefix, log, tmp_path, own_tag, first):
    for name in ("mfu", "tflops_per_s", "reserved_bytes", "peak_allocated_bytes", "gpu_ms"):
        values = [v for _, v in logged[f"{prefix}stepprof/{name}"]]
        assert values and all(v > 0 for v in values), (name, values)
    assert all(0 < v <= 1 for _, v in logged[f"{prefix}stepprof/mfu"])
    assert _global_steps(log) == list(range(first, first + STEPS))
    exported = _scalars(_export(log, tmp_path, first))
    drawn = {s for s, _ in exported["stepprof/wall_ms"]}
    own = {s for s, _ in logged[own_tag]}
    assert own and own <= drawn == set(range(first, first + STEPS))  # stepprof's curves overlay the framework's


def _export(log, tmp_path, first):
    out = tmp_path / f"export-{first}"
    export_tensorboard([str(log)], str(out))
    return out


class Mlp(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(4096, WIDTH, generator=g), torch.randn(4096, 1, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=BATCH, pin_memory=True)


def test_lightning_with_accumulation_logs_mfu_and_reserved_memory_at_its_steps(calibrated, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("STEPPROF_CACHE_DIR", calibrated[1])
    log = tmp_path / "pl.jsonl"
    tb = TensorBoardLogger(str(tmp_path), name="pl")
    trainer = pl.Trainer(accelerator="gpu", devices=1, max_steps=STEPS, accumulate_grad_batches=ACCUMULATE,
                         logger=tb, log_every_n_steps=2, enable_progress_bar=False, enable_checkpointing=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path),
                         callbacks=[sl.StepprofCallback(str(log), warmup=2, flops="auto")])
    trainer.fit(Mlp())
    logged = _scalars(tb.log_dir)
    _check(logged, "", log, tmp_path, "loss", 0)


def test_hugging_face_with_accumulation_logs_mfu_and_reserved_memory_at_its_steps(calibrated, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("STEPPROF_CACHE_DIR", calibrated[1])
    log = tmp_path / "hf.jsonl"
    args = tt._args(tmp_path, max_steps=STEPS, gradient_accumulation_steps=ACCUMULATE, logging_steps=2,
                    use_cpu=False, report_to=["tensorboard"],
                    per_device_train_batch_size=64)
    trainer = tt.Trainer(model=tt._model(), args=args, train_dataset=tt._dataset(2048),
                         callbacks=[st.StepprofCallback(log=str(log), warmup=2, flops="auto")])
    trainer.train()
    logged = _scalars(tmp_path / "out")  # the Trainer's output_dir
    _check(logged, "train/", log, tmp_path, "train/loss", 1)
