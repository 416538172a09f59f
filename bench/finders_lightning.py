"""Lightning's batch-size finder against stepprof's Lightning sweep, on a GPU.

Workload: torchvision's ResNet-50 (weights=None, 1000 classes), SGD with momentum, random
3x224x224 images (a pool of 256 random images, cycled: real values, never zeros) with random
labels, Lightning's automatic optimization at ``--precision``.
Finders, each on the same LightningModule (each restores it) with a fresh Trainer, timed in
wall seconds:
  power      Tuner(trainer).scale_batch_size(model, datamodule=dm, mode="power"): from 2,
             doubling until out of memory, 3 steps per trial (Lightning's defaults)
  binsearch  the same with mode="binsearch": doubling, then binary search to the exact
             boundary, then 5% off (Lightning's margin)
  stepprof   stepprof.integrations.lightning.sweep(trainer, model, dm)
Then samples/s at each pick, measured the same way for all: the batch on the GPU, gc and
empty_cache, 3 warm-up steps, then timed steps between two CUDA events (at least --time-s
seconds), the picks interleaved in rotating order, the median of --repeats; the allocator's
retries over the timed steps are counted.  torch's allocator is capped at --memory-gib with
set_per_process_memory_fraction (a smaller device, so the script stays near four minutes on
an H200; 0 for the whole GPU).  --max-batch caps every finder.

    python bench/finders_lightning.py [--memory-gib 40] [--precision 32-true] [--repeats 3]
                                      [--out bench/results/finders_lightning-h200-DATE.json]
    python bench/finders_lightning.py --quick      # the script itself on the CPU: a tiny CNN
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
import warnings

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.tuner import Tuner  # noqa: E402

from _common import run_info  # noqa: E402  (bench/ is on sys.path when a script in it runs)
from stepprof.integrations import lightning as sl  # noqa: E402


class Images(torch.utils.data.Dataset):
    """``n`` samples cycling through a pool of random images and labels."""

    def __init__(self, side: int, classes: int, n: int = 1 << 16, pool: int = 256) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(pool, 3, side, side, generator=g)
        self.y = torch.randint(0, classes, (pool,), generator=g)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return self.x[i % len(self.x)], self.y[i % len(self.y)]


class Data(pl.LightningDataModule):
    def __init__(self, side: int, classes: int, batch_size: int = 2) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.side, self.classes = side, classes

    def train_dataloader(self):
        return torch.utils.data.DataLoader(Images(self.side, self.classes), batch_size=self.batch_size,
                                           pin_memory=torch.cuda.is_available())


def tiny_cnn(classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes),
    )


class Classifier(pl.LightningModule):
    def __init__(self, quick: bool) -> None:
        super().__init__()
        if quick:
            self.net = tiny_cnn(10)
        else:
            import torchvision

            self.net = torchvision.models.resnet50(weights=None)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def clean() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def make_trainer(args) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu" if args.quick else "gpu", devices=1, precision=args.precision, max_epochs=1,
        logger=False, enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=args.root,
    )


def lightning_finder(model, data, args, mode: str) -> dict:
    clean()
    data.batch_size = 2
    t0 = time.perf_counter()
    picked = Tuner(make_trainer(args)).scale_batch_size(model, datamodule=data, mode=mode, max_val=args.max_batch)
    return {"finder": f"lightning-{mode}", "picked": picked, "wall_s": time.perf_counter() - t0}


def stepprof_finder(model, data, args) -> dict:
    clean()
    t0 = time.perf_counter()
    result = sl.sweep(make_trainer(args), model, data, max_batch=args.max_batch, progress=False)
    wall = time.perf_counter() - t0
    return {
        "finder": "stepprof", "picked": result.recommended, "wall_s": wall, "knee": result.knee,
        "max_fit": result.max_fit, "first_oom": result.first_oom, "trials": result.trials,
        "thrash_zone": list(result.thrash_zone) if result.thrash_zone else None,
        "reason": result.reason,
        "points": [{"batch": p.batch_size, "samples_per_s": p.samples_per_s, "oom": p.oom,
                    "alloc_retries": p.alloc_retries} for p in result.points],
    }


def throughput(model, data, trainer, n: int, args) -> dict:
    """samples/s of ``n``-sample steps: warm-up, then timed steps between two CUDA events."""
    clean()
    device = torch.device("cpu" if args.quick else "cuda")
    with sl._prepared(trainer, model, device) as (optimizers, scaler):
        train_step = sl._train_step(trainer, model, optimizers, scaler)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        batch = None
        try:
            batch = sl._batch_maker(data.train_dataloader(), model, device)(n)
            for _ in range(3):
                train_step(batch)
            sync()
            retries0 = torch.cuda.memory_stats().get("num_alloc_retries", 0) if device.type == "cuda" else 0
            steps, t0 = 0, time.perf_counter()
            start = torch.cuda.Event(enable_timing=True) if device.type == "cuda" else None
            end = torch.cuda.Event(enable_timing=True) if device.type == "cuda" else None
            if start is not None:
                start.record()
            while steps < 5 or time.perf_counter() - t0 < args.time_s:
                train_step(batch)
                steps += 1
            if end is not None:
                end.record()
            sync()
            ms = start.elapsed_time(end) if start is not None else (time.perf_counter() - t0) * 1e3
            retries = (torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries0) if device.type == "cuda" else 0
            return {"samples_per_s": n * steps / (ms / 1e3), "steps": steps, "alloc_retries": retries, "oom": False}
        except torch.OutOfMemoryError:
            return {"samples_per_s": None, "steps": 0, "alloc_retries": None, "oom": True}
        finally:
            del batch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the script on the CPU: a tiny CNN, 32x32, max batch 64")
    ap.add_argument("--memory-gib", type=float, default=40.0, help="cap torch's allocator (0: the whole GPU)")
    ap.add_argument("--precision", default="32-true", help="Lightning's precision, e.g. 32-true or bf16-mixed")
    ap.add_argument("--max-batch", type=int, default=None, help="every finder's largest batch (default 8192, --quick 64)")
    ap.add_argument("--repeats", type=int, default=3, help="throughput measurements per pick (median)")
    ap.add_argument("--time-s", type=float, default=None, help="least timed seconds per measurement (default 2, --quick 0.2)")
    ap.add_argument("--out", default=None, help="the JSON result (default bench/results/finders_lightning-<date>.json; "
                                                "none with --quick)")
    args = ap.parse_args()
    args.max_batch = args.max_batch or (64 if args.quick else 8192)
    args.time_s = args.time_s if args.time_s is not None else (0.2 if args.quick else 2.0)
    args.root = os.path.join(os.environ.get("TMPDIR", "/tmp"), "finders_lightning")
    warnings.filterwarnings("ignore", module="lightning")
    warnings.filterwarnings("ignore", message=".*(LeafSpec|num_workers|litlogger).*")
    if not args.quick:
        if not torch.cuda.is_available():
            print("no GPU: run with --quick for the CPU smoke test", file=sys.stderr)
            return 2
        if args.memory_gib:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_gib * 2**30 / total))
    side, classes = (32, 10) if args.quick else (224, 1000)
    torch.manual_seed(0)
    model, data = Classifier(args.quick), Data(side, classes)

    t_start = time.perf_counter()
    finders = [lightning_finder(model, data, args, "power"), lightning_finder(model, data, args, "binsearch"),
               stepprof_finder(model, data, args)]
    for f in finders:
        print(f"{f['finder']:>20}: picked {f['picked']} in {f['wall_s']:.1f} s", flush=True)

    picks = sorted({f["picked"] for f in finders if f["picked"]})
    measured: dict[int, list[dict]] = {n: [] for n in picks}
    trainer = make_trainer(args)
    for r in range(args.repeats):
        order = picks[r % len(picks):] + picks[:r % len(picks)]  # rotating, so no pick is always first
        for n in order:
            measured[n].append(throughput(model, data, trainer, n, args))
    per_batch = {}
    for n, runs in measured.items():
        rates = [m["samples_per_s"] for m in runs if m["samples_per_s"] is not None]
        per_batch[n] = {"samples_per_s": statistics.median(rates) if rates else None,
                        "runs": runs, "alloc_retries": [m["alloc_retries"] for m in runs]}
    best = max((v["samples_per_s"] or 0.0) for v in per_batch.values()) or None

    print(f"\n{'finder':>20} {'batch':>7} {'wall s':>7} {'samples/s':>10} {'vs best':>8} {'retries':>8}")
    for f in finders:
        v = per_batch.get(f["picked"], {})
        sps = v.get("samples_per_s")
        f["samples_per_s"] = sps
        f["vs_best"] = None if sps is None or not best else sps / best - 1
        vs = "" if f["vs_best"] is None else f"{f['vs_best']:+.1%}"
        print(f"{f['finder']:>20} {f['picked']!s:>7} {f['wall_s']:7.1f} {sps or 0:10.1f} {vs:>8} "
              f"{v.get('alloc_retries')!s:>8}")
    total_s = time.perf_counter() - t_start
    print(f"\ntotal {total_s:.0f} s")

    out = args.out or (None if args.quick else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results", f"finders_lightning-{time.strftime('%Y-%m-%d')}.json"))
    if out:
        info = run_info("finders_lightning.py", gpu=None if not args.quick else "cpu")
        with open(out, "w") as fh:
            json.dump({**info, "lightning": pl.__version__, "precision": args.precision,
                       "memory_gib": args.memory_gib, "max_batch": args.max_batch, "repeats": args.repeats,
                       "time_s": args.time_s, "finders": finders,
                       "throughput": {str(n): v for n, v in per_batch.items()}, "total_s": total_s}, fh, indent=1)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
