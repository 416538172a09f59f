"""The step and phase scopes that user code opens, and the two public objects that make them.

- :class:`StepScope`: ``with prof.step():`` and ``with stepprof.profile_step():``;
- :class:`MeasureScope`: ``with stepprof.measure("forward"):`` and ``@stepprof.measure``,
  a phase inside an open step, else a step;
- :class:`ProfileStepFunction` and :class:`MeasureFunction`: the types of
  ``stepprof.profile_step`` and ``stepprof.measure``, functions that also refuse
  ``with stepprof.measure:`` (no brackets) with a hint.

A scope made without a profiler finds it when it is entered, through
:func:`stepprof._registry.current`.  Inside a ``torch.compile``d region every
scope does nothing (and adds no graph break).
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, TypeVar, overload

import torch

from ._batch import NO_BATCH, Tokens, count_tokens, infer_batch_size
from ._errors import UsageError, raised_by_user
from ._registry import current
from ._validate import check_batch_size, check_budget, check_name, check_tokens

__all__ = [
    "IterateFunction",
    "Iterated",
    "MeasureFunction",
    "MeasureScope",
    "NO_BATCH",
    "ProfileStepFunction",
    "Recorder",
    "StepScope",
    "iterate_over",
    "make_measure",
    "step_scope",
]

F = TypeVar("F", bound=Callable[..., Any])

#: Whether torch.compile is tracing this code (every scope then does nothing): bound once, as
#: each scope asks it twice.  Dynamo knows the function itself, so it still adds no graph break.
_compiling = torch.compiler.is_compiling
#: Whether a torch.profiler is recording: one C call, asked at each scope's entry.  While it
#: is, every step and phase is also a ``record_function`` range in its trace (:func:`_open_range`).
_profiling = torch._C._autograd._profiler_enabled


class Recorder(Protocol):
    """What a scope asks of a profiler (:class:`stepprof.Profiler` is one)."""

    def _enter(
        self, name: str | None, batch_size: int | None, step: bool,
        budget: tuple[int | None, str | None] = (None, None), batch_reason: str | None = None,
        batch: Any = NO_BATCH,
    ) -> Any: ...  # (called by position: a keyword call costs more at every boundary)

    def _exit(self, token: Any, exc: BaseException | None) -> None: ...

    def _note_batch(self, data_ns: int, batch: Any) -> None: ...


class _Scope:
    """What the step and phase scopes share: the tokens they entered, and their exit.

    The exit is defined once here and inherited (not a call away: it runs at every scope exit).
    """

    __slots__ = ("_tokens",)
    #: (profiler, token) for each entry not exited yet; with a third item, the torch.profiler
    #: range it opened (:func:`_open_range`).
    _tokens: list[tuple[Any, ...]]

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        tokens = token = None
        try:
            tokens = self._tokens
            if not tokens or _compiling():
                return
            entry = tokens[-1]  # it leaves the list only once the profiler has closed it
            prof, token = entry[0], entry[1]
            prof._exit(token, exc)
        except BaseException as e:
            if token is None and tokens:  # cut short before it read its token
                prof, token = tokens[-1][0], tokens[-1][1]
            if token is not None:
                _exit_again(prof, token, e)
            raise
        finally:
            if tokens and token is not None and tokens[-1][1] is token:
                entry = tokens.pop()
                if len(entry) > 2:
                    _close_range(entry[2])


class StepScope(_Scope):
    """The context manager returned by :meth:`Profiler.step` and :func:`stepprof.profile_step`."""

    __slots__ = ("_profiler", "_name", "_batch_size", "_budget", "_batch_reason", "_count")

    def __init__(
        self,
        profiler: Recorder | None,
        name: str | None,
        batch_size: int | None,
        max_syncs: int | None = None,
        on_sync: str | None = None,
        batch: Any = NO_BATCH,
        tokens: int | None = None,
    ) -> None:
        self._profiler = profiler
        self._name = name
        self._batch_reason = None
        self._count: int | Tokens | None = tokens  # an explicit count wins
        if batch is not NO_BATCH:  # the batch is not kept
            if batch_size is None:  # an explicit batch_size wins
                batch_size, self._batch_reason = infer_batch_size(batch)
            if tokens is None:
                self._count = count_tokens(batch)
        self._batch_size = batch_size
        self._budget = (max_syncs, on_sync)
        self._tokens: list[tuple[Any, ...]] = []

    def __enter__(self) -> StepScope:
        if _compiling():
            return self
        prof = self._profiler or current()
        token = None
        try:
            token = prof._enter(self._name, self._batch_size, True, self._budget, self._batch_reason)
            self._tokens.append((prof, token))
            if self._count is not None and _is_step(token):  # (not a step: the profiler does not record)
                token.tokens = self._count
            if _profiling():
                self._tokens[-1] = (prof, token, _open_range(token, None))
            return self
        except BaseException as e:
            _abandon(self._tokens, prof, token, e)
            raise


class MeasureScope(_Scope):
    """A named measurement: a context manager, and a decorator via ``__call__``.

    Inside an open step it times a phase of that step; outside, it is a step.
    """

    __slots__ = ("_name", "_profiler")

    def __init__(self, name: str | None, profiler: Recorder | None) -> None:
        self._name = name
        self._profiler = profiler
        self._tokens: list[tuple[Any, ...]] = []

    def __enter__(self) -> MeasureScope:
        if _compiling():
            return self
        if self._name is None:
            raise UsageError(
                "measure() used as a context manager needs a name: `with stepprof.measure('forward'):`"
            )
        prof = self._profiler or current()
        token = None
        try:
            token = prof._enter(self._name, None, False)
            self._tokens.append((prof, token))
            if _profiling():
                self._tokens[-1] = (prof, token, _open_range(token, self._name))
            return self
        except BaseException as e:
            _abandon(self._tokens, prof, token, e)
            raise

    def __call__(self, fn: F) -> F:
        if isinstance(fn, (staticmethod, classmethod)):
            # @measure above @staticmethod/@classmethod: measure the function inside and
            # wrap it again, so that it still binds as a static or class method.
            return type(fn)(self(fn.__func__))
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
        at = _batch_position(fn)  # the batch, if it opens a step: its first argument (after self)

        @functools.wraps(fn)
        def measured(*args: Any, **kwargs: Any) -> Any:
            if _compiling():
                return fn(*args, **kwargs)
            prof = bound or current()
            token = span = None
            try:
                token = prof._enter(name, None, False, (None, None), None, args[at] if len(args) > at else NO_BATCH)
                if _profiling():
                    span = _open_range(token, name)
                result = fn(*args, **kwargs)
            except BaseException as e:
                if token is not None:
                    try:
                        prof._exit(token, e)
                    except BaseException as e2:
                        _exit_again(prof, token, e2)
                        raise
                    finally:
                        _close_range(span)
                raise
            try:
                prof._exit(token, None)
            except BaseException as e:
                _exit_again(prof, token, e)
                raise
            finally:
                _close_range(span)
            return result

        return measured  # type: ignore[return-value]

    def __repr__(self) -> str:
        return f"<stepprof.measure {self._name!r}>"


def _batch_position(fn: Callable[..., Any]) -> int:
    """Where a measured function's batch is: its first argument, or its second after ``self``/``cls``."""
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature
        return 0
    return 1 if params and params[0] in ("self", "cls") else 0


