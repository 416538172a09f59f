"""stepprof's exceptions: one base class, each subclass also a fitting built-in."""

from __future__ import annotations

import signal
from typing import Any


class StepprofError(Exception):
    """Base class of every error stepprof raises on purpose."""


class ConfigError(StepprofError, ValueError):
    """An argument or environment setting has a value stepprof cannot use."""


class UsageError(StepprofError, TypeError):
    """An API was called in a way it does not support (wrong nesting, missing brackets)."""


class SyncBudgetExceeded(StepprofError, RuntimeError):
    """A step made more host-device syncs than its ``max_syncs`` with ``on_sync="raise"``.

    Raised at the offending line.  ``where`` is its ``file:line``, ``kind`` what
    synchronised there (``item``, ``nonzero``...), ``count`` how often that line has
    synced in this step.
    """

    def __init__(self, message: str, *, where: str, kind: str, count: int) -> None:
        super().__init__(message)
        self.where = where
        self.kind = kind
        self.count = count

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickle and copy call cls(*self.args) by default, which lacks the keyword arguments.
        return (_rebuild_sync_budget_exceeded, (str(self), self.where, self.kind, self.count))


def _rebuild_sync_budget_exceeded(message: str, where: str, kind: str, count: int) -> SyncBudgetExceeded:
    return SyncBudgetExceeded(message, where=where, kind=kind, count=count)


class BuildError(StepprofError, RuntimeError):
    """``stepprof build`` cannot compile the step boundary here; the message names what is
    missing and the fix."""


class MissingExtraError(StepprofError, ImportError):
    """An optional dependency is not installed; the message gives the install command."""


def raised_by_user(exc: BaseException) -> bool:
    """Whether ``exc`` is the user's, not stepprof's: a ``BaseException`` that is not an
    ``Exception`` (``KeyboardInterrupt``, ``SystemExit``), or one raised by a signal handler.

    A signal handler runs between two bytecodes of whatever code is running, stepprof's
    included; what it raises has the handler's frame in its traceback.  Only called on
    the exception path.
    """
    if not isinstance(exc, Exception):
        return True
    handlers = set()
    for sig in signal.valid_signals():
        try:
            h = signal.getsignal(sig)
        except (ValueError, OSError):  # pragma: no cover - a signal this platform lists but refuses
            continue
        h = getattr(h, "__func__", h)
        code = getattr(h, "__code__", None) or getattr(getattr(h, "func", None), "__code__", None)
        if code is not None:
            handlers.add(code)
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in handlers:
            return True
        tb = tb.tb_next
    return False
