"""stepprof's exceptions: one base class, each subclass also a fitting built-in."""

from __future__ import annotations

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


class MissingExtraError(StepprofError, ImportError):
    """An optional dependency is not installed; the message gives the install command."""