class Iterated:
    """What ``stepprof.iterate(loader)`` returns: the iterable, each item timed on its way out.

    Iterating it iterates ``iterable`` (again for each ``for``, like a DataLoader), hands each
    item on unchanged, and tells the profiler how long ``__next__`` took and the batch's size
    (:func:`stepprof._batch.infer_batch_size`); the thread's next step records both
    (``data_ms``, ``batch_size``).  ``len()`` is the iterable's.
    """

    __slots__ = ("_iterable", "_profiler")

    def __init__(self, iterable: Iterable[Any], profiler: Recorder | None) -> None:
        self._iterable = iterable
        self._profiler = profiler

    def __iter__(self) -> Iterator[Any]:
        return _Timed(iter(self._iterable), self._profiler)

    def __len__(self) -> int:
        return len(self._iterable)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"<stepprof.iterate {self._iterable!r}>"


class _Timed:
    """One pass over an :class:`Iterated`."""

    __slots__ = ("_it", "_profiler")

    def __init__(self, it: Iterator[Any], profiler: Recorder | None) -> None:
        self._it = it
        self._profiler = profiler

    def __iter__(self) -> _Timed:
        return self

    def __next__(self) -> Any:
        t0 = time.perf_counter_ns()
        item = next(self._it)  # StopIteration and the loader's own errors go to the loop
        t1 = time.perf_counter_ns()
        try:
            (self._profiler or current())._note_batch(t1 - t0, item)
        except Exception as e:  # noqa: BLE001 - stepprof never breaks training
            if raised_by_user(e):
                raise
        return item


