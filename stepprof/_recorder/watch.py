"""Finished step records handed to code outside the recorder (the framework callbacks).

:class:`WatchHook` is the last record hook, so a watcher sees each step record as the
log gets it (less ``run_id`` and the rank fields).  It runs on the collector thread: a
watcher must be quick and must not block.  A watcher that raises is dropped, with one
warning; recording goes on.
"""

from __future__ import annotations

from .._errors import raised_by_user, warn
from collections.abc import Callable
from typing import Any

from .hooks import Hook
from .step import Step

#: A watcher: called with each finished step record (do not modify it).
Watcher = Callable[[dict[str, Any]], None]


class WatchHook(Hook):
    """Calls each watcher with every finished step record."""

    def __init__(self) -> None:
        self.watchers: tuple[Watcher, ...] = ()

    def add(self, watcher: Watcher) -> None:
        self.watchers = (*self.watchers, watcher)

    def on_record(self, step: Step, record: dict[str, Any]) -> None:
        for watcher in self.watchers:
            try:
                watcher(record)
            except Exception as exc:  # never break the run for a watcher
                if raised_by_user(exc):
                    raise
                self.watchers = tuple(w for w in self.watchers if w is not watcher)
                warn(
                    f"stepprof: a step-record watcher ({watcher!r}) raised {exc!r}; it is no longer called", stacklevel=2)
