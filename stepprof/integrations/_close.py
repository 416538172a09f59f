"""Closing a callback's profiler without breaking the framework's shutdown."""

from __future__ import annotations

from typing import Any

from .._errors import raised_by_user, warn
from .._recorder.profiler import Profiler


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
