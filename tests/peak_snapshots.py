"""Synthetic allocator histories in the exact format of ``torch.cuda.memory._snapshot()``.

:class:`FakeAllocator` keeps segments and blocks the way torch's caching allocator reports
them (``segments``: ``device``, ``address``, ``total_size``, ``allocated_size``,
``active_size``, ``requested_size``, ``stream``, ``segment_type``, ``segment_pool_id``,
``is_expandable``, ``frames``, ``blocks``: ``address``, ``size``, ``requested_size``,
``state``, ``frames``) and, while recording, appends trace entries (``action``, ``addr``,
``size`` (the *requested* size, as torch records it), ``stream``, ``time_us``,
``frames``).  A snapshot appends a ``snapshot`` entry, as torch's does.  With
``annotating`` (torch's ``global_record_annotations``), :meth:`FakeAllocator.annotate`
records a ``record_function`` range's START or END as torch's RecordFunction callback does
(``recordAnnotation``: ``{"name", "stage", "device", "time_us"}`` in the trace's clock, one
list for all devices, in the order recorded), and snapshots carry them as
``external_annotations``.  Each
allocation gets a fresh segment of exactly its rounded size, so block sizes are the
512-byte-rounded requests.
"""

from __future__ import annotations

import copy
import time
from typing import Any

from stepprof._peak import round_block


def frame(name: str, filename: str, line: int) -> dict[str, Any]:
    return {"filename": filename, "line": line, "name": name}


class FakeAllocator:
    def __init__(self, device: int = 0, t_us: float | None = 1_000_000.0, gpu: Any = None) -> None:
        """``t_us`` None: the trace's clock is the host's epoch clock (as torch's is); ``gpu``: a
        ``tests.fakes.FakeGpu`` whose allocator counters follow these allocations."""
        self.device = device
        self.real_clock = t_us is None
        self.t_us = time.time_ns() / 1000 if t_us is None else t_us
        self.gpu = gpu
        self.segments: dict[int, dict[str, Any]] = {}
        self.trace: list[dict[str, Any]] = []
        self.recording = False
        self.annotating = False
        self.annotations: list[dict[str, Any]] = []
        self._next_addr = 0x7F0000000000
        self.allocated = 0
        self.peak = 0

    def tick(self, us: float = 10.0) -> float:
        self.t_us = time.time_ns() / 1000 if self.real_clock else self.t_us + us
        return self.t_us

    def _record(self, action: str, addr: int, size: int, frames: list[dict[str, Any]] | None = None) -> None:
        if self.recording:
            entry = {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": int(self.tick())}
            entry["frames"] = frames or []
            self.trace.append(entry)

    def annotate(self, name: str, stage: str, device: int | None = None) -> None:
        """A ``record_function`` range's ``"START"`` or ``"END"`` (torch records only while
        the history is on; ``device``: the recording thread's current device)."""
        if self.recording and self.annotating:
            self.annotations.append({"name": name, "stage": stage,
                                     "device": self.device if device is None else device,
                                     "time_us": int(self.tick())})

    def alloc(self, requested: int, frames: list[dict[str, Any]] | None = None) -> int:
        size = round_block(requested)
        addr = self._next_addr
        self._next_addr += size + 2 * 1024 * 1024
        self._record("segment_alloc", addr, size)
        self.segments[addr] = {
            "device": self.device, "address": addr, "total_size": size, "allocated_size": size,
            "active_size": size, "requested_size": requested, "stream": 0, "segment_type": "large",
            "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
            "blocks": [{"address": addr, "size": size, "requested_size": requested,
                        "state": "active_allocated", "frames": frames or []}],
        }
        self._record("alloc", addr, requested, frames)
        self.allocated += size
        self.peak = max(self.peak, self.allocated)
        if self.gpu is not None:
            self.gpu.alloc(size)
        return addr

    def alloc_tensor(self, t: Any, frames: list[dict[str, Any]] | None = None) -> int:
        """Record a (CPU) tensor's storage as an allocation at its real address."""
        s = t.untyped_storage()
        self._next_addr = s.data_ptr()
        addr = self.alloc(s.nbytes(), frames)
        self._next_addr = max(self._next_addr, 0x7F0000000000)
        return addr

    def free(self, addr: int) -> None:
        block = self.segments[addr]["blocks"][0]
        self._record("free_requested", addr, block["requested_size"])
        block["state"] = "inactive"
        self.segments[addr]["allocated_size"] = 0
        self.allocated -= block["size"]
        if self.gpu is not None:
            self.gpu.free(block["size"])
        self._record("free_completed", addr, block["requested_size"])

    def snapshot(self) -> dict[str, Any]:
        self._record("snapshot", 0, self.allocated)
        out = {"segments": copy.deepcopy(list(self.segments.values())),
               "device_traces": [copy.deepcopy(self.trace)] if self.device == 0 else
               [[] for _ in range(self.device)] + [copy.deepcopy(self.trace)],
               "allocator_settings": {}}
        if self.annotating:
            out["external_annotations"] = copy.deepcopy(self.annotations)
        return out

    def start(self) -> dict[str, Any]:
        """Recording on (history cleared), then the start snapshot."""
        self.trace = []
        self.annotations = []
        self.recording = True
        self.peak = self.allocated
        return self.snapshot()
