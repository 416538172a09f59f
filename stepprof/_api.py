"""The module-level API: the active-profiler stack, the default profiler, the
``profile_step`` / ``measure`` entry points that act on whichever is current, and
``memory_report``."""

from __future__ import annotations

import functools
import inspect
import os
import threading
import warnings
from collections.abc import Callable
from typing import Any, TypeVar, overload

import torch

from . import _memory
from ._cuda import memory_backend
from ._errors import ConfigError, UsageError
from ._dist import RANKS_EVERY
from ._memory import MemoryReport
from ._profiler import Profiler, _StepContext
from ._validate import (
    MEMORY_EVERY,
    PHASE_PEAKS_EVERY,
    check_batch_size,
    check_budget,
    check_memory_every,
    check_name,
    check_phase_peaks_every,
    check_report_device,
    check_warmup_variable,
)

__all__ = ["configure", "current", "measure", "memory_report", "profile_step"]

F = TypeVar("F", bound=Callable[..., Any])

_lock = threading.Lock()
# Entered profilers, innermost last, each with the thread that entered it.
_active: list[tuple[int, Profiler]] = []
_default: Profiler | None = None
_warned_no_log = False


def push_active(prof: Profiler) -> None:
    with _lock:
        _active.append((threading.get_ident(), prof))


def pop_active(prof: Profiler) -> None:
    # Remove the innermost occurrence, this thread's first; tolerate out-of-order exits.
    tid = threading.get_ident()
    with _lock:
        for mine in (True, False):
            for i in range(len(_active) - 1, -1, -1):
                t, p = _active[i]
                if p is prof and (t == tid or not mine):
                    del _active[i]
                    return


def _innermost() -> Profiler | None:
    """The calling thread's innermost entered profiler; else the innermost of any thread."""
    entered = _active[:]
    if not entered:
        return None
    tid = threading.get_ident()
    for t, p in reversed(entered):
        if t == tid:
            return p
    return entered[-1][1]


def current() -> Profiler:
    """The profiler that ``profile_step``/``measure`` act on now.

    The calling thread's innermost active ``with Profiler(...)`` (a thread that has
    none uses the innermost one of another thread); else the default profiler, made
    by :func:`configure` or, on first use, from the ``STEPPROF_LOG`` and
    ``STEPPROF_WARMUP`` environment variables.
    """
    prof = _innermost()
    if prof is not None:
        return prof
    global _default
    with _lock:
        if _default is None or _default.closed:
            _default = _from_environment()
        return _default


def _from_environment() -> Profiler:
    global _warned_no_log
    warmup = check_warmup_variable(os.environ.get("STEPPROF_WARMUP", "0"))
    log = os.environ.get("STEPPROF_LOG") or None
    if log is None and not _warned_no_log:
        _warned_no_log = True
        warnings.warn(
            "stepprof: no Profiler is active and no log is configured, so steps are timed "
            "but nothing is written. Use `with stepprof.Profiler(path):`, stepprof.configure(log=path) "
            "or set STEPPROF_LOG.",
            UserWarning,
            stacklevel=4,
        )
    try:
        return Profiler(log, warmup=warmup)
    except ConfigError as e:
        raise ConfigError(f"STEPPROF_LOG: {e}") from e


def configure(
    *,
    log: str | os.PathLike[str] | None,
    warmup: int = 0,
    device: str | int | torch.device | None = None,
    nvtx: bool = True,
    syncs: str = "warn",
    max_syncs: int | None = None,
    on_sync: str = "count",
    memory_every: int = MEMORY_EVERY,
    phase_peaks_every: int = PHASE_PEAKS_EVERY,
    flops: str | None = None,
    flops_per_step: float | None = None,
    ranks_every: int = RANKS_EVERY,
    log_ranks: str = "all",
    group: Any = None,
) -> Profiler:
    """Set up the default profiler, used when no ``with Profiler(...)`` is active.

    A previous default profiler is closed (its summary written) first.  The
    default profiler is closed at interpreter exit.  Arguments are those of
    :class:`stepprof.Profiler`.

    Returns:
        The new default profiler.
    """
    global _default
    new = Profiler(
        log, warmup=warmup, device=device, nvtx=nvtx, syncs=syncs, max_syncs=max_syncs,
        on_sync=on_sync, memory_every=check_memory_every(memory_every),
        phase_peaks_every=check_phase_peaks_every(phase_peaks_every), flops=flops,
        flops_per_step=flops_per_step, ranks_every=ranks_every, log_ranks=log_ranks, group=group,
    )
    with _lock:
        old, _default = _default, new
    if old is not None:
        old.close()
    return new


class _ProfileStep:
    """``stepprof.profile_step``: see :meth:`__call__`."""

    def __call__(
        self,
        name: str | None = None,
        *,
        batch_size: int | None = None,
        max_syncs: int | None = None,
        on_sync: str | None = None,
    ) -> _StepContext:
        """A context manager around one training step of the current profiler.

        Args:
            name: the step's name in the log (default ``"step"``).
            batch_size: samples in the step; enables ``samples_per_s``.
            max_syncs: this step's sync budget (default: the profiler's, None).
            on_sync: ``"count"``, ``"warn"`` or ``"raise"`` when the step goes over
                ``max_syncs`` (default: the profiler's, ``"count"``).

        Example:
            >>> import stepprof
            >>> with stepprof.Profiler(None) as prof:
            ...     with stepprof.profile_step(batch_size=16):
            ...         pass
            >>> prof.summary.steps
            1
        """
        return _StepContext(
            None, check_name(name), check_batch_size(batch_size), *check_budget(max_syncs, on_sync)
        )

    def __enter__(self) -> None:
        raise UsageError("use `with stepprof.profile_step():` (did you forget the brackets?)")

    def __exit__(self, *exc: Any) -> None:  # pragma: no cover - __enter__ always raises
        pass

    def __repr__(self) -> str:
        return "<function stepprof.profile_step>"


