"""Real samples for a framework sweep's ``make_batch``: drawn from the training dataset."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._errors import ConfigError


def drawer(dataset: Any, empty: str) -> Callable[[int], list[Any]]:
    """``draw(n)``: the dataset's first ``n`` samples, cycling; an iterable dataset gives its
    next ``n``, starting over at its end.  ``empty``: the :class:`ConfigError`'s message for a
    dataset with no sample."""
    mapped = hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")
    if mapped and not isinstance(dataset, torch.utils.data.IterableDataset):
        size = len(dataset)
        if size == 0:
            raise ConfigError(empty)
        return lambda n: [dataset[i % size] for i in range(n)]
    it: list[Iterator[Any]] = [iter(dataset)]

    def draw(n: int) -> list[Any]:
        out: list[Any] = []
        fresh = False  # the iterator was just started over: a StopIteration now means no sample
        while len(out) < n:
            try:
                out.append(next(it[0]))
                fresh = False
            except StopIteration:
                if fresh:
                    raise ConfigError(empty) from None
                it[0], fresh = iter(dataset), True
        return out

    return draw
