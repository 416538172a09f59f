"""The CUDA backends and the choice of a backend, on a CPU: torch's CUDA calls are patched."""

from __future__ import annotations

import pytest
import torch

from stepprof._device import cuda, select
from stepprof._device.backend import HostBackend, HostSweepBackend
from stepprof._device.cuda import CudaSweepBackend
from stepprof._device.select import select_sweep_backend, upgrade_from_host

from .fakes import FakeGpu


@pytest.fixture
def cuda_up(monkeypatch):
    """CUDA is available; flip ``state[0]`` to say it has been initialised."""
    state = [False]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: state[0])
    return state


@pytest.fixture
def chosen(monkeypatch):
    """What upgrade_from_host asked the selectors for; they answer with a sentinel."""
    calls: list[tuple] = []
    monkeypatch.setattr(select, "select_backend", lambda device, **kw: calls.append(("select", device, kw)) or "cuda")
    monkeypatch.setattr(select, "select_sweep_backend", lambda device: calls.append(("sweep", device)) or "cuda-sweep")
    return calls


def test_a_host_backend_is_upgraded_once_cuda_is_initialised(cuda_up, chosen):
    host = HostBackend("CUDA was not initialised when the step began (the step ran on the CPU)")
    assert upgrade_from_host(host, nvtx=False, syncs="trace") is None       # not initialised yet
    cuda_up[0] = True
    assert upgrade_from_host(host, nvtx=False, syncs="trace") == "cuda"
    assert chosen == [("select", None, {"nvtx": False, "syncs": "trace", "boundary": "python"})]


def test_a_sweep_upgrades_to_a_sweep_backend(cuda_up, chosen):
    cuda_up[0] = True
    assert upgrade_from_host(HostSweepBackend("CUDA is not available"), sweep=True) == "cuda-sweep"
    assert chosen == [("sweep", None)]


def test_a_pinned_or_device_timed_backend_is_kept(cuda_up, chosen):
    cuda_up[0] = True
    assert upgrade_from_host(HostBackend("device='cpu' was requested"), "cpu", pinned=True) is None
    assert upgrade_from_host(FakeGpu()) is None                  # has_device_timing: already on a device
    assert chosen == []


def test_without_cuda_a_host_backend_stays(monkeypatch, chosen):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert upgrade_from_host(HostBackend("CUDA is not available")) is None
    assert chosen == []


def test_no_backend_yet_always_gets_one(monkeypatch, chosen):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert upgrade_from_host(None, "cuda:1", pinned=True, syncs="off") == "cuda"
    assert chosen == [("select", "cuda:1", {"nvtx": True, "syncs": "off", "boundary": "python"})]


def test_host_backends_state_their_capabilities():
    for backend in (HostBackend("no CUDA"), HostSweepBackend("no CUDA")):
        assert backend.index is None and backend.sync_mechanism is None
        assert not backend.has_device_timing and not backend.has_device_memory
        assert backend.gpu_reason == "no CUDA" and backend.memory_reason.startswith("no CUDA; ")


def test_the_sweep_gets_a_host_backend_with_the_reason_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    b = select_sweep_backend(None)
    assert isinstance(b, HostSweepBackend) and b.gpu_reason == "CUDA is not available"


def test_cuda_sweep_backend_reads_the_raw_allocator_stats(monkeypatch):
    stats = {
        "num_alloc_retries": 3, "num_device_alloc": 7,
        "allocated_bytes": {"all": {"current": 100, "peak": 500}},
        "reserved_bytes": {"all": {"current": 1000}},
    }
    emptied = []
    monkeypatch.setattr(torch._C, "_cuda_memoryStats", lambda i: stats, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_resetPeakMemoryStats", lambda i: None, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_emptyCache", lambda: emptied.append(1), raising=False)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (4000, 10000))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda i: 1.0)
    b = CudaSweepBackend(0)
    assert b.device == "cuda:0" and b.memory_reason is None
    assert b.allocator_counters() == (3, 7)
    assert b.allocated_bytes() == 100
    assert b.read_memory()[:2] == (500, 1000)
    assert b.capacity_bytes() == 4000 + 1000          # free + what torch already reserved
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda i: 0.3)
    assert b.capacity_bytes() == 3000                 # a memory fraction caps it
    b.empty_cache()
    assert emptied == [1]


def test_the_sweep_gets_a_cuda_sweep_backend_on_the_device_chosen(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_memoryStats", lambda i: {}, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_resetPeakMemoryStats", lambda i: None, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_emptyCache", lambda: None, raising=False)
    gpu = FakeGpu()
    gpu.index = 3
    monkeypatch.setattr(select, "select_backend", lambda device, **kw: gpu)
    b = select_sweep_backend(None)
    assert isinstance(b, CudaSweepBackend) and b.index == 3 and b.device == "cuda:3"


def test_an_nvtx_range_whose_name_nvtx_cannot_take_is_pushed_with_the_character_replaced():
    """torch's NVTX binding takes a std::string: a lone surrogate (a step name made from a
    non-UTF-8 file name) raises TypeError there, which would stop recording at the step."""
    pushed = []

    def push(name):
        name.encode("utf-8")  # what pybind11 does, raising as it would
        pushed.append(name)

    def strict_push(name):
        try:
            push(name)
        except UnicodeEncodeError as e:
            raise TypeError("rangePushA(): incompatible function arguments") from e

    b = cuda.CudaBackend.__new__(cuda.CudaBackend)
    b._nvtx, b._push = True, strict_push
    b.range_push("step 1")
    b.range_push("step\udcff 2")
    assert pushed == ["step 1", "step? 2"]


def _history_backend(monkeypatch, record):
    monkeypatch.setattr(torch._C, "_cuda_memoryStats", lambda i: {}, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_resetPeakMemoryStats", lambda i: None, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_isHistoryEnabled", lambda: False, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_emptyCache", lambda: None, raising=False)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: {"segments": [], "device_traces": [[]]})
    return CudaSweepBackend(0)


def test_the_history_records_every_threads_ranges_where_torch_can(monkeypatch):
    import inspect

    calls = []

    def record(*args, **kwargs):
        calls.append(kwargs)

    # This torch's own signature (torch 2.13 has global_record_annotations).
    record.__signature__ = inspect.signature(torch.cuda.memory._record_memory_history)
    assert "global_record_annotations" in record.__signature__.parameters
    b = _history_backend(monkeypatch, record)
    started = b.begin_history(1000)
    assert started.annotations is True and started.snapshot == {"segments": [], "device_traces": [[]]}
    assert calls == [{"enabled": "all", "context": "alloc", "stacks": "python", "max_entries": 1000,
                      "global_record_annotations": True}]
    b.end_history()
    assert calls[-1] == {"enabled": None}  # which, in torch, removes the ranges' callback


def test_an_older_torch_records_the_history_without_ranges(monkeypatch):
    calls = []

    def record(enabled="all", context="all", stacks="all", max_entries=2**63 - 1, device=None,
               clear_history=False):
        calls.append(max_entries)

    b = _history_backend(monkeypatch, record)
    started = b.begin_history(1000)
    assert started.annotations is False and calls == [1000]
