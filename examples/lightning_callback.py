"""Lightning: StepprofCallback profiles Trainer.fit, and the knee-aware sweep sets the batch size.

    python examples/lightning_callback.py [LOG]     # needs: pip install 'stepprof[lightning]'
"""

import sys

import torch
from torch.utils.data import DataLoader, Dataset

import lightning.pytorch as pl
from stepprof.integrations.lightning import StepprofCallback, sweep

log = sys.argv[1] if len(sys.argv) > 1 else "lightning.jsonl"


class Points(Dataset):
    """Random points, labelled by which side of a fixed plane they fall (real data, not zeros)."""

    def __init__(self, n: int = 4096, dim: int = 32) -> None:
        self.x = torch.randn(n, dim)
        self.y = (self.x @ torch.randn(dim) > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class Classifier(pl.LightningModule):
    def __init__(self, batch_size: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters()  # the sweep's apply=True sets hparams.batch_size
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(Points(), batch_size=self.hparams.batch_size, shuffle=True)


model = Classifier()
quiet = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
# 1. The batch size: the knee of samples/s, outside the allocator's thrash zone (weights restored).
trainer = pl.Trainer(accelerator="auto", devices=1, **quiet)
result = sweep(trainer, model, max_batch=1024, apply=True, progress=False)
print(f"sweep: recommended batch {result.recommended} ({result.reason})")

# 2. Training under the callback: one step record per optimizer step, phases from Lightning's hooks.
callback = StepprofCallback(log, warmup=5)
trainer = pl.Trainer(accelerator="auto", devices=1, max_steps=60, callbacks=[callback], **quiet)
trainer.fit(model)
print(callback.summary)
print(f"next: stepprof report {log}; stepprof plot {log}")