class _Measure:
    """A named measurement: a context manager, and a decorator via ``__call__``.

    Inside an open step it times a phase of that step; outside, it is a step.
    Inside a ``torch.compile``d region it does nothing (and adds no graph break).
    """

    __slots__ = ("_name", "_profiler", "_tokens")

    def __init__(self, name: str | None, profiler: Profiler | None) -> None:
        self._name = name
        self._profiler = profiler
        self._tokens: list[tuple[Profiler, Any]] = []

    def __enter__(self) -> _Measure:
        if torch.compiler.is_compiling():
            return self
        if self._name is None:
            raise UsageError(
                "measure() used as a context manager needs a name: `with stepprof.measure('forward'):`"
            )
        prof = self._profiler or current()
        self._tokens.append((prof, prof._enter(self._name, None, step=False)))
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if torch.compiler.is_compiling() or not self._tokens:
            return
        prof, token = self._tokens.pop()
        prof._exit(token, exc)

    def __call__(self, fn: F) -> F:
        if isinstance(fn, (staticmethod, classmethod)):
            # @measure above @staticmethod/@classmethod: measure the function inside and
            # wrap it again, so that it still binds as a static or class method.
            return type(fn)(self(fn.__func__))  # type: ignore[return-value]
        if not callable(fn):
            raise UsageError(
                f"measure({self._name!r}) decorates a function; got {fn!r}. "
                f"Use `@stepprof.measure({self._name!r})` above a def"
            )
        if inspect.iscoroutinefunction(fn) or inspect.isgeneratorfunction(fn) or (
            inspect.isasyncgenfunction(fn)
        ):
            raise UsageError(
                f"measure cannot time {getattr(fn, '__qualname__', fn)!r}: it is a generator or "
                f"coroutine function, whose body runs after the call returns. Measure the code "
                f"that consumes it with `with stepprof.measure(...)` instead"
            )
        name = self._name or getattr(fn, "__qualname__", None) or repr(fn)
        bound = self._profiler

        @functools.wraps(fn)
        def measured(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():
                return fn(*args, **kwargs)
            prof = bound or current()
            token = prof._enter(name, None, step=False)
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:
                prof._exit(token, e)
                raise
            prof._exit(token, None)
            return result

        return measured  # type: ignore[return-value]

    def __repr__(self) -> str:
        return f"<stepprof.measure {self._name!r}>"


def make_measure(name: Any, profiler: Profiler | None) -> Any:
    if name is None or isinstance(name, str):
        return _Measure(name, profiler)
    if callable(name) or isinstance(name, (staticmethod, classmethod)):  # bare decorator: @measure
        return _Measure(None, profiler)(name)
    raise UsageError(
        f"measure() takes a name (str) or a function (got {name!r}); "
        f"use @stepprof.measure, @stepprof.measure('name') or `with stepprof.measure('name'):`"
    )


class _MeasureFactory:
    """``stepprof.measure``: see :meth:`__call__`."""

    @overload
    def __call__(self, name: F) -> F: ...
    @overload
    def __call__(self, name: str | None = None) -> _Measure: ...

    def __call__(self, name: Any = None) -> Any:
        """Time a phase of the current step, or a whole step when no step is open.

        Usable three ways: ``@stepprof.measure``, ``@stepprof.measure("name")``
        and ``with stepprof.measure("name"):``.  A phase name used several
        times in one step (gradient accumulation) is summed, with a ``count``.

        Example:
            >>> import stepprof
            >>> with stepprof.Profiler(None) as prof:
            ...     @stepprof.measure
            ...     def train_step():
            ...         with stepprof.measure("forward"):
            ...             pass
            ...     train_step()
            >>> prof.summary.steps
            1
        """
        return make_measure(name, None)

    def __enter__(self) -> None:
        raise UsageError("use `with stepprof.measure('name'):` (did you forget the brackets?)")

    def __exit__(self, *exc: Any) -> None:  # pragma: no cover - __enter__ always raises
        pass

    def __repr__(self) -> str:
        return "<function stepprof.measure>"


profile_step = _ProfileStep()
measure = _MeasureFactory()


def memory_report(device: str | int | torch.device | None = None) -> MemoryReport:
    """Reconcile this process's GPU memory now, and say why nvidia-smi shows more than PyTorch.

    It reads torch's allocator, ``cudaMemGetInfo`` and NVML (about 65 µs, plus
    ``nvmlInit`` the first time) and returns a :class:`stepprof.MemoryReport`.
    While a profiler is active (the innermost ``with Profiler(...)``, else a
    default profiler already set up), the report is also written to its log as
    a ``kind: "memory"`` record.  It never initialises CUDA and never raises for
    a missing figure: without CUDA every figure is None with the reason.

    Args:
        device: ``"cuda:N"``, ``N`` or a ``torch.device``; None reads the active
            profiler's device, else the current CUDA device.

    Example:
        >>> import stepprof
        >>> report = stepprof.memory_report()
        >>> print(report.explanation)  # doctest: +SKIP
        nvidia-smi shows 3.91 GiB for this process: 1.60 GiB live tensors, 1.59 GiB cached by PyTorch's allocator for reuse (not a leak), 0.72 GiB CUDA context and libraries.
    """
    dev = check_report_device(device)
    prof = _innermost()
    if prof is None:
        prof = _default
    if prof is not None and not prof.closed:
        return prof._memory_report(dev)
    return _memory.report(memory_backend(dev), trigger=_memory.ON_DEMAND)
