"""The buffers of the cross-rank exchange (:mod:`stepprof._dist`) on NCCL.

A step's vector goes from the training thread to pinned host memory, to the
device, through a collective (enqueued by ``stepprof._dist``, never waited on),
and back to pinned host memory on a side stream, read by the collector once the
copy has completed.  Nothing here synchronises.

The side streams (one per device) are this module's process-wide state,
:data:`SIDE_STREAMS`.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .._registry import register_state

__all__ = ["SIDE_STREAMS", "ExchangeSlots"]


class _SideStreams:
    """One CUDA stream per device for the copies back to the host, made at first use."""

    def __init__(self) -> None:
        self._streams: dict[Any, Any] = {}

    def get(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def reset(self) -> None:
        """Forget the streams (new ones are made at the next copy)."""
        self._streams.clear()


SIDE_STREAMS = register_state(_SideStreams())


class _Slot:
    """One exchange's buffers: pinned host in/out, device in/out, the copy-back event."""

    __slots__ = ("host_in", "dev_in", "dev_out", "host_out", "event")

    def __init__(self, device: torch.device, width: int, world: int) -> None:
        self.host_in = torch.empty(width, dtype=torch.float64, pin_memory=True)
        self.dev_in = torch.empty(width, dtype=torch.float64, device=device)
        self.dev_out = torch.empty(world * width, dtype=torch.float64, device=device)
        self.host_out = torch.empty(world * width, dtype=torch.float64, pin_memory=True)
        self.event: Any = None

    def fetch(self) -> list[float] | None:
        """On the collector, once the collective has completed: copy back; the values once done.

        The copy runs on a side stream (the collective's output is complete, so it waits
        on nothing), into pinned memory with ``non_blocking``: nothing here synchronises.
        """
        if self.event is None:
            device = self.dev_out.device
            with torch.cuda.device(device), torch.cuda.stream(SIDE_STREAMS.get(device)):
                self.host_out.copy_(self.dev_out, non_blocking=True)
                self.event = torch.cuda.Event()
                self.event.record()
        if not self.event.query():
            return None
        self.event = None
        return self.host_out.tolist()


class ExchangeSlots:
    """A ring of exchange buffers on CUDA device ``index``, each reused only once its
    exchange has completed (so a pending copy or collective never sees it rewritten).

    :meth:`stage` runs on the training thread at a step's exit: it writes the vector
    into pinned host memory and enqueues a ``non_blocking`` copy to the device on the
    current stream.  The collective that follows (enqueued by ``stepprof._dist``, never
    waited on) orders itself after that stream's work.  Buffers are allocated once,
    at the first exchange (a pinned allocation and two small device ones).
    """

    def __init__(self, index: int, width: int, world: int) -> None:
        self._device = torch.device("cuda", index)
        self._width, self._world = width, world
        self._free: list[_Slot] = []
        self._lock = threading.Lock()

    def stage(self, values: list[float]) -> _Slot | None:
        if torch.cuda.is_current_stream_capturing():
            return None  # a collective would become part of the user's CUDA graph
        with self._lock:
            slot = self._free.pop() if self._free else None
        if slot is None:
            slot = _Slot(self._device, self._width, self._world)
        slot.host_in.copy_(torch.tensor(values, dtype=torch.float64))
        slot.dev_in.copy_(slot.host_in, non_blocking=True)
        return slot

    def free(self, slot: _Slot) -> None:
        with self._lock:
            self._free.append(slot)
