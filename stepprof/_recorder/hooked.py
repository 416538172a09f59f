"""A profiler's steps and phases without context managers, and its record watchers, for code
that only has hooks (a framework's callbacks): :class:`HookedSteps`, a part of
:class:`~.profiler.Profiler`."""

from __future__ import annotations

import threading
from typing import Any

from .._batch import NO_BATCH, Tokens, count_tokens, infer_batch_size, total_batch_size, total_tokens
from .._errors import UsageError
from .._records import Summary
from .._signals import Deferring
from .._validate import check_batch_size, check_callable, check_name, check_seconds, check_tokens
from .boundaries import Boundaries
from .collector import Collector
from .hooks import Hook
from .step import plus_ns
from .watch import Watcher, WatchHook


class HookedSteps:
    """``begin_step``/``end_step``, ``begin_phase``/``end_phase`` and ``add_batch``.

    The tokens they open are kept per thread in ``_begun``: ``[(name, token), ...]``, the
    step's first.  The profiler's own scopes do not use them.
    """

    _begun: dict[int, list[tuple[str | None, Any]]]
    _boundaries: Boundaries
    _summary: Summary | None
    # The scopes enter and exit steps and phases through these: the boundaries' own
    # methods, bound once in the profiler's __init__ (a method of the profiler's that
    # forwarded to them would add a call to every boundary).
    _enter: Any
    _exit: Any
    _collector: Collector
    _hooks: list[Hook]

    def watch(self, watcher: Watcher) -> None:
        """Call ``watcher(record)`` with each step record as it is written, on stepprof's
        collector thread (the framework callbacks' logged medians come from here).

        ``watcher`` must return quickly and leave the record as it is; an exception it
        raises is a warning, and it is not called again.
        """
        check_callable(watcher, "watcher", "e.g. prof.watch(records.append)")
        with Deferring(self._collector.lock), self._collector.lock:
            hook = next((h for h in self._hooks if isinstance(h, WatchHook)), None)
            if hook is None:
                hook = WatchHook()
                self._hooks.append(hook)  # the last record hook: it sees the finished record
                self._collector.use(self._hooks)
            hook.add(watcher)

    def begin_step(
        self, batch_size: int | None = None, name: str | None = None, *, batch: Any = NO_BATCH,
        batch_reason: str | None = None, global_step: int | None = None, tokens: int | None = None,
    ) -> None:
        """Open a step on this thread, as ``with prof.step(...)`` would; :meth:`end_step` closes it.

        For code that only has hooks (a framework's callbacks).  Arguments as for :meth:`step`;
        ``batch_reason``: why the step has no batch size, for code that cannot see its batches
        (the step's ``unavailable.batch_size``), in place of ``batch_size`` and ``batch``;
        ``global_step``: the framework's own number for this step, the one its loggers use
        (the record's ``global_step``; ``stepprof export --tensorboard`` draws at it).
        """
        begun = self._begun.get(threading.get_ident())
        if begun:
            raise UsageError(
                "begin_step() was called while the step begun before is still open on this thread; "
                "call prof.end_step() first"
            )
        name, batch_size, reason = check_name(name), check_batch_size(batch_size), None
        count: int | Tokens | None = check_tokens(tokens)
        if global_step is not None and (type(global_step) is not int or global_step < 0):
            raise UsageError(
                f"begin_step(global_step=...) takes the framework's step number, an int >= 0 "
                f"(got {global_step!r}); e.g. global_step=trainer.global_step"
            )
        if batch_reason is not None:
            reason = _check_reason(batch_reason, batch_size is not None or batch is not NO_BATCH)
        elif batch_size is None and batch is not NO_BATCH:  # an explicit batch_size wins
            batch_size, reason = infer_batch_size(batch)
        if count is None and batch is not NO_BATCH:
            count = count_tokens(batch)
        token = self._enter(name, batch_size, True, (None, None), reason)
        self._begun[threading.get_ident()] = [(name, token)]
        if global_step is not None or count is not None:
            step = self._boundaries.threads.step()
            if step is not None:  # None: the profiler stopped recording
                if global_step is not None:
                    step.global_step = global_step
                if count is not None:
                    step.tokens = count

    def end_step(self, error: BaseException | None = None) -> None:
        """Close the step :meth:`begin_step` opened on this thread, and any phase still open in it.

        Args:
            error: the exception the step raised, recorded as its ``error``; None when it
                completed.
        """
        if error is not None and not isinstance(error, BaseException):
            raise UsageError(
                f"end_step(error=...) takes the exception the step raised, or None (got {error!r}); "
                f"pass e.g. end_step(error=exc) in an except block"
            )
        begun = self._begun.pop(threading.get_ident(), None)
        if not begun:
            raise UsageError("end_step() without begin_step() on this thread; call prof.begin_step() first")
        self._exit(begun[0][1], error)  # the step's exit closes the phases left open in it

    def begin_phase(self, name: str) -> None:
        """Open a phase of the step begun on this thread, as ``with prof.measure(name)`` would."""
        begun = self._begun.get(threading.get_ident())
        checked = check_name(name)
        if checked is None:
            raise UsageError("begin_phase() needs a name: prof.begin_phase('forward')")
        if not begun:
            raise UsageError(
                f"begin_phase({checked!r}) outside a step: call prof.begin_step() first"
            )
        begun.append((checked, self._enter(checked, None, False)))

    def end_phase(self, name: str | None = None) -> None:
        """Close the innermost phase :meth:`begin_phase` opened on this thread (``name``, if
        given, must be its name)."""
        begun = self._begun.get(threading.get_ident())
        if not begun or len(begun) == 1:
            raise UsageError("end_phase() without begin_phase() in the step begun on this thread")
        open_name = begun[-1][0]
        if name is not None and name != open_name:
            raise UsageError(
                f"end_phase({name!r}), but the innermost open phase is {open_name!r}; "
                f"end {open_name!r} first"
            )
        self._exit(begun.pop()[1], None)

    def add_batch(self, *batches: Any, fetch_s: float | None = None, wait_s: float | None = None) -> None:
        """The batches a step trains on, for code that fetches them where :meth:`iterate` cannot
        wrap (a framework's hooks; gradient accumulation's micro-batches).

        Inside a step open on this thread, their samples (the tensors' first dimension, as
        for ``profile_step(batch=...)``) add to its ``batch_size``; outside one they are the
        next step's, as :meth:`iterate`'s are.  ``fetch_s``, the seconds fetching them took,
        adds to the step's ``data_ms``.  ``wait_s``, only inside a step: the seconds the step
        waited for them since its previous micro-batch; it adds to ``data_wait_in_step_ms`` and
        so to ``data_wait_ms``, the step's whole input wait (the wait before a step is measured
        by stepprof).  A batch whose size cannot be inferred makes ``batch_size`` null, with
        the reason.

        Example:
            >>> prof = stepprof.Profiler(None)                      # doctest: +SKIP
            >>> prof.begin_step()                                   # doctest: +SKIP
            >>> for micro in micro_batches:                         # doctest: +SKIP
            ...     prof.add_batch(micro); loss_of(micro).backward()
            >>> prof.end_step()                                     # doctest: +SKIP
        """
        if not batches:
            raise UsageError("add_batch() needs a batch: prof.add_batch(batch), or several: prof.add_batch(*micro_batches)")
        fetch_ns = None if fetch_s is None else round(check_seconds(fetch_s, "fetch_s", allow_zero=True) * 1e9)
        wait_ns = None if wait_s is None else round(check_seconds(wait_s, "wait_s", allow_zero=True) * 1e9)
        if self._summary is not None or self._boundaries.broken is not None:
            return
        size, reason = total_batch_size(batches)
        step = self._boundaries.threads.step()
        if step is None:
            if wait_ns is not None:
                raise UsageError(
                    f"add_batch(wait_s={wait_s!r}) outside a step: stepprof measures the wait before a "
                    f"step itself; pass wait_s only for a micro-batch inside the open step"
                )
            self._boundaries.note_batch(fetch_ns, (size, reason), total_tokens(batches))
            return
        if wait_ns is not None:
            step.wait_in_ns = plus_ns(step.wait_in_ns, wait_ns)
        if fetch_ns is not None:
            step.data_ns = plus_ns(step.data_ns, fetch_ns)
        if step.batch_size is not None or step.batch_reason is None:  # else a batch had no size
            if size is None:
                step.batch_size, step.batch_reason = None, reason
            else:
                step.batch_size = (step.batch_size or 0) + size
        tokens, had = total_tokens(batches), step.tokens
        if had is None:
            step.tokens = tokens
        elif isinstance(had, Tokens):  # (an int: tokens=N given, the step's own)
            step.tokens = had.plus(tokens, "a batch add_batch() added")


def _check_reason(reason: Any, with_batch: bool) -> str:
    """``begin_step(batch_reason=...)``: a non-empty str, given without a batch."""
    if type(reason) is not str or not reason.strip():
        raise UsageError(
            f"begin_step(batch_reason=...) takes why the step has no batch size, a non-empty str "
            f"(got {reason!r}); e.g. batch_reason='the callback cannot see the batches'"
        )
    if with_batch:
        raise UsageError(
            "begin_step(batch_reason=...) is for a step without a batch: pass batch_size= or "
            "batch=, or batch_reason=, not both"
        )
    return reason
