"""The demo: a small embedded model trained for some steps under stepprof."""

from __future__ import annotations

import time
from typing import Any

import torch

from ._log import read
from ._recorder.profiler import Profiler
from ._records import Summary


def run_demo(*, steps: int = 60, warmup: int = 5, log: str = "stepprof-demo.jsonl",
             device: str | None = None, out: Any = print) -> Summary:
    """Train a small MLP classifier on synthetic data under ``profile_step`` with phases.

    The data come from a fixed random "teacher" network, so the loss really
    falls.  Runs on CUDA when present, else on the CPU.
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gen = torch.Generator().manual_seed(0)
    width, batch = (2048, 512) if dev.type == "cuda" else (256, 64)
    n_in, n_classes = 128, 10
    teacher = torch.randn(n_in, n_classes, generator=gen)
    model = torch.nn.Sequential(
        torch.nn.Linear(n_in, width), torch.nn.GELU(),
        torch.nn.Linear(width, width), torch.nn.GELU(),
        torch.nn.Linear(width, n_classes),
    ).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = []
    for _ in range(8):  # a small fixed dataset, cycled: the loop times the step, not data generation
        x = torch.randn(batch, n_in, generator=gen)
        batches.append((x.to(dev), (x @ teacher).argmax(1).to(dev)))

    out(f"stepprof demo: {steps} steps of a {width}-wide MLP, batch {batch}, on {dev} -> {log}")
    first_loss = last_loss = None
    t0 = time.perf_counter()
    # Measure the device the model trains on: with device=None the profiler would read the
    # current CUDA device, which is not the model's under --device cuda:1.  Left to None on a
    # CPU-only run that asked for nothing, so the records say why CUDA figures are missing.
    measured = dev if device is not None or dev.type == "cuda" else None
    with Profiler(log, warmup=warmup, device=measured) as prof:
        for i in range(steps):
            x, y = batches[i % len(batches)]
            with prof.step(batch_size=batch):
                with prof.measure("forward"):
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                with prof.measure("backward"):
                    loss.backward()
                with prof.measure("optimizer"):
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            if i == 0:
                first_loss = loss.detach()
        last_loss = loss.detach()
    summary = prof.close()
    elapsed = time.perf_counter() - t0
    out(f"loss {float(first_loss):.3f} -> {float(last_loss):.3f} in {elapsed:.1f} s")
    out(str(summary))
    last = [r for r in read(log, kind="step")][-1]
    phases = ", ".join(
        f"{k} {v['wall_ms']:.2f} ms" + (f" / gpu {v['gpu_ms']:.2f} ms" if v["gpu_ms"] is not None else "")
        for k, v in last["phases"].items()
    )
    out(f"last step ({last['step']}): {phases}")
    if last["unavailable"]:
        out("unavailable here: " + "; ".join(f"{k}: {v}" for k, v in sorted(last["unavailable"].items())))
    out(f"records: stepprof.read({log!r})  |  pandas.read_json({log!r}, lines=True)")
    return summary
