"""SIGTERM and SIGINT: write what is ready and the summary, then let the signal proceed.

While a profiler is open, stepprof's handler sits in front of the handlers that were
installed when the first one opened (yours, Python's ``default_int_handler``, or the
default action).  It calls back into the registry, which flushes every open profiler
(completed steps, then a summary with ``ended_by``), and then does exactly what the
previous handler would have done: calls it, or, for the default action, restores it and
raises the signal again, so the process ends as it would have without stepprof (killed
by the signal, with the same exit status).  A signal that was ignored stays ignored:
no handler is put in front of it.

Handlers can only be set from the main thread: a profiler opened on another thread
installs none (the next one opened on the main thread does).  The handlers that were
there before come back when the last profiler closes, in a forked child, and at reset,
unless something replaced stepprof's handler meanwhile: that one is left in place.

A signal that lands while the main thread holds a collector's lock (its own harvest, a
flush, close) is deferred: the handler records it and returns, and :class:`Deferring`
raises it again as the lock is let go, so the handler then finds the lock free and the
interrupted harvest complete.  The signal proceeds at most one harvest late.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

from ._errors import raised_by_user

__all__ = ["SIGNALS", "Deferring", "forget_in_child", "install", "installed", "start_thread", "uninstall"]

#: The signals whose arrival ends a run: pre-emption (Slurm, Kubernetes) and Ctrl-C.
SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGINT", None)) if s is not None)

#: signal number -> the handler stepprof's replaced (what it chains to).
_previous: dict[int, Any] = {}
#: Called with the signal's name before the signal proceeds; never raises.
_on_signal: Callable[[str], None] | None = None


#: The :class:`Deferring` blocks the main thread is inside, and the signals they deferred.
_holds: list[Deferring] = []
_deferred: list[int] = []


class Deferring:
    """``with Deferring(lock), lock:``: on the main thread, a SIGTERM or SIGINT that
    arrives inside the block waits until the lock is let go (see the module's docstring).

    The block is counted before the lock is taken and uncounted after it is let go, so
    that no signal finds the lock held by the thread it interrupts.  The lock is taken by
    its own ``with``, so an interrupt cannot leave it held; one can leave a count behind
    (a watchdog's exception between two lines here), which the next signal drops once its
    lock is free (:func:`_holding`).
    """

    __slots__ = ("_lock",)

    def __init__(self, lock: Any) -> None:
        self._lock = lock

    def __enter__(self) -> None:
        if threading.get_ident() == _MAIN_IDENT:
            _holds.append(self)

    def __exit__(self, *exc: object) -> None:
        if threading.get_ident() == _MAIN_IDENT:
            _leave(self)


def _leave(hold: Deferring) -> None:
    if hold in _holds:
        _holds.remove(hold)
    if _deferred and not _holding():
        _redeliver()


def _holding() -> bool:
    """Whether the main thread is inside a :class:`Deferring` block (stale counts dropped)."""
    _holds[:] = [h for h in _holds if h._lock.locked()]
    return bool(_holds)


def _redeliver() -> None:
    """Raise the deferred signals again, each once: whatever handles the signal now (stepprof's
    handler, or what replaced it meanwhile) runs inside ``raise_signal``, as if it came now."""
    while _deferred:
        signal.raise_signal(_deferred.pop(0))


_MAIN_IDENT = threading.main_thread().ident


def _handler(signum: int, frame: Any) -> Any:
    if _holds and _holding():  # the main thread is inside a harvest, a flush or close: after it
        if signum not in _deferred:  # (pending twice is pending once, as the kernel has it)
            _deferred.append(signum)
        return None
    name = signal.Signals(signum).name
    on_signal = _on_signal
    if on_signal is not None:
        try:
            on_signal(name)
        except Exception as e:  # noqa: BLE001, S110 - the signal must proceed whatever happened here
            if raised_by_user(e):
                raise
    previous = _previous.get(signum, signal.SIG_DFL)
    if callable(previous):
        return previous(signum, frame)  # the user's, or Python's default_int_handler
    # The default action (or a handler set outside Python, which getsignal shows as None):
    # put it back and raise the signal again, so the process ends as it would have.
    _previous.pop(signum, None)
    signal.signal(signum, signal.SIG_DFL if previous is None else previous)
    signal.raise_signal(signum)
    return None


def install(on_signal: Callable[[str], None]) -> None:
    """Put stepprof's handler in front of SIGTERM's and SIGINT's (main thread only; idempotent)."""
    global _on_signal
    _on_signal = on_signal
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in SIGNALS:
        if signum in _previous:
            continue
        try:
            current = signal.getsignal(signum)
            if current is signal.SIG_IGN or current is _handler:
                continue  # ignored: nothing ends the run, and it stays ignored
            signal.signal(signum, _handler)
        except (ValueError, OSError, RuntimeError) as e:  # not the main interpreter, say
            if raised_by_user(e):
                raise
            continue
        _previous[signum] = current


def uninstall() -> None:
    """Put the previous handlers back where stepprof's is still the one installed."""
    for signum, previous in list(_previous.items()):
        try:
            if signal.getsignal(signum) is _handler:
                signal.signal(signum, signal.SIG_DFL if previous is None else previous)
        except (ValueError, OSError, RuntimeError) as e:  # off the main thread: try again later
            if raised_by_user(e):
                raise
            continue
        _previous.pop(signum, None)


def forget_in_child() -> None:
    """In a forked child: no deferral is under way there, and its main thread is the forker."""
    global _MAIN_IDENT
    _holds.clear()
    _deferred.clear()
    _MAIN_IDENT = threading.main_thread().ident


def installed() -> bool:
    """Whether stepprof's handler is in front of any signal."""
    return bool(_previous)


def start_thread(thread: threading.Thread) -> None:
    """``thread.start()``, with every signal blocked on the calling thread meanwhile.

    A signal handler that raises inside ``Thread.start`` (a watchdog's ``TimeoutError``)
    can leave the thread started but broken: CPython then removes it from its registry
    while it runs, and it dies at its first line.  Blocked, the signal waits in the
    kernel and its handler runs just after.  The thread inherits the mask: stepprof's
    threads never take a signal (Python runs handlers on the main thread anyway).
    """
    mask = getattr(signal, "pthread_sigmask", None)
    if mask is None:  # pragma: no cover - Windows
        thread.start()
        return
    previous = mask(signal.SIG_BLOCK, _all_signals())
    try:
        thread.start()
    finally:
        mask(signal.SIG_SETMASK, previous)


_ALL: set[int] | None = None


def _all_signals() -> set[int]:
    global _ALL
    if _ALL is None:
        _ALL = set(signal.valid_signals())
    return _ALL
