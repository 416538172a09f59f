"""Memory reconciliation on a real GPU, alone on it (an H200): NVML finds torch's device,
the residual agrees with cudaMemGetInfo, records come when due and never wait for the
GPU, and memory allocated outside PyTorch shows up as residual growth.

Tolerances: 64 MiB, the issue's bound.  Figures that come from one snapshot (the
identity process = reserved + residual, allocator figures against torch's own) are
compared exactly.  The two 64 MiB comparisons are between different instruments
(NVML's per-process figure against cudaMemGetInfo's device-wide one) or between two
snapshots (residual growth), where driver bookkeeping (page tables, per-process
internal allocations) can differ by a few MiB; a missed or double-counted
allocation would differ by hundreds of MiB to 1 GiB.
"""

from __future__ import annotations

import ctypes
import time

import pytest
import torch

import stepprof
from stepprof._device import nvml as _nvml
from stepprof._device.cuda import CudaBackend

pytestmark = pytest.mark.cuda

MiB = 2**20
GiB = 2**30
TOLERANCE = 64 * MiB


def mlp_step(width=4096, depth=4, batch=2048):
    """A real training step (fp32 MLP, AdamW) with a few hundred MiB of allocator traffic."""
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).cuda()
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    x = torch.randn(batch, width, device="cuda")

    def step():
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):  # steady state: kernels loaded, optimizer state and allocator cache built
        step()
    torch.cuda.synchronize()
    return step


class DriverAllocation:
    """``size`` bytes from the CUDA driver API (``cuMemAlloc``), outside torch's allocator."""

    def __init__(self, size: int) -> None:
        self.cuda = ctypes.CDLL("libcuda.so.1")
        self.cuda.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
        self.cuda.cuMemFree_v2.argtypes = [ctypes.c_uint64]
        ctx = ctypes.c_void_p()
        assert self.cuda.cuCtxGetCurrent(ctypes.byref(ctx)) == 0
        if not ctx.value:  # make torch's (primary) context current on this thread
            dev = ctypes.c_int()
            assert self.cuda.cuDeviceGet(ctypes.byref(dev), torch.cuda.current_device()) == 0
            assert self.cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
            assert self.cuda.cuCtxSetCurrent(ctx) == 0
        self.ptr = ctypes.c_uint64()
        rc = self.cuda.cuMemAlloc_v2(ctypes.byref(self.ptr), size)
        assert rc == 0, f"cuMemAlloc_v2 failed with CUresult {rc}"

    def free(self) -> None:
        assert self.cuda.cuMemFree_v2(self.ptr) == 0


def test_nvml_finds_the_torch_device_by_uuid_and_by_pci_bus_id():
    torch.ones(1, device="cuda")
    uuid, pci = CudaBackend(torch.cuda.current_device(), nvtx=False).identity()
    assert uuid is not None and len(uuid) == 36, uuid
    m, why = _nvml._load()
    assert m is not None, why
    handle, is_mig, parent_mig, nvml_uuid, why = _nvml._device(m, uuid, None)
    assert why is None, why
    assert nvml_uuid == ("MIG-" if is_mig else "GPU-") + uuid and not parent_mig
    if pci is not None and not is_mig:  # torch builds without pci_* properties match by UUID only
        info, _ = _nvml._query(m, "nvmlDeviceGetPciInfo", handle)
        bus = info.busId.decode() if isinstance(info.busId, bytes) else info.busId
        assert bus.upper() == pci, (bus, pci)
        assert _nvml._device(m, None, pci)[3] == nvml_uuid
    reading = _nvml.read(uuid, pci)
    assert reading.device_uuid == nvml_uuid
    assert reading.device_used_bytes is not None and reading.device_used_bytes > 0


def test_residual_matches_mem_get_info_and_process_is_reserved_plus_residual(tmp_path):
    step = mlp_step()
    log = tmp_path / "memory.jsonl"
    with stepprof.Profiler(log, warmup=1, memory_every=0) as prof:
        for _ in range(3):
            with prof.step():
                step()
        torch.cuda.synchronize()
        r = stepprof.memory_report()
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    # One snapshot: the allocator figures are torch's own, to the byte.
    assert (r.allocated_bytes, r.reserved_bytes) == (allocated, reserved)
    assert r.fragmentation_bytes == reserved - allocated
    assert r.total_bytes == torch.cuda.mem_get_info()[1]
    # The identity, on whichever basis NVML allowed (a container hides the PID).
    total = r.nvml_process_bytes if r.basis == "process" else r.mem_get_info_used_bytes
    assert r.basis in ("process", "device (assumes exclusive GPU)"), r.unavailable
    assert total == r.reserved_bytes + r.residual_bytes
    # Alone on the GPU, nvidia-smi's figure for this process and cudaMemGetInfo's used
    # figure describe the same memory: the residual agrees within the 64 MiB.
    gap = r.residual_bytes - (r.mem_get_info_used_bytes - r.reserved_bytes)
    assert abs(gap) <= TOLERANCE, (gap / MiB, r)
    # A CUDA context exists, so the residual and the baseline are real, positive figures.
    assert r.residual_bytes > 0
    assert 0 < r.context_baseline_bytes <= r.residual_bytes + TOLERANCE
    assert r.peak_allocated_bytes >= r.allocated_bytes
    if r.basis == "process":
        assert r.explanation.startswith("nvidia-smi shows ")
    (logged,) = [m for m in stepprof.read(log, kind="memory") if m["trigger"] == "on_demand"]
    assert logged["residual_bytes"] == r.residual_bytes


