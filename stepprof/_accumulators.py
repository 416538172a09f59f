"""Small accumulators, each with ``add`` and ``merge``: what a run's aggregate is built from.

``a.merge(b)`` folds in ``b``, a later stretch of the same stream: adding ``xs`` to ``a``
and ``ys`` to ``b``, then merging, leaves ``a`` as adding ``xs + ys`` to it would.  Each
keeps its result in ``value``.  ``merge`` may take parts of ``b``, which is not used after.
:class:`Fields` holds a record's accumulators, declared once by name: its ``merge`` is a loop.

Example:
    >>> a, b = Max(), Max()
    >>> a.add(3); b.add(5); a.merge(b)
    >>> a.value
    5
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Iterable
from typing import Any, ClassVar

from ._stats import QuantileSketch

__all__ = ["TABLE_CAP", "Counter", "Fields", "First", "FirstByKey", "FirstN", "Largest", "Last", "Max",
           "Sketch", "Sum", "Table", "Value"]

#: Keys a table keeps (sync sites, phase names, batch sizes, reasons); later keys are not added.
TABLE_CAP = 256


class Sketch(QuantileSketch):
    """A :class:`~stepprof._stats.QuantileSketch` (a hot loop may append to ``buf``): its value is itself."""

    __slots__ = ()

    @property
    def value(self) -> Sketch:
        return self


class Value:
    """One value, ``start`` before any; a merge adds the later stretch's, if it has one."""

    __slots__ = ("value",)

    def __init__(self, start: Any = None) -> None:
        self.value = start

    def add(self, x: Any) -> None:
        raise NotImplementedError

    def merge(self, other: Value) -> None:
        if other.value is not None:
            self.add(other.value)


class Sum(Value):
    """A running total (of ints, in a log's aggregate: the same however the log is split)."""

    __slots__ = ()

    def __init__(self, start: Any = 0) -> None:
        self.value = start

    def add(self, x: Any = 1) -> None:
        self.value += x


class Max(Value):
    """The largest value added (``Max(False)``: a flag, set by adding True)."""

    __slots__ = ()

    def add(self, x: Any) -> None:
        if self.value is None or x > self.value:
            self.value = x


class First(Value):
    """The first value added (None before any)."""

    __slots__ = ()

    def add(self, x: Any) -> None:
        if self.value is None:
            self.value = x


class Last(Value):
    """The latest value added (None before any); a merge keeps ours if the later has none."""

    __slots__ = ()

    def add(self, x: Any) -> None:
        self.value = x


class Counter:
    """How often each key was added (``keys`` from the start): new keys only while below ``cap``."""

    __slots__ = ("value", "cap")

    def __init__(self, keys: Iterable[Hashable] = (), cap: float = TABLE_CAP) -> None:
        self.value: dict[Any, int] = dict.fromkeys(keys, 0)
        self.cap = cap

    def add(self, key: Hashable, n: int = 1) -> None:
        table = self.value
        if key in table:
            table[key] += n
        elif len(table) < self.cap:
            table[key] = n

    def merge(self, other: Counter) -> None:
        for key, n in other.value.items():
            self.add(key, n)


class FirstByKey:
    """The first value added for each key, while the table is below :data:`TABLE_CAP`."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: dict[Any, Any] = {}

    def add(self, key: Hashable, x: Any) -> None:
        if key not in self.value and len(self.value) < TABLE_CAP:
            self.value[key] = x

    def merge(self, other: FirstByKey) -> None:
        for key, x in other.value.items():
            self.add(key, x)


class FirstN:
    """The first ``cap`` values added, in order."""

    __slots__ = ("value", "cap")

    def __init__(self, cap: int) -> None:
        self.value: list[Any] = []
        self.cap = cap

    def add(self, x: Any) -> None:
        if len(self.value) < self.cap:
            self.value.append(x)

    def merge(self, other: FirstN) -> None:
        self.value.extend(other.value[: self.cap - len(self.value)])


class Largest(FirstN):
    """The ``cap`` largest tuples added, ranked by their first item (a heap, smallest first)."""

    __slots__ = ()

    def takes(self, key: Any) -> bool:
        """Whether a tuple ranked ``key`` would be kept (build it only then)."""
        return len(self.value) < self.cap or key > self.value[0][0]

    def add(self, x: tuple[Any, ...]) -> None:
        if len(self.value) < self.cap:
            heapq.heappush(self.value, x)
        elif x[0] > self.value[0][0]:
            heapq.heapreplace(self.value, x)

    def merge(self, other: FirstN) -> None:
        self.value = heapq.nlargest(self.cap, self.value + other.value)
        heapq.heapify(self.value)


class Table:
    """An accumulator per key, made by ``make`` (a class) while fewer than :data:`TABLE_CAP` keys."""

    __slots__ = ("value", "make")

    def __init__(self, make: Callable[[], Any]) -> None:
        self.value: dict[Any, Any] = {}
        self.make = make

    def at(self, key: Hashable) -> Any:
        """The key's accumulator (made if the table has room), or None."""
        acc = self.value.get(key)
        if acc is None and len(self.value) < TABLE_CAP:
            acc = self.value[key] = self.make()
        return acc

    def merge(self, other: Table) -> None:
        for key, acc in other.value.items():
            mine = self.value.get(key)
            if mine is not None:
                mine.merge(acc)
            elif len(self.value) < TABLE_CAP:
                self.value[key] = acc


class Fields:
    """Accumulators by name, declared once in ``FIELDS`` as (name, factory); a subclass sets
    ``__slots__`` to (at least) the names."""

    __slots__ = ()
    FIELDS: ClassVar[tuple[tuple[str, Callable[[], Any]], ...]] = ()

    def __init__(self) -> None:
        for name, make in self.FIELDS:
            setattr(self, name, make())

    def merge(self, other: Fields) -> None:
        """Merge each accumulator with ``other``'s of the same name."""
        for name, _ in self.FIELDS:
            getattr(self, name).merge(getattr(other, name))
