"""Facts about the machine's CUDA devices and allocator, for ``stepprof env`` and the records."""

from __future__ import annotations

import os
from typing import Any

import torch

from .._errors import raised_by_user

__all__ = ["allocator_facts", "device_facts", "device_name"]


def device_facts(index: int) -> dict[str, Any]:
    """Name, capability and memory of CUDA device ``index`` (initialises CUDA)."""
    props = torch.cuda.get_device_properties(index)
    return {
        "name": torch.cuda.get_device_name(index),
        "capability": f"{props.major}.{props.minor}",
        "total_memory_bytes": int(props.total_memory),
        "multiprocessors": props.multi_processor_count,
    }


def allocator_facts() -> dict[str, Any]:
    """The caching allocator's configuration, read without initialising CUDA."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    alt = os.environ.get("PYTORCH_ALLOC_CONF")
    raw = conf if conf is not None else alt
    backend = None
    try:
        backend = torch.cuda.get_allocator_backend() if torch.cuda.is_initialized() else None
    except Exception as e:  # noqa: BLE001 - old torch
        if raised_by_user(e):
            raise
        backend = None
    if backend is None:
        compact = (raw or "").replace(" ", "").lower()
        backend = "cudaMallocAsync" if "backend:cudamallocasync" in compact else "native"
    expandable = raw is not None and "expandable_segments:true" in raw.replace(" ", "").lower()
    return {
        "PYTORCH_CUDA_ALLOC_CONF": conf,
        "PYTORCH_ALLOC_CONF": alt,
        "backend": backend,
        "expandable_segments": expandable,
    }


def device_name(index: int) -> str | None:
    """The GPU model of CUDA device ``index`` (``torch.cuda.get_device_name``), or None."""
    try:
        return torch.cuda.get_device_name(index)
    except Exception as e:  # noqa: BLE001 - a missing name, never a crash
        if raised_by_user(e):
            raise
        return None