def test_records_come_after_warmup_every_n_steps_and_at_close_with_one_nvml_query_each(
    tmp_path, monkeypatch
):
    import pynvml

    queries = []
    real = pynvml.nvmlDeviceGetComputeRunningProcesses
    monkeypatch.setattr(
        pynvml, "nvmlDeviceGetComputeRunningProcesses", lambda h: queries.append(1) or real(h)
    )
    step = mlp_step()
    log = tmp_path / "records.jsonl"
    with stepprof.Profiler(log, warmup=3, memory_every=5) as prof:
        for _ in range(14):
            with prof.step():
                step()
    recs = list(stepprof.read(log))
    memory = [r for r in recs if r["kind"] == "memory"]
    assert [(r["trigger"], r["step"]) for r in memory] == [
        ("after_warmup", 3), ("periodic", 8), ("periodic", 13), ("close", 13),
    ]
    # One process query for the context baseline (first step on CUDA) and one per record:
    # none at the other ten steps.
    assert len(queries) == 1 + len(memory)
    steps = [r for r in recs if r["kind"] == "step"]
    for m in memory:
        assert m["residual_bytes"] is not None and m["basis"] is not None, m["unavailable"]
        # the highest step peak up to the record's step, exactly, although stepprof resets
        # the allocator's peak counter at every boundary
        assert m["peak_allocated_bytes"] == max(s["peak_allocated_bytes"] for s in steps[: m["step"] + 1])
    for m in memory[:3]:
        i = recs.index(m)
        assert recs[i - 1]["kind"] == "step" and recs[i - 1]["step"] == m["step"]


def test_a_memory_record_never_waits_for_the_gpu(tmp_path):
    torch.ones(1, device="cuda")
    torch.cuda.synchronize()
    prof = stepprof.Profiler(tmp_path / "wait.jsonl", warmup=0, memory_every=1)
    with prof.step():      # baseline and first record on an idle GPU: nvmlInit is paid here
        pass
    queued = torch.cuda.Event()
    t0 = time.perf_counter()
    with prof.step():      # due a record: the readings run while the GPU is busy
        torch.cuda._sleep(200_000_000)  # ~0.1 s of device time at ~2 GHz
        queued.record()
    host_s = time.perf_counter() - t0
    assert not queued.query(), "the memory readings waited for the GPU"
    assert host_s < 0.05, host_s
    prof.close()
    second = [m for m in stepprof.read(tmp_path / "wait.jsonl", kind="memory") if m["step"] == 1]
    assert second[0]["trigger"] == "periodic" and second[0]["residual_bytes"] is not None


def test_a_gib_allocated_outside_pytorch_appears_as_residual_growth_with_the_note(tmp_path):
    step = mlp_step()
    log = tmp_path / "outside.jsonl"
    prof = stepprof.Profiler(log, warmup=2, memory_every=3)
    for _ in range(3):     # steps 0-2: the after-warm-up record at step 2 is the reference
        with prof.step():
            step()
    reserved = torch.cuda.memory_reserved()
    planted = DriverAllocation(GiB)
    try:
        assert torch.cuda.memory_reserved() == reserved      # torch's allocator never saw it
        for _ in range(3):  # steps 3-5: a periodic record at step 5
            with prof.step():
                step()
        prof.close()
    finally:
        planted.free()
    before, after, _close = stepprof.read(log, kind="memory")
    assert (before["trigger"], after["trigger"]) == ("after_warmup", "periodic")
    assert after["basis"] == before["basis"]
    assert after["reserved_bytes"] == before["reserved_bytes"]
    growth = after["residual_bytes"] - before["residual_bytes"]
    assert abs(growth - GiB) <= TOLERANCE, growth / MiB
    assert any(
        n.startswith("the residual grew by ") and "outside PyTorch's allocator is growing" in n
        for n in after["notes"]
    ), after["notes"]
    assert not any(n.startswith("the residual grew") for n in before["notes"])
