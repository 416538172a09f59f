"""The sweep's argument checks: each raises a :class:`stepprof.ConfigError` or
:class:`stepprof.UsageError` that names the value and the fix."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from .._errors import ConfigError, UsageError

__all__ = [
    "check_batch",
    "check_callable",
    "check_fraction",
    "check_int",
    "check_max_batch",
    "check_progress",
    "check_restore",
    "check_seconds",
]


def check_int(value: Any, name: str, minimum: int, hint: str) -> int:
    """``value`` if it is an int (not a bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name!r} must be an int >= {minimum} (got {value!r}); {hint}")
    if value < minimum:
        raise ConfigError(f"{name!r} must be >= {minimum} (got {value}); {hint}")
    return value


def check_max_batch(max_batch: Any, start: int) -> None:
    """``max_batch`` must be None, or an int >= 1 and >= ``start``."""
    if max_batch is None:
        return
    check_int(max_batch, "max_batch", 1, "pass None for no limit")
    if max_batch < start:
        raise ConfigError(
            f"'max_batch' must be >= 'start' ({start}) (got {max_batch}); raise max_batch, "
            f"lower start, or pass max_batch=None"
        )


def check_seconds(value: Any, name: str, *, allow_zero: bool) -> float:
    """``value`` as float seconds: finite, and > 0 (or >= 0 with ``allow_zero``)."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{name!r} must be a finite number of seconds {bound} (got {value!r})")
    return float(value)


def check_fraction(value: Any, name: str, example: str) -> float:
    """``value`` as a float strictly between 0 and 1."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ConfigError(f"{name!r} must be a fraction between 0 and 1 (got {value!r}); e.g. {example}")
    return float(value)


def check_progress(progress: Any) -> None:
    """``progress`` must be True, False or a callable taking a line."""
    if not (isinstance(progress, bool) or callable(progress)):
        raise ConfigError(f"'progress' must be True, False or a callable taking a line (got {progress!r})")


def check_callable(fn: Any, name: str, example: str) -> None:
    """Raise a :class:`UsageError` (a TypeError) when ``fn`` is not callable."""
    if callable(fn):
        return
    hint = ""
    if isinstance(fn, torch.Tensor) or fn is None:
        hint = " (did you call it? pass the function itself, without brackets)"
    raise UsageError(f"{name!r} must be callable (got {fn!r}){hint}; {example}")


def check_restore(restore: Any) -> tuple[Any, ...]:
    """The objects of ``restore`` (None, one, or a list or tuple), each with state dicts."""
    if restore is None:
        return ()
    objs = tuple(restore) if isinstance(restore, (list, tuple)) else (restore,)
    for obj in objs:
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise ConfigError(
                f"'restore' takes objects with state_dict() and load_state_dict(), such as a "
                f"module or an optimizer (got {obj!r}); pass e.g. restore=(model, optimizer)"
            )
    return objs


def _leading_sizes(batch: Any, depth: int = 0) -> list[int]:
    """The leading dimensions of the tensors in a batch (a tensor, or containers of them)."""
    if isinstance(batch, torch.Tensor):
        return [int(batch.shape[0])] if batch.dim() >= 1 else []
    if depth >= 3:
        return []
    if isinstance(batch, Mapping):
        items: Any = batch.values()
    elif isinstance(batch, (list, tuple)):
        items = batch
    else:
        return []
    return [s for x in items for s in _leading_sizes(x, depth + 1)]


def _sample_list_lengths(batch: Any, depth: int = 0) -> list[int]:
    """The lengths of the lists and tuples in a batch that hold tensors: a list of n
    per-sample tensors (or of n dicts of them, as detection models take) is n samples."""
    if depth >= 3:
        return []
    if isinstance(batch, Mapping):
        return [s for x in batch.values() for s in _sample_list_lengths(x, depth + 1)]
    if isinstance(batch, (list, tuple)):
        inner = [s for x in batch for s in _sample_list_lengths(x, depth + 1)]
        return ([len(batch)] if _leading_sizes(batch, depth) else []) + inner
    return []


def check_batch(batch: Any, n: int) -> None:
    """Raise if ``make_batch(n)`` returned a batch whose size is detectably not ``n``.

    Tensors (alone, or in a tuple, list or dict) must have ``n`` as some tensor's
    leading dimension, or sit in a list or tuple of ``n`` items (a list of samples);
    a list or tuple without tensors must have ``n`` items; a
    dict without tensors must have a list or tuple of ``n`` items among its values.
    Other objects cannot be sized and are accepted.
    """
    if batch is None:
        raise ConfigError(
            f"make_batch({n}) returned None; make_batch(n) must return the batch of n samples "
            f"that train_step takes"
        )
    sizes = _leading_sizes(batch)
    if sizes:
        if n not in sizes and n not in _sample_list_lengths(batch):
            got = ", ".join(str(s) for s in sorted(set(sizes)))
            raise ConfigError(
                f"make_batch({n}) returned a batch of {got} samples (the leading dimension of its "
                f"tensors), not {n}; make_batch(n) must return exactly n samples"
            )
        return
    if isinstance(batch, (list, tuple)):
        if len(batch) != n:
            raise ConfigError(
                f"make_batch({n}) returned a {type(batch).__name__} of {len(batch)} items, not {n}; "
                f"make_batch(n) must return exactly n samples"
            )
        return
    if isinstance(batch, Mapping):
        lens = [len(v) for v in batch.values() if isinstance(v, (list, tuple))]
        if lens and n not in lens:
            raise ConfigError(
                f"make_batch({n}) returned a dict whose lists hold {sorted(set(lens))} items, not {n}; "
                f"make_batch(n) must return exactly n samples"
            )
