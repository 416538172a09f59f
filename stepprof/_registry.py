"""Every piece of process-wide state stepprof keeps, and the one :func:`reset` for tests.

- the *active* profilers: those entered with ``with Profiler(...)``, innermost
  last, each with the thread that entered it (:func:`push_active`, :func:`innermost`);
- the *default* profiler, used when none is active: made by
  :func:`stepprof.configure`, else on first use by the factory that
  :mod:`stepprof._api` installs (:func:`current`);
- the *open* profilers, held strongly so that one never closed is still flushed
  at interpreter exit (:func:`track_open`);
- the host RSS reader (:data:`HOST_RSS`) and the memory records' per-device
  baselines and references (:data:`MEMORY_MARKS`);
- the handlers at fork (a child forgets its parent's profilers), at exit (every
  open profiler is closed) and at SIGTERM and SIGINT (every open profiler writes its
  completed steps and a summary first; :mod:`stepprof._signals`).

Profilers are kept as objects with the few methods named in :class:`Registered`,
so this module imports neither torch nor the profiler.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from . import _signals
from ._device import nvml as _nvml
from ._errors import raised_by_user

__all__ = [
    "HOST_RSS",
    "MEMORY_MARKS",
    "HostRss",
    "MemoryMarks",
    "Registered",
    "Resettable",
    "current",
    "default_profiler",
    "forget_open",
    "innermost",
    "pop_active",
    "push_active",
    "register_state",
    "replace_default",
    "reset",
    "set_default_factory",
    "take_no_log_warning",
    "track_open",
]


class Registered(Protocol):
    """What the registry asks of a profiler (:class:`stepprof.Profiler` is one)."""

    @property
    def closed(self) -> bool: ...

    def close(self) -> Any: ...

    def _forked(self) -> None: ...

    def _end(self, ended_by: str) -> Any: ...

    def _on_signal(self, name: str) -> None: ...


class HostRss:
    """This process's resident set size, read at every step on the host.

    On Linux: one ``pread`` of ``/proc/self/statm``, kept open (about 1 µs; procfs
    regenerates the file on every read from offset 0), which is the figure psutil
    reads too.  Elsewhere: ``psutil.Process().memory_info().rss`` (about 12 µs).
    A forked child reopens its own (see :func:`_forget_in_child`).
    """

    def __init__(self) -> None:
        self._fd: int | None = None
        self._page = 0
        self._process: Any = None

    def read(self) -> int | None:
        try:
            if self._fd is None and self._process is None:
                self._open()
            if self._fd is not None:
                return int(os.pread(self._fd, 256, 0).split()[1]) * self._page
            return int(self._process.memory_info().rss)
        except Exception as e:  # noqa: BLE001 - a missing figure, never a crash
            if raised_by_user(e):
                raise
            return None

    def with_core(self, host_rss: Callable[[int, int], int]) -> Callable[[], int | None]:
        """A reader of this file through the host core's ``host_rss`` (one C call that keeps
        the GIL: ``os.pread`` lets go of it, and the collector thread takes it mid-step)."""

        def read() -> int | None:
            fd = self._fd
            if fd is None:
                return self.read()  # opens the file (or falls back to psutil)
            try:
                return host_rss(fd, self._page)
            except Exception as e:  # noqa: BLE001 - a missing figure, never a crash
                if raised_by_user(e):
                    raise
                return None

        return read

    def _open(self) -> None:
        try:
            self._page = os.sysconf("SC_PAGE_SIZE")
            self._fd = os.open("/proc/self/statm", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except (OSError, AttributeError, ValueError) as e:
            if raised_by_user(e):
                raise
            import psutil  # optional: only where /proc is missing

            self._process = psutil.Process()

    def forget(self) -> None:
        """After a fork or a reset: the open file and the psutil handle are let go."""
        fd, self._fd, self._process = self._fd, None, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError as e:
                if raised_by_user(e):
                    raise


class MemoryMarks:
    """Per device: the context baseline and the growth reference of memory records.

    Both map a device (``"cuda:0"``) to a :class:`stepprof._memory.Mark`;
    :mod:`stepprof._memory` reads and sets them under :attr:`lock`.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.baselines: dict[str, Any] = {}
        self.references: dict[str, Any] = {}

    def reset(self) -> None:
        with self.lock:
            self.baselines.clear()
            self.references.clear()


HOST_RSS = HostRss()
MEMORY_MARKS = MemoryMarks()

_lock = threading.Lock()
# Entered profilers, innermost last, each with the thread that entered it.
_active: list[tuple[int, Registered]] = []
_default: Registered | None = None
_make_default: Callable[[], Registered] | None = None
_warned_no_log = False
# Open profilers, held strongly: one that is never closed is still flushed at exit.
_open: set[Registered] = set()


# -- the active profilers ----------------------------------------------------------


def push_active(prof: Registered) -> None:
    with _lock:
        _active.append((threading.get_ident(), prof))


