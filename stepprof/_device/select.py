"""Which backend a step, a sweep or a memory report gets: the host's, CUDA's, or CUDA's
with the compiled boundary.

:func:`select_backend` (the recorder), :func:`select_sweep_backend` (the sweep),
:func:`memory_backend` (``stepprof.memory_report``) and, for a profiler or sweep that
started on the host, :func:`upgrade_from_host`.  The compiled boundary
(:mod:`stepprof._device.compiled`) is used where ``boundary`` allows it and
``stepprof build`` has built it; it is never compiled here.
"""

from __future__ import annotations

from typing import Any

import torch

from .._errors import ConfigError
from . import compiled
from .backend import Backend, HostBackend, HostSweepBackend
from .cuda import CudaBackend, CudaSweepBackend

__all__ = [
    "check_compiled",
    "memory_backend",
    "select_backend",
    "select_sweep_backend",
    "upgrade_from_host",
]


def check_compiled(boundary: str) -> None:
    """With ``boundary="compiled"``, raise :class:`stepprof.ConfigError` unless the
    compiled boundary is built and loads (checked when the profiler is made)."""
    if boundary == "compiled":
        module, why = compiled.load()
        if module is None:
            raise ConfigError(f"boundary='compiled', but {why}; or pass boundary='auto' or 'python'")


def _cuda_backend(index: int, *, nvtx: bool, syncs: str, boundary: str) -> Backend:
    if boundary != "python":
        module, _ = compiled.load()
        if module is not None:
            return compiled.CompiledCudaBackend(index, module, nvtx=nvtx, syncs=syncs)
    return CudaBackend(index, nvtx=nvtx, syncs=syncs)


def select_backend(
    device: Any = None, *, nvtx: bool = True, syncs: str = "warn", boundary: str = "python"
) -> Backend:
    """Choose the backend for a step that is starting now.

    ``boundary`` is the profiler's setting: "auto" and "compiled" use the compiled
    boundary when it loads (:func:`check_compiled` has refused "compiled" without it).

    With ``device=None`` the CUDA backend is used only when CUDA is available
    *and already initialised* by the user's code: stepprof never creates a CUDA
    context (hundreds of MiB) for a job that trains on the CPU.
    """
    if device is not None:
        dev = torch.device(device)
        if dev.type == "cpu":
            return HostBackend("device='cpu' was requested")
        if dev.type != "cuda":
            return HostBackend(f"device type {dev.type!r} has no CUDA events")
        if not torch.cuda.is_available():
            return HostBackend("CUDA is not available")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        return _cuda_backend(index, nvtx=nvtx, syncs=syncs, boundary=boundary)
    if not torch.cuda.is_available():
        return HostBackend("CUDA is not available")
    if not torch.cuda.is_initialized():
        return HostBackend("CUDA was not initialised when the step began (the step ran on the CPU)")
    return _cuda_backend(torch.cuda.current_device(), nvtx=nvtx, syncs=syncs, boundary=boundary)


def memory_backend(device: torch.device | None = None) -> Backend:
    """A backend to read memory figures on now, for :func:`stepprof.memory_report`.

    It never initialises CUDA: where the process has no CUDA context yet, the
    answer is a :class:`HostBackend` whose ``gpu_reason`` says so, because
    creating one would itself add hundreds of MiB to what nvidia-smi shows.
    """
    if device is not None and device.type != "cuda":
        return HostBackend(f"device {str(device)!r} has no CUDA memory")
    if not torch.cuda.is_available():
        return HostBackend("CUDA is not available")
    if not torch.cuda.is_initialized():
        return HostBackend(
            "CUDA is not initialised in this process, so it holds no GPU memory "
            "(stepprof never initialises CUDA itself)"
        )
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    if not 0 <= index < torch.cuda.device_count():
        return HostBackend(f"there is no CUDA device {index} ({torch.cuda.device_count()} visible)")
    return CudaBackend(index, nvtx=False)


def select_sweep_backend(device: Any = None) -> CudaSweepBackend | HostSweepBackend:
    """The sweep's backend: CUDA when asked for, or (``device=None``) when the process
    has already initialised CUDA (the model is on the GPU); otherwise the host."""
    chosen = select_backend(device, nvtx=False)
    if chosen.index is not None:
        return CudaSweepBackend(chosen.index)
    return HostSweepBackend(chosen.gpu_reason or "CUDA is not available")


def upgrade_from_host(
    backend: Backend | None,
    device: Any = None,
    *,
    pinned: bool = False,
    sweep: bool = False,
    nvtx: bool = True,
    syncs: str = "warn",
    boundary: str = "python",
) -> Backend | None:
    """The backend to switch to now, or None to keep ``backend``.

    A profiler or sweep chooses its backend when its first step begins; with no
    device named, that is the host if CUDA was not initialised yet.  When the
    training code initialises CUDA later, the host clock can no longer time its
    asynchronous GPU work, so a host backend (one without ``has_device_timing``)
    that was not ``pinned`` (a backend or device passed explicitly) is replaced by
    the one :func:`select_backend` (``sweep=True``: :func:`select_sweep_backend`)
    chooses now.  ``backend=None`` (none chosen yet) always gets one.

    Args:
        backend: the backend in use, or None.
        device: the device the caller was given (None: the current CUDA device).
        pinned: the caller was given its backend or device: never switch.
        sweep: choose a sweep backend (:class:`CudaSweepBackend`).
        nvtx, syncs, boundary: for :func:`select_backend`.
    """
    if backend is not None and (
        pinned
        or backend.has_device_timing
        or not torch.cuda.is_initialized()  # first: a host step asks this at every entry (0.02 µs)
        or not torch.cuda.is_available()  # (0.6 µs on the 2-core CPU)
    ):
        return None
    if sweep:
        return select_sweep_backend(device)
    return select_backend(device, nvtx=nvtx, syncs=syncs, boundary=boundary)
