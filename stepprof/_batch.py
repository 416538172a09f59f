"""The batch size of a batch that passes through stepprof, when none was given; and its tokens.

It is the leading dimension of the tensors in the batch: a tensor, a tuple or list, a dict,
or an object whose attributes hold them (a dataclass, a ``BatchEncoding``...), looked into
a few levels deep.  Every tensor found must agree: when two disagree (or the batch holds no
tensor with a leading dimension), the size is not inferred and the reason says why.
stepprof never guesses.

Its tokens (:func:`count_tokens`) are those of its ``input_ids`` (a key or attribute), else of
its first 2-D integer tensor (the batch itself, or an item of a tuple, list or dict): the
elements of that tensor, or the non-zero ones of the ``attention_mask`` beside it (the padding
left out).  A mask on a GPU is counted there, and read back only once the step's events have
completed: no synchronisation.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from ._errors import ConfigError, raised_by_user

__all__ = [
    "NO_BATCH", "Tokens", "check_batch", "count_tokens", "infer_batch_size", "leading_sizes", "sample_counts",
    "total_batch_size", "total_tokens",
]

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


class Tokens:
    """A step's tokens: those known now, the GPU counts still on their way, or why there are none.

    ``pending`` holds (a pinned host tensor, the event recorded after the copy into it): a
    mask counted on the GPU, read by :meth:`value` once the event has completed.
    """

    __slots__ = ("known", "pending", "reason")

    def __init__(self, known: int = 0, pending: tuple[tuple[Any, Any], ...] = (), reason: str | None = None) -> None:
        self.known = known
        self.pending = pending
        self.reason = reason

    def plus(self, other: Tokens | None, where: str) -> Tokens:
        """These tokens and those of a further micro-batch (gradient accumulation sums them),
        named ``where`` in a reason; ``other`` None: it holds none."""
        if self.reason is not None:
            return self
        if other is None or other.reason is not None:
            why = other.reason if other is not None else "it holds no input_ids or 2-D integer tensor; pass tokens=N"
            return Tokens(reason=f"{where}: {why}")
        return Tokens(self.known + other.known, self.pending + other.pending)

    def value(self) -> tuple[int | None, str | None]:
        """(the count, None), or (None, why): never waits on the device."""
        if self.reason is not None:
            return None, self.reason
        total = self.known
        for host, done in self.pending:
            if not done.query():
                return None, "the attention mask's count was still on the GPU when the record was built"
            total += int(host)
        return total, None

    def __repr__(self) -> str:
        return f"Tokens(known={self.known}, pending={len(self.pending)}, reason={self.reason!r})"


#: The integer dtypes a token tensor has (uint8 is left out: it is an image's).
_TOKEN_DTYPES = frozenset({torch.int64, torch.int32, torch.int16})


def count_tokens(batch: Any) -> Tokens | None:
    """The tokens of ``batch`` (see the module's docstring), or None when it holds none: no
    ``input_ids`` and no 2-D integer tensor.  Runs none of the user's code; never raises."""
    try:
        ids, mask = _token_tensors(batch)
        if ids is None:
            return None
        if mask is None:
            return Tokens(_numel(ids))
        if _shape(mask) != _shape(ids):
            return Tokens(reason=f"the attention_mask's shape {tuple(_shape(mask))} is not input_ids' "
                                 f"{tuple(_shape(ids))}; pass tokens=N")
        if mask.device.type == "cpu":
            return Tokens(int(torch.count_nonzero(mask)))
        return Tokens(pending=(_count_on_device(mask),))
    except Exception as e:  # noqa: BLE001 - an odd batch is a missing figure, never a broken step
        if raised_by_user(e):
            raise
        return Tokens(reason=f"not counted: reading the batch raised {type(e).__name__}; pass tokens=N")


def total_tokens(batches: Sequence[Any]) -> Tokens | None:
    """The summed tokens of ``batches`` (gradient accumulation's micro-batches); None when none
    holds any, null with the reason when only some do."""
    counts = [count_tokens(b) for b in batches]
    if all(c is None for c in counts):
        return None
    total = Tokens()
    for i, c in enumerate(counts):
        total = total.plus(c, f"micro-batch {i}")
    return total


def _count_on_device(mask: torch.Tensor) -> tuple[Any, Any]:
    """The mask's non-zero count, copied to pinned memory on the current stream, and the event
    after the copy: two kernels and an event, no synchronisation."""
    with torch._C.DisableTorchFunctionSubclass():
        n = torch.count_nonzero(mask)
    host = torch.empty((), dtype=torch.int64, pin_memory=True)
    host.copy_(n, non_blocking=True)
    done = torch.Event(mask.device)
    done.record()
    return host, done


def _is_token_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype in _TOKEN_DTYPES and len(_shape(x)) == 2


def _shape(x: Any) -> Any:
    with torch._C.DisableTorchFunctionSubclass():
        return torch.Tensor.size(x)


def _numel(x: Any) -> int:
    shape = _shape(x)
    return int(shape[0]) * int(shape[1])


def _token_tensors(batch: Any, depth: int = 2) -> tuple[Any, Any]:
    """(the token tensor, its attention mask or None), or (None, None): the batch itself, its
    ``input_ids`` (a key or attribute; a ``BatchEncoding``'s are in its ``data``, one level
    down), else the first found ``depth`` levels into it, read as :func:`_items` reads them."""
    if _is_token_tensor(batch):
        return batch, None
    items = _items(batch)
    if items is None:
        return None, None
    if isinstance(batch, (tuple, list)):
        pairs = list(itertools.islice(items, _MAX_TENSORS))
    else:  # a dict or an object: its input_ids by name
        pairs = list(items)
        named = {k.name if type(k) is _Attr else k: v for k, v in pairs}
        ids = named.get("input_ids")
        if _is_token_tensor(ids):
            mask = named.get("attention_mask")
            return ids, mask if isinstance(mask, torch.Tensor) else None
    for _, x in pairs[:_MAX_TENSORS] if depth > 0 else ():
        ids, mask = _token_tensors(x, depth - 1)
        if ids is not None:
            return ids, mask
    return None, None


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


def _items(x: Any) -> Iterable[tuple[Any, Any]] | None:
    """The (key, value) pairs inside a container, read through the built-in types' own methods
    (a ``dict`` subclass's overridden ``items`` is not called): a dict's items, a tuple's or
    list's (index, item), an object's public attributes from its ``__dict__`` (keyed by
    :class:`_Attr`, no ``__getattr__``); None for a tensor, a scalar or None."""
    t = type(x)
    if x is None or issubclass(t, (torch.Tensor, str, bytes, int, float, bool)):
        return None
    if issubclass(t, dict):
        return dict.items(x)
    if issubclass(t, tuple):
        return enumerate(tuple.__iter__(x))
    if issubclass(t, list):
        return enumerate(list.__iter__(x))
    try:
        fields = object.__getattribute__(x, "__dict__")
    except AttributeError:
        return None
    if type(fields) is not dict:
        return None
    return ((_Attr(k), v) for k, v in dict.items(fields) if type(k) is str and not k.startswith("_"))


def _collect(x: Any, where: tuple[Any, ...], depth: int, sizes: dict[int, tuple[Any, ...]], limit: int) -> None:
    if len(sizes) >= limit:
        return  # enough: infer_batch_size stops at a disagreement
    t = type(x)
    if issubclass(t, torch.Tensor):
        n = _leading(x)
        if n is not None:
            sizes.setdefault(n, where)
        return
    items = _items(x) if depth > 0 else None
    if items is None:
        return
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
