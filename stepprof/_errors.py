"""stepprof's exceptions: one base class, each subclass also a fitting built-in."""

from __future__ import annotations


class StepprofError(Exception):
    """Base class of every error stepprof raises on purpose."""


class ConfigError(StepprofError, ValueError):
    """An argument or environment setting has a value stepprof cannot use."""


class UsageError(StepprofError, TypeError):
    """An API was called in a way it does not support (wrong nesting, missing brackets)."""


class MissingExtraError(StepprofError, ImportError):
    """An optional dependency is not installed; the message gives the install command."""
