"""Host cost of the CUDA primitives stepprof could use at a step boundary.

Each candidate is called many times after a warm-up; the median per-call cost is
printed as a table and written to JSON. It also checks, with torch's GPU-trace
callbacks, that none of the per-step primitives synchronises.

    python bench/primitives.py [--out primitives.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from _common import per_call_us  # bench/ is on sys.path when a script in it runs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="primitives.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("CUDA not available: nothing to measure")
        return 0
    dev = torch.cuda.current_device()
    x = torch.randn(1024, 1024, device="cuda")
    torch.cuda.synchronize()

    stream = torch.cuda.current_stream()
    ev_py = torch.cuda.Event(enable_timing=True)
    ev_py2 = torch.cuda.Event(enable_timing=True)
    ev_gen = torch.Event(device="cuda", enable_timing=True)
    ev_gen2 = torch.Event(device="cuda", enable_timing=True)
    ev_py.record(); ev_py2.record(); ev_gen.record(); ev_gen2.record()
    torch.cuda.synchronize()
    base_record = torch._C._CudaEventBase.record

    cands = {
        "perf_counter_ns": time.perf_counter_ns,
        "cuda.Event() construct": lambda: torch.cuda.Event(enable_timing=True),
        "torch.Event(cuda) construct": lambda: torch.Event(device="cuda", enable_timing=True),
        "cuda.Event.record()": lambda: ev_py.record(),
        "_CudaEventBase.record(ev, cached stream)": lambda: base_record(ev_py, stream),
        "torch.Event.record()": lambda: ev_gen.record(),
        "cuda.Event.query() done": lambda: ev_py2.query(),
        "torch.Event.query() done": lambda: ev_gen2.query(),
        "cuda.Event.elapsed_time done": lambda: ev_py2.elapsed_time(ev_py2),
        "torch.Event.elapsed_time done": lambda: ev_gen2.elapsed_time(ev_gen2),
        "torch.cuda.current_stream()": torch.cuda.current_stream,
        "_C._cuda_getCurrentStream(dev)": lambda: torch._C._cuda_getCurrentStream(dev),
        "torch.cuda.current_device()": torch.cuda.current_device,
        "_C._cuda_getDevice()": torch._C._cuda_getDevice,
        "is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
        "reset_peak_memory_stats()": torch.cuda.reset_peak_memory_stats,
        "_C._cuda_resetPeakMemoryStats(dev)": lambda: torch._C._cuda_resetPeakMemoryStats(dev),
        "max_memory_allocated()": torch.cuda.max_memory_allocated,
        "memory_reserved()": torch.cuda.memory_reserved,
        "_C._cuda_memoryStats(dev)": lambda: torch._C._cuda_memoryStats(dev),
        "nvtx push+pop": lambda: (torch.cuda.nvtx.range_push("x"), torch.cuda.nvtx.range_pop()),
        "_C._nvtx.rangePushA+rangePop": lambda: (torch._C._nvtx.rangePushA("x"), torch._C._nvtx.rangePop()),
        "torch.compiler.is_compiling()": torch.compiler.is_compiling,
        "mem_get_info()": torch.cuda.mem_get_info,
    }
    if hasattr(torch._C, "_accelerator_getDeviceStats"):
        cands["_C._accelerator_getDeviceStats(dev)"] = lambda: torch._C._accelerator_getDeviceStats(dev)
        cands["_C._accelerator_resetPeakStats(dev)"] = lambda: torch._C._accelerator_resetPeakStats(dev)

    results = {}
    for name, fn in cands.items():
        try:
            results[name] = per_call_us(fn, n=500 if "construct" in name else 2000)
        except Exception as exc:  # noqa: BLE001 - a missing primitive is a finding
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    print(f"{'primitive':45s} {'median µs':>10s} {'min':>8s} {'max':>8s}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:45s} {r['error']}")
        else:
            print(f"{name:45s} {r['median_us']:10.2f} {r['min_us']:8.2f} {r['max_us']:8.2f}")

    # Which of these synchronise?  GPU-trace callbacks see every sync path.
    syncs: list[str] = []
    import torch.cuda._gpu_trace as gt

    gt.register_callback_for_device_synchronization(lambda *a: syncs.append("device"))
    gt.register_callback_for_stream_synchronization(lambda *a: syncs.append("stream"))
    gt.register_callback_for_event_synchronization(lambda *a: syncs.append("event"))
    torch._C._activate_gpu_trace()
    torch.cuda.synchronize()
    trace_works = bool(syncs)
    syncs.clear()
    a = torch.Event(device="cuda", enable_timing=True)
    b = torch.Event(device="cuda", enable_timing=True)
    a.record()
    y = x @ x
    for _ in range(50):
        y = y @ x
    b.record()
    pending = b.query()
    while not b.query():
        pass
    ms = a.elapsed_time(b)
    torch._C._cuda_memoryStats(dev)
    torch._C._cuda_resetPeakMemoryStats(dev)
    stats = torch._C._cuda_memoryStats(dev)
    per_step_syncs = list(syncs)
    print(f"gpu-trace works: {trace_works}; pending at first query: {not pending}; "
          f"syncs from query/elapsed/stats: {per_step_syncs}; elapsed {ms:.3f} ms")
    print("stat keys:", sorted(stats.keys()))
    print("allocated_bytes keys:", sorted(stats["allocated_bytes"].keys()),
          sorted(stats["allocated_bytes"]["all"].keys()))
    if hasattr(torch._C, "_accelerator_getDeviceStats"):
        acc = torch._C._accelerator_getDeviceStats(dev)
        print("accelerator stats keys:", sorted(acc.keys())[:40])
    out = {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
        "python": sys.version.split()[0],
        "per_call": results,
        "gpu_trace_works": trace_works,
        "syncs_from_step_primitives": per_step_syncs,
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