# An interrupt (KeyboardInterrupt, or an exception that a signal handler raises) may land
# at any bytecode here too.  The profiler's own entry and exit leave the thread's step
# context consistent whatever they meet; these helpers make sure that a scope whose entry
# or exit was cut short still hands its token back, so the step is closed (and recorded
# with the interrupt as its error).  An exit is idempotent, so a second one is harmless.


def _is_step(token: Any) -> bool:
    """Whether a profiler's entry token is the step it opened (else a phase, or nothing the
    profiler records)."""
    return hasattr(token, "phases")


def _open_range(token: Any, name: str | None) -> Any:
    """A ``record_function`` range for the step or phase ``token`` just entered, while a
    torch.profiler records: a step is named as torch.profiler names its steps
    (``ProfilerStep#N``, N the step's index), so that HTA and TensorBoard find them; a phase by
    its name.  None where there is none to open (a step the profiler does not record)."""
    try:
        if _is_step(token):
            label = f"ProfilerStep#{token.index}"
        elif hasattr(token, "key"):  # a phase
            label = name or "phase"
        else:
            return None
        span = torch.autograd.profiler.record_function(label)
        span.__enter__()
        return span
    except Exception as e:  # noqa: BLE001 - a range is a view, never a broken step
        if raised_by_user(e):
            raise
        return None


def _close_range(span: Any) -> None:
    """Close a range :func:`_open_range` opened (None: none)."""
    if span is None:
        return
    try:
        span.__exit__(None, None, None)
    except Exception as e:  # noqa: BLE001 - a range is a view, never a broken step
        if raised_by_user(e):
            raise


def _abandon(tokens: list[tuple[Any, ...]], prof: Recorder, token: Any, exc: BaseException) -> None:
    """An entry cut short after the profiler opened ``token``: close it (the body never runs)."""
    if token is None:
        return
    entry: tuple[Any, ...] = ()
    if tokens and tokens[-1][1] is token:
        entry = tokens.pop()
    try:
        prof._exit(token, exc)
        if len(entry) > 2:
            _close_range(entry[2])
    except BaseException:  # noqa: BLE001, S110 - the interrupt that is propagating is the user's
        pass


def _exit_again(prof: Recorder, token: Any, exc: BaseException) -> None:
    """An exit that raised: exit again, in case an interrupt cut the first one short before
    the profiler's own code ran (the caller then re-raises ``exc``)."""
    try:
        prof._exit(token, exc)  # idempotent: closes what the first call left open
    except BaseException:  # noqa: BLE001, S110 - the first exception is the one to raise
        pass


def step_scope(
    profiler: Recorder | None, name: Any, batch_size: Any, max_syncs: Any, on_sync: Any, batch: Any, tokens: Any,
) -> StepScope:
    """What ``profile_step(...)`` and ``Profiler.step(...)`` return, their arguments checked: the
    common call (a name, a batch size) has nothing more to check."""
    if (max_syncs is None and on_sync is None and batch is NO_BATCH and tokens is None
            and (name is None or (type(name) is str and name))
            and (batch_size is None or (type(batch_size) is int and batch_size > 0))):
        return StepScope(profiler, name, batch_size)
    return StepScope(profiler, check_name(name), check_batch_size(batch_size), *check_budget(max_syncs, on_sync),
                     batch=batch, tokens=check_tokens(tokens))


def make_measure(name: Any, profiler: Recorder | None) -> Any:
    """What ``measure(name)`` returns: a :class:`MeasureScope`, or ``name`` measured if it is a function."""
    if type(name) is str and name:  # the common call: a phase's name, nothing more to check
        return MeasureScope(name, profiler)
    if name is None or isinstance(name, str):
        return MeasureScope(check_name(name), profiler)
    if callable(name) or isinstance(name, (staticmethod, classmethod)):  # bare decorator: @measure
        return MeasureScope(None, profiler)(name)
    raise UsageError(
        f"measure() takes a name (str) or a function (got {name!r}); "
        f"use @stepprof.measure, @stepprof.measure('name') or `with stepprof.measure('name'):`"
    )


