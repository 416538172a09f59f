"""Host cost of a memory record's readings: what the training thread pays at a due step.

It times, on the current CUDA device, the first reading (``nvmlInit`` and the
device lookup by UUID included), then each reading alone and a whole
``stepprof._memory.take_snapshot`` (what a due step runs), median over rounds.

    python bench/memory_costs.py [--out memory_costs.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from stepprof import _memory
from stepprof._device import nvml
from stepprof._device.cuda import CudaBackend

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import per_call_us  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="memory_costs.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("CUDA not available: nothing to measure")
        return 0
    x = torch.randn(4096, 4096, device="cuda")  # something for the allocator to hold
    torch.cuda.synchronize()
    b = CudaBackend(torch.cuda.current_device(), nvtx=False)
    uuid, pci = b.identity()

    t0 = time.perf_counter_ns()
    first = nvml.read(uuid, pci)
    first_ms = (time.perf_counter_ns() - t0) / 1e6
    print(f"first NVML reading (nvmlInit + device lookup): {first_ms:.2f} ms -> {first}")

    cands = {
        "CudaBackend.read_allocator()": b.read_allocator,
        "CudaBackend.mem_get_info()": b.mem_get_info,
        "CudaBackend.identity()": b.identity,
        "_nvml.read() (memory info + process query)": lambda: nvml.read(uuid, pci),
        "_memory.take_snapshot() (a due step's work)": lambda: _memory.take_snapshot(b),
    }
    snap = _memory.take_snapshot(b)
    cands["_memory.build() (the collector's work)"] = lambda: _memory.build(
        snap, trigger="periodic", step=0
    )
    results = {"first_nvml_reading_ms": first_ms}
    print(f"{'reading':50s} {'median µs':>10s} {'min':>8s} {'max':>8s}")
    for name, fn in cands.items():
        r = results[name] = per_call_us(fn, n=500, warmup=50)
        print(f"{name:50s} {r['median_us']:10.2f} {r['min_us']:8.2f} {r['max_us']:8.2f}")
    print(_memory.build(snap, trigger="periodic", step=0).explanation)
    del x
    results["device"] = torch.cuda.get_device_name()
    results["torch"] = torch.__version__
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    nvml.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