def pop_active(prof: Registered) -> None:
    """Remove ``prof``'s innermost entry, this thread's first; tolerate out-of-order exits."""
    tid = threading.get_ident()
    with _lock:
        for mine in (True, False):
            for i in range(len(_active) - 1, -1, -1):
                t, p = _active[i]
                if p is prof and (t == tid or not mine):
                    del _active[i]
                    return


def innermost() -> Any:
    """The calling thread's innermost entered profiler; else the innermost of any thread."""
    entered = _active[:]
    if not entered:
        return None
    tid = threading.get_ident()
    for t, p in reversed(entered):
        if t == tid:
            return p
    return entered[-1][1]


# -- the default profiler ----------------------------------------------------------


def current() -> Any:
    """The innermost active profiler, else the default one (made now if there is none open)."""
    prof = innermost()
    if prof is not None:
        return prof
    global _default
    with _lock:
        if _default is None or _default.closed:
            if _make_default is None:
                raise RuntimeError("stepprof._api installs the default profiler's factory at import")
            _default = _make_default()
        return _default


def default_profiler() -> Any:
    """The default profiler if one was made (it may be closed), else None; makes none."""
    return _default


def replace_default(prof: Registered) -> Any:
    """Make ``prof`` the default profiler; return the previous one (or None)."""
    global _default
    with _lock:
        old, _default = _default, prof
    return old


def set_default_factory(make: Callable[[], Registered]) -> None:
    """Install what :func:`current` calls to make a default profiler on first use."""
    global _make_default
    _make_default = make


def take_no_log_warning() -> bool:
    """True the first time it is called (after a reset): warn then that nothing is logged."""
    global _warned_no_log
    first, _warned_no_log = not _warned_no_log, True
    return first


# -- the open profilers, at fork and at exit -----------------------------------------


def track_open(prof: Registered) -> None:
    """A profiler opened: it is closed at exit, and flushed when SIGTERM or SIGINT arrives."""
    _open.add(prof)
    _signals.install(_flush_on_signal)


def forget_open(prof: Registered) -> None:
    """A profiler closed; with the last one, the previous signal handlers come back."""
    _open.discard(prof)
    if not _open:
        _signals.uninstall()


def _flush_on_signal(name: str) -> None:
    # Called by stepprof's SIGTERM/SIGINT handler, on the main thread, before the signal
    # proceeds: every open profiler writes its completed steps and a summary.
    for prof in list(_open):
        try:
            prof._on_signal(name)
        except Exception as e:  # noqa: BLE001, S110 - the next profiler, and the signal, go on
            if raised_by_user(e):
                raise


def _forget_in_child() -> None:
    # A forked child (a DataLoader worker, say) inherits the parent's profilers, their
    # pending steps and their log's descriptor.  A profiler records only in the process that
    # made it: in the child it goes inert, so that nothing is written twice or mixed into
    # the parent's log, and no device call is made (CUDA cannot be used after a fork).
    HOST_RSS.forget()
    for prof in _open:
        prof._forked()
    _open.clear()  # inert: nothing to close at exit or flush on a signal
    _signals.uninstall()
    _signals.forget_in_child()


def _close_all_at_exit() -> None:
    for prof in list(_open):
        try:
            prof._end("exit")
        except Exception as e:  # noqa: BLE001 - at interpreter exit, nothing may raise
            if raised_by_user(e):
                raise


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
# Registered after stepprof._device.nvml (imported above) registers its shutdown: atexit runs
# last-in, first-out, so profilers closing at exit can still read NVML.
atexit.register(_close_all_at_exit)


# -- state that other modules keep ----------------------------------------------------


class Resettable(Protocol):
    """A module's process-wide state object (the sync routes', the exchange's streams)."""

    def reset(self) -> None: ...


_states: list[Resettable] = []


_S = TypeVar("_S", bound=Resettable)


def register_state(state: _S) -> _S:
    """Name ``state`` here, so that :func:`reset` resets it; returns it."""
    _states.append(state)
    return state


# -- for tests ------------------------------------------------------------------------


def reset() -> list[Registered]:
    """Put every piece of stepprof's process-wide state back as it was at import.

    Closes the default profiler, forgets the active ones, the memory baselines, the
    host RSS reader, NVML's state and every state object passed to :func:`register_state`.
    Profilers still open stay open (and are closed
    at exit).

    Returns:
        The profilers that were still active: a test that leaves one active has a bug.
    """
    global _default, _warned_no_log
    with _lock:
        leftover = [prof for _, prof in _active]
        _active.clear()
        default, _default = _default, None
        _warned_no_log = False
    if default is not None:
        default.close()
    HOST_RSS.forget()
    MEMORY_MARKS.reset()
    _nvml.NVML.reset()
    if not _open:
        _signals.uninstall()
    for state in _states:
        state.reset()
    return leftover
