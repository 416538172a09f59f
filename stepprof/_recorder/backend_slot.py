"""The profiler's device backend, and how it changes during a run.

It is chosen at the first step; a host backend moves to CUDA at the first step after the
training code initialised CUDA (``device=None``); and with ``boundary="auto"`` the compiled
boundary is built in a background process and taken at a step entry once it has loaded
(:func:`stepprof._device.compiled.build_in_background`).  A step ends on the backend it
began on (:attr:`stepprof._recorder.step.Step.backend`), so a change at one thread's step
entry never moves another thread's open step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import _memory
from .._device import compiled
from .._device.backend import Backend, HostBackend
from .._device.cuda import CudaBackend
from .._device.select import upgrade_from_host
from .._errors import raised_by_user
from .._registry import HOST_RSS


class BackendSlot:
    """The backend in use, the host-RSS reader, and the compiled boundary awaited.

    Args:
        backend: the backend, or None to choose it at the first step.
        device: the ``device`` argument (None: CUDA once the training code initialised it).
        nvtx, syncs, boundary: the profiler's settings the backend is made with.
        read_rss: reads this process's resident set size (host steps record it).
    """

    __slots__ = ("backend", "read_rss", "core_reason", "awaiting", "_device", "_pinned", "_nvtx", "_syncs",
                 "_boundary")

    def __init__(self, backend: Backend | None, *, device: torch.device | None, nvtx: bool, syncs: str,
                 boundary: str, read_rss: Callable[[], int | None]) -> None:
        self.backend = backend
        self.read_rss = read_rss
        #: Why the compiled boundary is not used (None: it is, or no backend could use it).
        self.core_reason: str | None = None
        #: The background build awaited (boundary="auto"), taken at a step entry once it has
        #: loaded or failed (:meth:`ready`); None when none is awaited.
        self.awaiting: Any = None
        self._device = device
        self._pinned = backend is not None or device is not None
        self._nvtx = nvtx
        self._syncs = syncs
        self._boundary = boundary
        if backend is not None and backend.has_device_memory:
            _memory.observe(backend)

    def ensure(self) -> Backend:
        """The backend, chosen at the first step; a host one moves to CUDA once it is up."""
        b = upgrade_from_host(self.backend, self._device, pinned=self._pinned, nvtx=self._nvtx,
                              syncs=self._syncs, boundary=self._boundary)
        if b is None:
            return self.backend  # type: ignore[return-value]
        self.backend = b
        if b.has_device_memory:  # CUDA, seen for the first time: the context baseline
            _memory.observe(b)
        if self._boundary != "python":
            self._await_core(b)
        return b

    def _await_core(self, b: Backend) -> None:
        """A backend that could use the compiled boundary and does not: have it built in the
        background, to take at a step entry."""
        if type(b) is CudaBackend or (type(b) is HostBackend and self.read_rss == HOST_RSS.read):
            self.awaiting, self.core_reason = compiled.build_in_background()
            if self.awaiting is not None and self.awaiting.module is not None:
                self.take_core()
        elif b.boundary == "compiled":
            self.awaiting = self.core_reason = None

    def ready(self) -> bool:
        """Whether the awaited build has loaded or failed (call only while one is awaited)."""
        core = self.awaiting
        return core is not None and (core.module is not None or core.reason is not None)

    def take_core(self) -> None:
        """Take the background build (at a step's entry: this thread has no step open)."""
        core, self.awaiting = self.awaiting, None
        if core is None:  # another thread's step entry took it just now
            return
        module, self.core_reason = core.module, core.reason
        if module is None:
            return
        b = self.backend
        try:
            if type(b) is CudaBackend and getattr(module, "CUDA", False):
                self.backend = compiled.CompiledCudaBackend.adopt(b, module)
            elif type(b) is HostBackend and hasattr(module, "host_rss"):
                self.read_rss = HOST_RSS.with_core(module.host_rss)
        except Exception as e:  # noqa: BLE001 - the Python boundary goes on
            if raised_by_user(e):
                raise
            self.core_reason = f"the compiled boundary could not be taken ({type(e).__name__}: {e})"

    def reason(self) -> str | None:
        """Why the run's device work was not on the compiled boundary (for the summary)."""
        if self._boundary == "python":
            return "boundary='python' was asked for"
        if self.awaiting is not None:
            return ("the compiled boundary was still being built in the background when the run "
                    "closed; the next run uses it")
        return self.core_reason

    def device_index(self) -> int | None:
        """The backend's device index, if it has one."""
        return self.backend.index if self.backend is not None else None
