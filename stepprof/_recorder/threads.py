"""Each thread's step context, and the registry of them that a profiler's boundaries keep.

The *training thread* is the first to open a step: its steps run the hooks.  Steps of other
threads are recorded too, with their thread's name.  Every context is touched only by its own
thread, but for :meth:`Threads.forget` (a forked child) and :meth:`Threads.open_steps` (a read).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from .._syncs import SyncTracker
from .step import OpenPhase, Step

if TYPE_CHECKING:
    from .._batch import Tokens


class ThreadSteps:
    """One thread's step context: its open step, its phase stack, its sync tracker."""

    __slots__ = ("tid", "thread", "step", "stack", "last_top_mark", "tracker", "watching", "hooked",
                 "last_exit", "data_ns", "batch", "tokens")

    def __init__(self, tid: int, thread: str | None, tracker: SyncTracker, hooked: bool) -> None:
        self.tid = tid
        self.thread = thread  # the thread's name on its step records; None: the training thread
        self.step: Step | None = None
        self.stack: list[OpenPhase] = []
        self.last_top_mark: Any = None
        self.tracker = tracker
        self.watching = False
        self.hooked = hooked  # the training thread: its steps run the hooks
        self.last_exit = 0  # the clock when its last step's exit returned (0: none, or it failed)
        self.data_ns = -1  # time in stepprof.iterate's __next__ since then (-1: not used)
        self.batch: tuple[int | None, str | None] | None = None  # the last batch iterate() saw
        self.tokens: int | Tokens | None = None  # its tokens, for the next step (None: none counted)


class Threads:
    """Every thread's :class:`ThreadSteps`, made at its first step, and the open steps by thread.

    Args:
        sync_mode: the profiler's ``syncs`` setting, for each thread's sync tracker.
    """

    __slots__ = ("main", "contexts", "open", "_sync_mode", "_lock")

    def __init__(self, sync_mode: str) -> None:
        self._sync_mode = sync_mode
        self._lock = threading.Lock()  # a thread's first step: which thread is the training thread
        self.main: ThreadSteps | None = None  # the training thread's context
        self.contexts: dict[int, ThreadSteps] = {}  # every thread's, the training thread's included
        self.open: dict[int, Step] = {}  # the open steps, by thread

    def context(self) -> ThreadSteps:
        """The calling thread's step context (made at its first step)."""
        tid = threading.get_ident()
        ctx = self.main
        if ctx is not None and ctx.tid == tid:
            return ctx
        ctx = self.contexts.get(tid)
        if ctx is None:
            with self._lock:  # two threads' first steps at once: one of them is the first
                main = self.main is None
                ctx = ThreadSteps(tid, None if main else threading.current_thread().name,
                                  SyncTracker(self._sync_mode), hooked=main)
                self.contexts[tid] = ctx
                if main:
                    self.main = ctx
        return ctx

    def current(self) -> ThreadSteps | None:
        """The calling thread's context, if it has stepped (none is made)."""
        return self.contexts.get(threading.get_ident())

    def step(self) -> Step | None:
        """The calling thread's open step, or None."""
        ctx = self.current()
        return ctx.step if ctx is not None else None

    def step_of(self, tid: int | None) -> tuple[Step | None, bool]:
        """Thread ``tid``'s open step (None: the training thread's), and whether it has stepped."""
        ctx = self.main if tid is None else self.contexts.get(tid)
        return (None, False) if ctx is None else (ctx.step, True)

    def open_steps(self) -> list[Step]:
        """Every thread's open step."""
        return list(self.open.values())

    def forget(self) -> None:
        """In a forked child: the contexts are the parent's threads'."""
        self.main = None
        self.contexts.clear()
        self.open.clear()
        self._lock = threading.Lock()  # the parent's may have been held at the fork
