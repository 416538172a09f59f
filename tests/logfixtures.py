"""Realistic stepprof logs written without a GPU, for the report, plot and reader tests.

The figures follow the H200 measurements in FINDINGS.md and docs/benchmarks.md: an
8-layer 4096-wide bf16 MLP with AdamW at batch 4096 (about 7 ms a step, GPU-bound),
a loss.item() every step, memory records, a FLOPs record with a calibration.
"""

from __future__ import annotations

import random
from typing import Any

import orjson

from stepprof import _schema
from stepprof._records import Summary
from stepprof._schema import SCHEMA_VERSION

GIB = 2**30
CALIBRATION = {
    "calibration_version": 1,
    "device_name": "NVIDIA H200",
    "matmul_tflops": {"bf16": 720.0, "tf32": 380.0, "fp32": 52.0},
    "matmul_n": {"bf16": 8192, "tf32": 8192, "fp32": 8192},
    "copy_gbps": 3900.0,
    "launch_us": 6.0,
    "runs": 5,
    "torch": "2.11.0+cu130",
    "cuda": "13.0",
    "measured_unix_s": 1796012000.0,
}
FLOPS = 23 * 2 * 4096**3  # forward 8 matmuls, backward 15 (the first layer's input needs no grad)


def step_record(
    i: int,
    *,
    warmup: bool,
    wall: float,
    gpu: float | None,
    syncs: bool = True,
    flops: bool = False,
    batch: int = 4096,
    peak: int = int(2.6 * GIB),
    counted: bool = False,
    schema: int | None = SCHEMA_VERSION,
    allocs: int = 0,
) -> dict[str, Any]:
    """A step record; ``syncs=False`` leaves out ``syncs`` and ``allocator`` (an older log's)."""
    phases: dict[str, dict[str, Any]] = {
        "forward": {
            "wall_ms": wall * 0.3,
            "gpu_ms": None if gpu is None else gpu * 0.3,
            "peak_allocated_bytes": int(2.13 * GIB),
            "count": 1,
        },
        "backward": {
            "wall_ms": wall * 0.45,
            "gpu_ms": None if gpu is None else gpu * 0.45,
            "peak_allocated_bytes": int(2.22 * GIB),
            "count": 1,
        },
        "optimizer": {
            "wall_ms": wall * 0.25,
            "gpu_ms": None if gpu is None else gpu * 0.25,
            "peak_allocated_bytes": peak,
            "count": 1,
        },
    }
    if syncs:
        for ph in phases.values():
            ph["syncs"] = 0
        phases["optimizer"]["syncs"] = 1
    span = max(wall, gpu or 0)
    r = _schema.step_record(
        step=i,
        name="step",
        warmup=warmup,
        device="cuda:0",
        start_unix_s=1796012940.0 + i * wall / 1e3,
        wall_ms=wall,
        gpu_ms=gpu,
        gpu_busy=None if gpu is None else gpu / wall,
        peak_allocated_bytes=peak,
        reserved_bytes=int(3.19 * GIB),
        batch_size=batch,
        samples_per_s=batch / (span / 1e3),
        data_wait_ms=None,
        phases=phases,
        overhead_us=31.0,
        error=None,
        syncs={
            "count": 1,
            "waits": 1,
            "other_threads": 0,
            "mechanism": "warn",
            "sites": [
                {"where": "train.py:42", "kind": "item", "code": "loss.item()", "count": 1, "waits": 1}
            ],
        },
        allocator={
            "num_alloc_retries": 0,
            "num_sync_all_streams": 0,
            "num_device_alloc": allocs,
            "num_device_free": 0,
        },
        unavailable={},
        flops=FLOPS if flops else _schema.ABSENT,
        tflops_per_s=FLOPS / (span * 1e-3) / 1e12 if flops else _schema.ABSENT,
        mfu=FLOPS / (CALIBRATION["matmul_tflops"]["bf16"] * 1e12) * 1e3 / span if flops else _schema.ABSENT,
        flops_counted=flops and counted,
    )
    if not syncs:
        del r["syncs"], r["allocator"]
    if schema is None:
        del r["schema_version"]
    else:
        r["schema_version"] = schema
    return r


def memory_record(step: int, trigger: str) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "memory",
        "trigger": trigger,
        "step": step,
        "device": "cuda:0",
        "unix_s": 1796013021.52,
        "allocated_bytes": int(1.6 * GIB),
        "peak_allocated_bytes": int(2.6 * GIB),
        "reserved_bytes": int(3.19 * GIB),
        "fragmentation_bytes": int(1.59 * GIB),
        "inactive_split_bytes": 41943040,
        "nvml_process_bytes": int(3.91 * GIB),
        "nvml_device_used_bytes": int(3.91 * GIB),
        "mem_get_info_used_bytes": int(3.91 * GIB),
        "total_bytes": 150110011392,
        "residual_bytes": int(0.72 * GIB),
        "context_baseline_bytes": 566231040,
        "num_ooms": 0,
        "num_alloc_retries": 0,
        "basis": "process",
        "explanation": "nvidia-smi shows 3.91 GiB for this process: 1.60 GiB live tensors, 1.59 GiB cached "
        "by PyTorch's allocator for reuse (not a leak), 0.72 GiB CUDA context and libraries.",
        "notes": [],
        "unavailable": {},
    }


def flops_record(step: int) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "flops",
        "source": "auto",
        "flops_per_step": FLOPS,
        "flops_by_dtype": {"bf16": FLOPS},
        "ops": 236,
        "op_bytes": 9_500_000_000,
        "step": step,
        "notes": [],
        "device": "cuda:0",
        "device_name": "NVIDIA H200",
        "ideal_ms": FLOPS / 720e12 * 1e3,
        "calibration": CALIBRATION,
        "unavailable": {},
    }


def training_log(
    steps: int = 200,
    warmup: int = 3,
    seed: int = 0,
    *,
    flops: bool = True,
    spikes: tuple[int, ...] = (5, 120),
) -> list[dict[str, Any]]:
    """One run: warm-up (compile-like slow first steps), a spike or two, memory and flops records."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    for i in range(steps):
        warm = i < warmup
        gpu = 7.0 * (1 + rng.gauss(0, 0.01)) * (40 if i == 0 else 4 if warm else 1)
        wall = gpu * (1 + rng.gauss(0, 0.005)) + 0.02
        if i in spikes:
            wall *= 6
            gpu *= 6
        counted = flops and i == warmup
        out.append(
            step_record(
                i,
                warmup=warm,
                wall=wall,
                gpu=gpu,
                flops=flops and i >= warmup,
                counted=counted,
                allocs=2 if i in spikes else 0,
            )
        )
        if i == warmup:
            out.append(memory_record(i, "after_warmup"))
            if flops:
                out.append(flops_record(i))
    out.append(memory_record(steps - 1, "close"))
    summary = Summary(
        steps=steps,
        warmup_steps=warmup,
        error_steps=0,
        measured_steps=steps - warmup,
        device="cuda:0",
        wall_ms=None,
        gpu_ms=None,
        gpu_busy_median=None,
        peak_allocated_bytes_max=None,
        samples_per_s_median=None,
        overhead_us_median=None,
        log=None,
    )
    out.append({"schema_version": SCHEMA_VERSION, **_schema.summary_record(summary)})
    return out


def write(path: str, records: list[dict[str, Any]], extra_lines: list[bytes] = ()) -> str:
    with open(path, "wb") as f:
        for r in records:
            f.write(orjson.dumps(r) + b"\n")
        for line in extra_lines:
            f.write(line)
    return path
