"""What a sweep writes as it goes: its JSON-lines records and its progress lines."""

from __future__ import annotations

import logging
import os
import secrets
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import attrs

from .._errors import warn
from .._log import JsonlWriter
from .._schema import SCHEMA_VERSION
from .._units import format_bytes
from .result import SweepPoint, SweepResult

__all__ = ["SweepOutput", "progress_printer"]


#: Where a sweep's progress goes when ``progress=True`` and logging is configured.
LOGGER = logging.getLogger("stepprof.sweep")


def progress_printer(progress: bool | Callable[[str], Any]) -> Callable[[str], Any] | None:
    """What receives the progress lines: for True, the ``stepprof.sweep`` logger at INFO when a
    handler is configured for it (its own, ``stepprof``'s or the root's), else stderr; nothing
    for False; else the callable."""
    if progress is True:
        def say(line: str) -> None:
            if LOGGER.hasHandlers():
                LOGGER.info(line)
            else:
                print(line, file=sys.stderr, flush=True)

        return say
    return progress or None


class SweepOutput:
    """One sweep's log (``writer``, None for none) and progress lines (``say``, None for none).

    Every record carries the sweep's ``run_id``.
    """

    def __init__(self, say: Callable[[str], Any] | None) -> None:
        self.say = say
        self.writer: JsonlWriter | None = None
        self.run_id = secrets.token_hex(6)  # this sweep's, on each record it logs

    def line(self, text: str) -> None:
        """Print one progress line, if there is a receiver."""
        if self.say is not None:
            self.say(text)

    def opening(self, device: str, capacity: int | None, *, warmup: int, steps: int, min_time_ns: int) -> None:
        """The first line: the device, its capacity and what each trial runs."""
        if self.say is None:
            return
        cap = "" if capacity is None else f", {format_bytes(capacity)} usable by torch's allocator"
        self.say(
            f"stepprof.sweep: on {device}{cap}; per batch size: make_batch once, "
            f"{warmup} warm-up step(s), then timed steps (at least {steps} "
            f"and {min_time_ns / 1e9:g} s)"
        )

    def point(self, point: SweepPoint, phase: str) -> None:
        """Log one trial's point and print its line."""
        self.log(point.to_record())
        if self.say is None:
            return
        tail = ""
        if point.oom:
            tail = (
                "; memory back to the pre-trial baseline" if point.leaked_bytes == 0
                else f"; {format_bytes(point.leaked_bytes)} still allocated after clean-up"
                if point.leaked_bytes else ""
            )
        self.say(f"stepprof.sweep: [{point.trial:>2} {phase:<8}] {point}{tail} ({point.wall_s:.2f} s)")

    def result(self, result: SweepResult) -> SweepResult:
        """Log the result and print its line; the result, with ``unavailable["log"]`` when logging failed."""
        self.log(result.to_record())
        if self.writer is not None and self.writer.failed:
            result = attrs.evolve(result, unavailable={**result.unavailable, "log": self.writer.failed})
        self.line(f"stepprof.sweep: recommended batch {result.recommended}: {result.reason}")
        return result

    def log(self, record: dict[str, Any]) -> None:
        """Append ``record`` to the sweep's log, if it has one.

        The writer never raises: a write that fails (disk full) stops the log.  The
        sweep goes on, warns once here, and the result's ``unavailable["log"]`` says why.
        """
        writer = self.writer
        if writer is None or writer.failed:
            return
        writer.write({"schema_version": SCHEMA_VERSION, **record, "run_id": self.run_id})
        if writer.failed:
            warn(
                f"stepprof.sweep: {writer.failed}; logging stopped, the sweep goes on", stacklevel=_caller_stacklevel(),
            )


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning issued by the caller at the first frame outside stepprof."""
    frame: FrameType | None
    frame, level = sys._getframe(2), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR + os.sep):
        frame, level = frame.f_back, level + 1
    return level
