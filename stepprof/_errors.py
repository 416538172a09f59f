"""stepprof's exceptions: one base class, each subclass also a fitting built-in."""

from __future__ import annotations

import signal
import sys
import warnings
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


class StepprofWarning(RuntimeWarning):
    """stepprof's own trouble, said while training goes on (a log that cannot be written,
    recording that stopped after an internal error).

    Filter it by class (``warnings.filterwarnings("ignore", category=stepprof.StepprofWarning)``).
    A filter that turns warnings into errors (``-W error``, pytest's
    ``filterwarnings = error``) does not turn this one into an exception: stepprof's trouble
    never becomes the training's.  Under such a filter it is written to stderr instead.
    """


def warn(message: str, *, stacklevel: int = 1) -> None:
    """Warn with a :class:`StepprofWarning`; never raises it, whatever the filters say.

    ``stacklevel`` counts from the caller, as in :func:`warnings.warn`.  Under an ``error``
    filter, or a ``showwarning`` hook that raises, the message goes to stderr instead.  An
    exception of the user's (a signal handler's) still propagates.
    """
    try:
        warnings.warn(message, StepprofWarning, stacklevel=stacklevel + 1)
    except Exception as e:  # noqa: BLE001 - an error filter, or a showwarning hook that raised
        if raised_by_user(e):
            raise
        _to_stderr(f"StepprofWarning: {message} (written here, not raised: a warnings filter "
                   f"or hook turned it into {type(e).__name__})")


def _to_stderr(text: str) -> None:
    stream = sys.stderr
    if stream is None:
        return
    try:
        stream.write(text + "\n")
        stream.flush()
    except Exception as e:  # noqa: BLE001 - a closed or broken stderr: nothing left to tell
        if raised_by_user(e):
            raise


class BuildError(StepprofError, RuntimeError):
    """``stepprof build`` cannot compile the step boundary here; the message names what is
    missing and the fix."""


class MissingExtraError(StepprofError, ImportError):
    """An optional dependency is not installed; the message gives the install command."""


def raised_by_user(exc: BaseException) -> bool:
    """Whether ``exc`` is the user's, not stepprof's: a ``BaseException`` that is not an
    ``Exception`` (``KeyboardInterrupt``, ``SystemExit``), or one raised by a signal handler.

    Every guard around stepprof's own work calls this first and re-raises when it is true.
    Only called on the exception path.
    """
    return not isinstance(exc, Exception) or from_signal_handler(exc)


def from_signal_handler(exc: BaseException) -> bool:
    """Whether a Python signal handler raised ``exc`` (or a function it called).

    A signal handler runs between two bytecodes of whatever code is running, stepprof's
    included; what it raises has the handler's frame in its traceback, below the frame
    that caught it.  About 35 µs
    (one ``getsignal`` per signal), and nothing when the traceback has one frame.
    """
    tb = exc.__traceback__
    if tb is None or tb.tb_next is None:
        return False  # raised in the catching frame itself: no handler ran
    tb = tb.tb_next  # the catching frame may be a handler itself (stepprof's): only deeper ones count
    global _SIGNALS
    if _SIGNALS is None:
        _SIGNALS = tuple(sorted(signal.valid_signals()))
    handlers = set()
    for sig in _SIGNALS:
        try:
            h = signal.getsignal(sig)
        except (ValueError, OSError):  # pragma: no cover - a signal this platform lists but refuses
            continue
        if not callable(h):
            continue  # SIG_DFL, SIG_IGN, None (installed outside Python)
        h = getattr(h, "__func__", h)  # a bound method
        code = getattr(h, "__code__", None)
        if code is None:  # a callable object, or a functools.partial
            inner = getattr(h, "func", None) or getattr(type(h), "__call__", None)
            inner = getattr(inner, "__func__", inner)
            code = getattr(inner, "__code__", None)
        if code is not None:
            handlers.add(code)
    if not handlers:
        return False
    while tb is not None:
        if tb.tb_frame.f_code in handlers:
            return True
        tb = tb.tb_next
    return False


_SIGNALS: tuple[int, ...] | None = None
