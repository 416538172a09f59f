"""The batch size of a batch that passes through stepprof, when none was given.

It is the leading dimension of the tensors in the batch: a tensor, a tuple or list, a dict,
or an object whose attributes hold them (a dataclass, a ``BatchEncoding``...), looked into
a few levels deep.  Every tensor found must agree: when two disagree (or the batch holds no
tensor with a leading dimension), the size is not inferred and the reason says why.
stepprof never guesses.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["NO_BATCH", "infer_batch_size"]

class _NoBatch:
    """The default of ``batch=``: no batch was passed (None may be a batch)."""

    def __repr__(self) -> str:  # how help() shows the default
        return "<no batch>"


#: No batch was passed (None may be a batch).
NO_BATCH: Any = _NoBatch()

#: How deep into nested containers the search goes, and how many tensors it looks at.
_DEPTH = 3
_MAX_TENSORS = 64


def infer_batch_size(batch: Any) -> tuple[int | None, str | None]:
    """(the batch size, None), or (None, why it was not inferred)."""
    sizes: dict[int, str] = {}
    _collect(batch, "batch", _DEPTH, sizes)
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
        f"({where_a} has {a}, {where_b} has {b}); pass batch_size=N"
    )


def _collect(x: Any, where: str, depth: int, sizes: dict[int, str]) -> None:
    if len(sizes) > 1:
        return  # already in disagreement
    if isinstance(x, torch.Tensor):
        if x.dim() > 0:
            sizes.setdefault(int(x.shape[0]), where)
        return
    if depth == 0 or isinstance(x, (str, bytes, int, float, bool)) or x is None:
        return
    if isinstance(x, dict):
        items: Any = ((f"{where}[{k!r}]", v) for k, v in x.items())
    elif isinstance(x, (tuple, list)):
        items = ((f"{where}[{i}]", v) for i, v in enumerate(x))
    else:
        fields = getattr(x, "__dict__", None)
        if not isinstance(fields, dict):
            return
        items = ((f"{where}.{k}", v) for k, v in fields.items() if not k.startswith("_"))
    for n, (w, v) in enumerate(items):
        if n >= _MAX_TENSORS:
            return
        _collect(v, w, depth - 1, sizes)
