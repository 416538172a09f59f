"""On a real GPU: ``stepprof calibrate`` and MFU of the compute-bound benchmark step.

Together about 20 s on an H200: one calibration (in a subprocess, through the
console entry point, as a user runs it) and 12 steps of bench/overhead.py's
compute-bound step with ``flops="auto"``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import stepprof
from stepprof._report import build_report

pytestmark = pytest.mark.cuda

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """Run `python -m stepprof calibrate --json` once into a private cache directory."""
    cache = str(tmp_path_factory.mktemp("cache"))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "stepprof", "calibrate", "--json"], cwd=ROOT,
                          env={**os.environ, "STEPPROF_CACHE_DIR": cache}, capture_output=True, timeout=120)
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout), cache, elapsed


def test_calibrate_measures_a_plausible_dense_peak(calibrated):
    cal, cache, elapsed = calibrated
    print(json.dumps(cal, indent=1), f"\ncalibrate took {elapsed:.1f} s (with interpreter start)")
    assert elapsed < 60
    t = cal["matmul_tflops"]
    assert t["fp32"] < t["tf32"] < t["bf16"]
    if "H200" in cal["device_name"] or "H100" in cal["device_name"]:
        assert 500 <= t["bf16"] <= 1100, t  # dense bf16: the datasheet's 989 is not reached
        assert 1000 < cal["copy_gbps"] < 5000
    assert 0 < cal["launch_us"] < 200
    assert os.path.exists(cal["path"]) and cal["path"].startswith(cache)


def _bench_overhead():
    path = os.path.join(ROOT, "bench", "overhead.py")
    spec = importlib.util.spec_from_file_location("bench_overhead", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mfu_of_the_compute_bound_step_is_between_0_and_1(calibrated, tmp_path, monkeypatch):
    _, cache, _ = calibrated
    monkeypatch.setenv("STEPPROF_CACHE_DIR", cache)
    bench = _bench_overhead()
    fwd, bwd, opt = bench.make_workload(4096, 4096)  # 8 layers, bf16, AdamW
    log = str(tmp_path / "mfu.jsonl")
    with stepprof.Profiler(log, warmup=3, flops="auto") as prof:
        for _ in range(12):
            bench.phased_step(prof, 4096, fwd, bwd, opt)
    torch.cuda.synchronize()
    flops = next(stepprof.read(log, kind="flops"))
    expected = 23 * 2 * 4096**3  # 8 forward matmuls, 8 weight grads, 7 input grads (x needs none)
    assert flops["flops_by_dtype"] == {"bf16": expected}, flops
    assert flops["step"] == 3 and flops["calibration"] is not None
    steps = list(stepprof.read(log, kind="step"))
    assert all(r["syncs"]["count"] == 0 for r in steps), "counting FLOPs added a sync"
    after = [r for r in steps if r["step"] > 3]
    mfus = [r["mfu"] for r in after]
    print("MFU per step:", [round(m, 3) for m in mfus], "TFLOP/s:", [round(r["tflops_per_s"]) for r in after])
    assert all(0 < m < 1 for m in mfus)
    assert 0 < prof.summary.mfu_median < 1
    run = build_report([log]).to_dict()["logs"][0]["runs"][0]
    # The one MFU: the median of the steps' own mfu (the roofline no longer computes another).
    assert run["roofline"] is not None and 0 < run["figures"]["mfu_median"] < 1
    print("roofline:", run["roofline"]["class"], {k: run["roofline"][k] for k in ("compute_ms", "memory_ms",
                                                                                   "host_ms", "step_ms")})
