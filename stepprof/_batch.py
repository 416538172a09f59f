"""The batch size of a batch that passes through stepprof, when none was given.

It is the leading dimension of the tensors in the batch: a tensor, a tuple or list, a dict,
or an object whose attributes hold them (a dataclass, a ``BatchEncoding``...), looked into
a few levels deep.  Every tensor found must agree: when two disagree (or the batch holds no
tensor with a leading dimension), the size is not inferred and the reason says why.
stepprof never guesses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ._errors import ConfigError, raised_by_user

__all__ = ["NO_BATCH", "check_batch", "infer_batch_size", "leading_sizes", "sample_counts", "total_batch_size"]

class _NoBatch:
    """The default of ``batch=``: no batch was passed (None may be a batch)."""

    def __repr__(self) -> str:  # how help() shows the default
        return "<no batch>"


#: No batch was passed (None may be a batch).
NO_BATCH: Any = _NoBatch()

#: How deep into nested containers the search goes, and how many tensors it looks at.
_DEPTH = 3
_MAX_TENSORS = 64


def total_batch_size(batches: Sequence[Any]) -> tuple[int | None, str | None]:
    """The summed size of ``batches`` (gradient accumulation's micro-batches), or (None, why):
    every batch's size must be inferred (:func:`infer_batch_size`)."""
    total = 0
    for i, batch in enumerate(batches):
        size, reason = infer_batch_size(batch)
        if size is None:
            return None, reason if len(batches) == 1 else f"micro-batch {i}: {reason}"
        total += size
    return total, None


def infer_batch_size(batch: Any) -> tuple[int | None, str | None]:
    """(the batch size, None), or (None, why it was not inferred).  Never raises.

    It runs none of the user's code: containers are read through the built-in types'
    own methods (a ``dict`` subclass's overridden ``items`` is not called), an object's
    attributes through its ``__dict__`` (no ``__getattr__``), a tensor subclass's shape
    with its ``__torch_function__`` disabled, and the keys named in a reason are shown
    only when they are strings or ints.
    """
    sizes: dict[int, tuple[Any, ...]] = {}
    try:
        _collect(batch, (), _DEPTH, sizes, 2)
    except Exception as e:  # noqa: BLE001 - an odd batch is a missing figure, never a broken step
        if raised_by_user(e):
            raise
        return None, f"not inferred: reading the batch raised {type(e).__name__}; pass batch_size=N"
    if len(sizes) == 1:
        return next(iter(sizes)), None
    if not sizes:
        return None, (
            f"not inferred: the batch ({type(batch).__name__}) holds no tensor with a leading "
            f"dimension; pass batch_size=N"
        )
    (a, where_a), (b, where_b) = list(sizes.items())[:2]
    return None, (
        f"not inferred: the batch's tensors disagree on their leading dimension "
        f"({_where(where_a)} has {a}, {_where(where_b)} has {b}); pass batch_size=N"
    )


def _where(path: tuple[Any, ...]) -> str:
    """``batch[0]['x'].y`` for a path of keys (int, str), attribute names (``.name``) and others."""
    out = ["batch"]
    for key in path:
        if type(key) is _Attr:
            out.append(f".{key.name}")
        elif type(key) in (int, str):
            out.append(f"[{key!r}]")
        else:
            out.append(f"[<{type(key).__name__}>]")
    return "".join(out)


class _Attr:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


def _leading(x: Any) -> int | None:
    """A tensor's leading dimension (None for a 0-d one), running no subclass code."""
    if type(x) is torch.Tensor or type(x) is torch.nn.Parameter:
        return int(x.shape[0]) if x.dim() > 0 else None
    with torch._C.DisableTorchFunctionSubclass():
        shape = torch.Tensor.size(x)
    return int(shape[0]) if len(shape) > 0 else None


def leading_sizes(batch: Any) -> dict[int, tuple[Any, ...]]:
    """Every distinct leading dimension of the tensors in ``batch``, each with where it was
    first found, read as :func:`infer_batch_size` reads a batch (that function wants one)."""
    sizes: dict[int, tuple[Any, ...]] = {}
    _collect(batch, (), _DEPTH, sizes, _MAX_TENSORS)
    return sizes


def sample_counts(batch: Any, depth: int = _DEPTH) -> list[int]:
    """The lengths of the lists and tuples in ``batch`` that hold tensors: a list of n
    per-sample tensors (or of n dicts of them, as detection models take) is n samples."""
    t = type(batch)
    if depth == 0 or not issubclass(t, (dict, list, tuple)):
        return []
    items = list(dict.values(batch)) if issubclass(t, dict) else list(batch)
    inner = [n for x in items for n in sample_counts(x, depth - 1)]
    if issubclass(t, dict) or not leading_sizes(batch):
        return inner
    return [len(batch), *inner]


def _collect(x: Any, where: tuple[Any, ...], depth: int, sizes: dict[int, tuple[Any, ...]], limit: int) -> None:
    if len(sizes) >= limit:
        return  # enough: infer_batch_size stops at a disagreement
    t = type(x)
    if issubclass(t, torch.Tensor):
        n = _leading(x)
        if n is not None:
            sizes.setdefault(n, where)
        return
    if depth == 0 or x is None or issubclass(t, (str, bytes, int, float, bool)):
        return
    if issubclass(t, dict):
        items: Any = dict.items(x)
    elif issubclass(t, tuple):
        items = enumerate(tuple.__iter__(x))
    elif issubclass(t, list):
        items = enumerate(list.__iter__(x))
    else:
        try:
            fields = object.__getattribute__(x, "__dict__")
        except AttributeError:
            return
        if type(fields) is not dict:
            return
        items = ((_Attr(k), v) for k, v in dict.items(fields) if type(k) is str and not k.startswith("_"))
    for n, (k, v) in enumerate(items):
        if n >= _MAX_TENSORS:
            return
        _collect(v, (*where, k), depth - 1, sizes, limit)


def check_batch(batch: Any, n: int) -> None:
    """Raise if ``make_batch(n)`` returned a batch whose size is detectably not ``n``.

    Tensors (found as :func:`stepprof._batch.infer_batch_size` finds them) must have ``n`` as
    some tensor's leading dimension, or sit in a list or tuple of ``n`` items (a list of
    samples); a list or tuple without tensors must have ``n`` items; a dict without tensors
    must have a list or tuple of ``n`` items among its values.  Other objects cannot be sized
    and are accepted.
    """
    if batch is None:
        raise ConfigError(
            f"make_batch({n}) returned None; make_batch(n) must return the batch of n samples "
            f"that train_step takes"
        )
    sizes = leading_sizes(batch)
    if sizes:
        if n not in sizes and n not in sample_counts(batch):
            got = ", ".join(str(s) for s in sorted(sizes))
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