class _PublicFunction:
    """A public function that is an object, so that ``with f:`` (no brackets) gets a hint.

    To ``help()`` and ``inspect.signature`` it is the function ``stepprof.<name>``:
    they show its ``__call__``'s signature and docstring.
    """

    _hint = ""
    __call__: Callable[..., Any]  # each subclass's own: the function's signature

    def __init__(self, name: str) -> None:
        call = self.__call__
        self.__name__ = self.__qualname__ = name
        self.__module__ = "stepprof"
        self.__doc__ = call.__doc__
        self.__wrapped__ = call
        # help() titles an object that is not a function with its class's name: make that
        # read "function profile_step", as for a function, not the name of a private class.
        type(self).__name__ = f"function {name}"
        # Its return type is a private class; the docstring says what it returns.
        self.__signature__ = inspect.signature(call).replace(return_annotation=inspect.Signature.empty)

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        # Being a descriptor makes it a routine to pydoc (help() documents a function, not
        # the instance of a class); as a class attribute it stays itself, like a staticmethod.
        return self

    def __enter__(self) -> None:
        raise UsageError(self._hint)

    def __exit__(self, *exc: Any) -> None:  # pragma: no cover - __enter__ always raises
        pass

    def __repr__(self) -> str:
        return f"<function stepprof.{self.__name__}>"


class ProfileStepFunction(_PublicFunction):
    """The type of ``stepprof.profile_step``."""

    _hint = "use `with stepprof.profile_step():` (did you forget the brackets?)"

    def __call__(
        self,
        name: str | None = None,
        *,
        batch_size: int | None = None,
        max_syncs: int | None = None,
        on_sync: str | None = None,
        batch: Any = NO_BATCH,
        tokens: int | None = None,
    ) -> StepScope:
        """A context manager around one training step of the current profiler.

        The current profiler is the calling thread's innermost active ``with
        stepprof.Profiler(...)``, else the default one (see :func:`stepprof.configure`).

        Args:
            name: the step's name in the log (default ``"step"``).
            batch_size: samples in the step; enables ``samples_per_s``.
            max_syncs: this step's sync budget (default: the profiler's, None).
            on_sync: ``"count"``, ``"warn"`` or ``"raise"`` when the step goes over
                ``max_syncs`` (default: the profiler's, ``"count"``).
            batch: the step's batch, to infer ``batch_size`` from when it is not given: the
                leading dimension of its tensors (a tensor, tuple, list, dict or an object
                holding them), if they all agree; else ``batch_size`` is null with the reason.
                Its tokens are counted too, when it holds ``input_ids`` or a 2-D integer
                tensor (the unmasked ones, with an ``attention_mask``): ``tokens_per_s``.
            tokens: the tokens the step trains on, in place of counting them in ``batch``.

        Example:
            >>> import stepprof
            >>> with stepprof.Profiler(None) as prof:
            ...     with stepprof.profile_step(batch_size=16):
            ...         pass
            >>> prof.summary.steps
            1
        """
        return step_scope(None, name, batch_size, max_syncs, on_sync, batch, tokens)


class IterateFunction(_PublicFunction):
    """The type of ``stepprof.iterate``."""

    _hint = "use `for batch in stepprof.iterate(loader):` (did you forget the loader?)"

    def __call__(self, iterable: Iterable[Any]) -> Iterated:
        """Iterate ``iterable`` (a DataLoader, say), timing how long each batch takes to come.

        Each item is handed on unchanged.  The time spent in its ``__next__`` becomes the
        next step's ``data_ms`` (part of its ``data_wait_ms``, the host time since the
        previous step's exit), and its size the next step's ``batch_size`` when the step
        gives none (see ``profile_step(batch=...)``).

        Example:
            >>> import stepprof, torch
            >>> loader = [torch.zeros(8, 2) for _ in range(3)]
            >>> with stepprof.Profiler(None) as prof:
            ...     for batch in stepprof.iterate(loader):
            ...         with stepprof.profile_step():
            ...             pass
            >>> prof.summary.steps
            3
        """
        return iterate_over(iterable, None)


def iterate_over(iterable: Any, profiler: Recorder | None) -> Iterated:
    """What ``iterate(iterable)`` returns: an :class:`Iterated` (``profiler`` None: the current one)."""
    if not hasattr(iterable, "__iter__") and not hasattr(iterable, "__getitem__"):
        raise UsageError(
            f"iterate() takes an iterable, such as a DataLoader (got {type(iterable).__name__}); "
            f"use `for batch in stepprof.iterate(loader):`"
        )
    return Iterated(iterable, profiler)


class MeasureFunction(_PublicFunction):
    """The type of ``stepprof.measure``."""

    _hint = "use `with stepprof.measure('name'):` (did you forget the brackets?)"

    @overload
    def __call__(self, name: F) -> F: ...
    @overload
    def __call__(self, name: str | None = None) -> MeasureScope: ...

    def __call__(self, name: str | Callable[..., Any] | None = None) -> Any:
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
