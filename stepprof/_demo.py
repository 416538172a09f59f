"""The demo: a small embedded model trained for some steps under stepprof."""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import sys
import time
from typing import Any

import torch

from ._plot import default_png
from ._recorder.profiler import Profiler
from ._records import Summary, boundary_name
from ._units import format_bytes


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
    if warmup >= steps:
        out(f"warning: --warmup {warmup} >= --steps {steps}: every step is warm-up, so no step is measured; "
            f"use a --warmup below {steps}")
    first_loss: Any = None  # the first step's loss (a tensor once it ran)
    last_loss = None
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
    for line in summary_lines(summary, on_cpu=dev.type == "cpu"):
        out(line)
    out("next:")
    cli, python = shell_commands()
    quoted = shlex.quote(log)
    nexts = [(f"{cli} report {quoted}", "figures and diagnoses, with evidence and remedies")]
    if importlib.util.find_spec("matplotlib") is not None:
        nexts.append((f"{cli} plot {quoted}", f"times and memory per step, to {default_png(log)}"))
    else:
        nexts.append((f"{python} -m pip install matplotlib", f"for `{cli} plot {quoted}`: times and memory per step"))
    nexts.append((f"stepprof.read({log!r})", "the records as dicts, in Python"))
    width = max(len(command) for command, _ in nexts)
    long = width + max(len(what) for _, what in nexts) > 100  # a long path: what it does first
    for command, what in nexts:
        if long:
            out(f"  # {what}")  # (a shell comment: the lines paste as they are)
            out(f"  {command}")
        else:
            out(f"  {command:<{width}}    {what}")
    return summary


def shell_commands() -> tuple[str, str]:
    """How the shell that ran this process reaches stepprof's CLI and this Python, as typed.

    ``stepprof`` when the console script on ``PATH`` is this environment's; else this Python
    (relative to the working directory when inside it: ``.venv/bin/python -m stepprof`` after
    the README's set-up, whose venv is never activated).
    """
    python = sys.executable
    if not python:
        return "stepprof", "python3"
    here = os.path.abspath(python)
    if here.startswith(os.getcwd() + os.sep):
        here = os.path.relpath(here)
    shown = shlex.quote(here)
    script = shutil.which("stepprof")
    if script is not None and os.path.dirname(os.path.abspath(script)) == os.path.dirname(os.path.abspath(python)):
        return "stepprof", shown
    return f"{shown} -m stepprof", shown


#: The figure groups that may be missing, and the ``unavailable`` keys of each.
_GROUPS = {
    "GPU time": ("gpu_ms", "gpu_busy_median", "phases.gpu_ms"),
    "GPU memory": ("peak_allocated_bytes_max", "phases.peak_allocated_bytes_max"),
    "sync points": ("syncs_per_step_median", "phases.syncs_per_step"),
    "energy": ("energy_j_per_step",),
}
#: Lines no longer than this (the reasons are cut to fit).
WIDTH = 100


def summary_lines(summary: Summary, *, on_cpu: bool) -> list[str]:
    """The run's figures, labelled (medians over the measured steps), and one line per missing group."""
    s = summary
    lines = [f"{s.measured_steps} measured steps ({s.warmup_steps} warm-up) on {s.device}"
             + ("; medians over the measured steps:" if s.measured_steps else "")]
    if s.wall_ms is not None:
        lines.append(f"  wall time per step      {s.wall_ms.median:.2f} ms (p10 {s.wall_ms.p10:.2f}, "
                     f"p90 {s.wall_ms.p90:.2f})")
    if s.gpu_ms is not None:
        lines.append(f"  GPU time per step       {s.gpu_ms.median:.2f} ms (p10 {s.gpu_ms.p10:.2f}, "
                     f"p90 {s.gpu_ms.p90:.2f})")
    if s.gpu_busy_median is not None:
        lines.append(f"  GPU busy                {s.gpu_busy_median:.0%} of the wall time")
    if s.samples_per_s_median is not None:
        lines.append(f"  throughput              {s.samples_per_s_median:,.0f} samples/s")
    phases = ", ".join(
        f"{name} {f.gpu_ms_median if f.gpu_ms_median is not None else f.wall_ms_median:.2f} ms"
        for name, f in s.phases.items() if (f.gpu_ms_median if f.gpu_ms_median is not None else f.wall_ms_median)
        is not None
    )
    if phases:
        which = "GPU" if any(f.gpu_ms_median is not None for f in s.phases.values()) else "wall"
        lines.append(f"  phases ({which} time)      {phases}")
    if s.peak_allocated_bytes_max is not None:
        lines.append(f"  peak allocated (max)    {format_bytes(s.peak_allocated_bytes_max)}")
    if s.syncs_per_step_median is not None:
        lines.append(f"  syncs per step          {s.syncs_per_step_median:g}")
    if s.overhead_us_mean is not None:
        lines.append(f"  stepprof's own cost     {s.overhead_us_mean:.0f} µs/step (mean, "
                     f"{boundary_name(s.boundary)} boundary)")
    if s.measured_steps == 0:
        lines.append(f"  no figures: {s.unavailable.get('wall_ms', 'no measured steps')}"[:WIDTH])
    for group, keys in _GROUPS.items():
        why = next((s.unavailable[k] for k in keys if k in s.unavailable), None)
        if why is None or s.measured_steps == 0:
            continue
        text = "n/a on CPU" if on_cpu else f"n/a: {why}"
        if on_cpu and group == "GPU memory":
            text += " (the step records hold the process's RSS, host_rss_bytes)"
        line = f"{group}: {text}"
        lines.append(line if len(line) <= WIDTH else line[: WIDTH - 1] + "…")
    if s.boundary == "python":
        lines.append("the Python boundary ran: `stepprof build` compiles the C one (less stepprof time per step)")
    return lines
