"""Opening a callback's profiler on the framework's device, and closing it without breaking
the framework's shutdown."""

from __future__ import annotations

from typing import Any

from .._errors import raised_by_user, warn
from .._recorder.profiler import Profiler


def on_device(options: dict[str, Any], device: Any) -> dict[str, Any]:
    """The callback's profiler options, profiling ``device`` (the framework's: the Trainer's
    ``args.device``, Lightning's ``strategy.root_device``) unless the user named one.  Only a
    CPU or CUDA device is passed on; on another, the profiler chooses as it would alone."""
    if "device" in options or getattr(device, "type", None) not in ("cpu", "cuda"):
        return options
    return {**options, "device": device}


def close_quietly(prof: Profiler, error: BaseException | None) -> Any:
    """Close ``prof`` (``error``: the exception that ended the run, if one did) and return its
    summary; a failure to close becomes one warning and None: stepprof never breaks training."""
    try:
        return prof.close(error)
    except Exception as e:  # noqa: BLE001 - close must not raise into the trainer's shutdown
        if raised_by_user(e):
            raise
        warn(f"stepprof: closing the profiler failed ({type(e).__name__}: {e})", stacklevel=3)
        return None
