"""What the framework sweeps share.  Each framework's ``sweep`` is a short adapter: it builds
``train_step`` and ``make_batch`` from the framework's objects, names what to restore, and
calls :func:`stepprof.sweep` (:data:`run_sweep`)."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .._errors import warn
from .._sweep.result import SweepResult
from .._sweep.search import sweep as run_sweep
from .._validate import check_option_names
from ._samples import drawer

__all__ = [
    "SWEEP_OPTIONS",
    "apply_recommended",
    "batch_maker",
    "check_sweep_options",
    "overridden",
    "restored",
    "run_sweep",
    "step_optimizers",
]

#: :func:`stepprof.sweep`'s keyword options, which a framework sweep passes through.
SWEEP_OPTIONS = tuple(
    n for n, p in inspect.signature(run_sweep).parameters.items() if p.kind is p.KEYWORD_ONLY
)
_MISSING = object()


def check_sweep_options(options: dict[str, Any], caller: str, *, taken: Sequence[str] = ()) -> dict[str, Any]:
    """``options`` if each is one of :data:`SWEEP_OPTIONS` but ``taken`` (the adapter's own
    arguments), else a :class:`stepprof.UsageError` that names it and them."""
    return check_option_names(options, tuple(n for n in SWEEP_OPTIONS if n not in taken), caller)


def batch_maker(
    dataset: Any, collate: Callable[[list[Any]], Any], to_device: Callable[[Any], Any], empty: str
) -> Callable[[int], Any]:
    """``make_batch(n)``: ``n`` real samples of ``dataset`` (in order, cycling), collated and
    moved by ``to_device``.  ``empty``: the ConfigError's message for a dataset with no sample."""
    draw = drawer(dataset, empty)

    def make_batch(n: int) -> Any:
        return to_device(collate(draw(n)))

    return make_batch


def step_optimizers(optimizers: Sequence[Any], scaler: Any) -> None:
    """``step()`` of each optimizer, through the grad scaler (then its ``update()``) when there is one."""
    if scaler is not None:
        for o in optimizers:
            scaler.step(o)
        scaler.update()
    else:
        for o in optimizers:
            o.step()


def restored(model: Any, optimizers: Sequence[Any], scaler: Any, extra: Sequence[Any] = ()) -> tuple[Any, ...]:
    """What the sweep restores: the model, its optimizers, the grad scaler if any, and ``extra``."""
    return (model, *optimizers, *((scaler,) if scaler is not None else ()), *extra)


@contextlib.contextmanager
def overridden(obj: Any, **values: Any) -> Iterator[None]:
    """``obj``'s instance attributes set to ``values`` inside, and afterwards as they were
    (removed again where the instance had none: a method of its class shows through again)."""
    saved = {name: obj.__dict__.get(name, _MISSING) for name in values}
    try:
        for name, value in values.items():
            setattr(obj, name, value)
        yield
    finally:
        for name, value in saved.items():
            if value is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = value


def apply_recommended(result: SweepResult, set_batch: Callable[[int], Any], unset: Callable[[str], str]) -> None:
    """``set_batch(result.recommended)``; when no batch is recommended, the warning
    ``unset(result.reason)`` instead, at the framework sweep's caller."""
    if result.recommended is None:
        warn(unset(result.reason), stacklevel=3)
    else:
        set_batch(result.recommended)
