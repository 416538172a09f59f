"""torch.compile awareness: the compilations inside each step (``CompileHook``).

torch's documented compile hooks, ``torch._dynamo.callback.callback_handler``'s start and
end callbacks, fire around each dynamo frame compilation (recompiles included), each lazy
backward compilation and each CUDA-graph recording.  Each event is timed on the host
clock (``perf_counter_ns``) and counted against the step open on the thread that
compiled (autograd's own threads compile the backward: their events go to the training
thread's open step).  Graph breaks are the growth of ``torch._dynamo.utils.counters
["graph_break"]`` across an event; a recompile's reason (its failed guard) is the
``recompile_reason`` of the event's entry in ``torch._dynamo.utils.get_compilation_metrics()``,
found by its ``compile_id`` when the step's record is built.

Cost: nothing per step.  The callbacks are registered at the profiler's first step if
``torch._dynamo`` is imported by then (the user compiles), else at the first harvest
after it is; importing ``torch._dynamo`` is slow, so stepprof never does it.  They fire
only when something compiles.  torch can remove them (``torch._dynamo.reset()`` clears
its callbacks), so stepprof's are put back after each clear; they are removed once no
profiler listens (at close, in a forked child, at ``_registry.reset()``), and a flag
gates them meanwhile.

The step records get ``compiles``, ``recompiles``, ``compile_ms``, ``graph_breaks``,
``recompile_reasons`` and ``compiled`` from the first step that compiled on, or on every
step if this process had compiled a graph before the profiler's first step: a run that
never compiles has none of these fields (docs/reference/schema.md).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from .._errors import raised_by_user
from .._registry import register_state
from .._device.backend import Backend
from .hooks import SILENT, Closing, Hook, Quiet
from .sinks import Write
from .step import Step

__all__ = ["CompileHook", "REASONS_PER_RUN", "REASONS_PER_STEP"]

#: Recompile reasons kept per step, and per run.
REASONS_PER_STEP = 3
REASONS_PER_RUN = 10
#: Characters kept of one reason.
_REASON_CHARS = 500

_CALLBACK_MODULE = "torch._dynamo.callback"
_UTILS_MODULE = "torch._dynamo.utils"

NO_COUNTER = "torch._dynamo.utils.counters['graph_break'] could not be read in this torch"


def _graph_breaks() -> int | None:
    """torch's count of graph breaks so far in this process (None: unreadable)."""
    utils = sys.modules.get(_UTILS_MODULE)
    try:
        return sum(utils.counters["graph_break"].values())  # type: ignore[union-attr]
    except Exception as e:  # noqa: BLE001 - a private counter: any failure means "unknown"
        if raised_by_user(e):
            raise
        return None


def _frame_compile_id(compile_id: str | None) -> int | None:
    """The per-frame compile count in a compile id (``"3/1"``: 1, a recompile), or None."""
    if not compile_id:
        return None
    try:
        return int(compile_id.rsplit("/", 1)[1])
    except (IndexError, ValueError):
        return None


class _Event:
    """A compile event in progress: when it started, and the step it counts against per hook."""

    __slots__ = ("t0", "trigger", "compile_id", "breaks", "steps")

    def __init__(self, trigger: str, compile_id: str | None, steps: list[tuple[CompileHook, Step | None]]) -> None:
        self.trigger = trigger
        self.compile_id = compile_id
        self.steps = steps
        self.breaks = _graph_breaks()
        self.t0 = time.perf_counter_ns()


class _Watch:
    """Process-wide: stepprof's callbacks in torch's list, and the hooks they report to."""

    __slots__ = ("listeners", "handler", "open")

    def __init__(self) -> None:
        #: The hooks listening (a tuple, replaced whole: the callbacks iterate it unlocked).
        self.listeners: tuple[CompileHook, ...] = ()
        #: torch's callback handler while stepprof's callbacks are in it, else None.
        self.handler: Any = None
        #: Events in progress, per thread that started them.
        self.open: dict[int, list[_Event]] = {}

    def join(self, hook: CompileHook) -> str | None:
        """Add ``hook`` and register the callbacks if they are not; None, or why not."""
        if hook not in self.listeners:
            self.listeners = (*self.listeners, hook)
        if self.handler is not None:
            return None
        module = sys.modules.get(_CALLBACK_MODULE)
        handler = getattr(module, "callback_handler", None)
        try:
            handler.register_start_callback(_on_start)  # type: ignore[union-attr]
            handler.register_end_callback(_on_end)  # type: ignore[union-attr]
            _keep_after_clear(handler)
        except Exception as e:  # noqa: BLE001 - no compile figures, never a broken step
            if raised_by_user(e):
                raise
            self.listeners = tuple(h for h in self.listeners if h is not hook)
            self._remove(handler)
            return f"torch._dynamo's compile callbacks are unavailable ({type(e).__name__}: {e})"
        self.handler = handler
        return None

    def leave(self, hook: CompileHook) -> None:
        """Remove ``hook``; the last one out removes the callbacks (and the patch on ``clear``)."""
        self.listeners = tuple(h for h in self.listeners if h is not hook)
        if not self.listeners:
            self.reset()

    def reset(self) -> None:
        """Forget every listener and take stepprof's callbacks out of torch's lists."""
        self.listeners = ()
        self.open = {}
        handler, self.handler = self.handler, None
        if handler is not None:
            self._remove(handler)

    @staticmethod
    def _remove(handler: Any) -> None:
        for name, callback in (("start_callbacks", _on_start), ("end_callbacks", _on_end)):
            callbacks = getattr(handler, name, None)
            while isinstance(callbacks, list) and callback in callbacks:
                callbacks.remove(callback)
        if getattr(handler, "__dict__", {}).get("clear") is not None:
            try:
                del handler.clear  # the class's own method again
            except AttributeError:
                pass


WATCH = register_state(_Watch())


def _keep_after_clear(handler: Any) -> None:
    """Put stepprof's callbacks back after ``handler.clear()`` (``torch._dynamo.reset()`` calls it)."""
    if "clear" in getattr(handler, "__dict__", {}):
        return
    original = handler.clear

    def clear(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        finally:
            if WATCH.handler is handler:
                if _on_start not in handler.start_callbacks:
                    handler.register_start_callback(_on_start)
                if _on_end not in handler.end_callbacks:
                    handler.register_end_callback(_on_end)

    handler.clear = clear


def _on_start(*args: Any) -> None:
    """torch's compile-start callback (a ``CallbackArgs`` in a recent torch, nothing in an older one)."""
    listeners = WATCH.listeners
    if not listeners:
        return  # gated: a callback that torch's list still holds after stepprof left
    try:
        a = args[0] if args else None
        trigger = getattr(getattr(a, "callback_trigger", None), "name", None) or "DYNAMO"
        compile_id = getattr(a, "compile_id", None)
        tid = threading.get_ident()
        event = _Event(trigger, compile_id if isinstance(compile_id, str) else None,
                       [(h, h.open_step(tid)) for h in listeners])
        WATCH.open.setdefault(tid, []).append(event)
    except Exception as e:  # noqa: BLE001, S110 - never break the user's compile
        if raised_by_user(e):
            raise


def _on_end(*_: Any) -> None:
    """torch's compile-end callback: the event's time and graph breaks go to its step."""
    if not WATCH.listeners:
        return
    try:
        t1 = time.perf_counter_ns()
        opened = WATCH.open
        stack = opened.get(threading.get_ident()) or next((s for s in opened.values() if s), None)
        if not stack:
            return
        event = stack.pop()
        after = _graph_breaks()
        breaks = after - event.breaks if after is not None and event.breaks is not None else None
        for hook, step in event.steps:
            hook.add(step, event, t1 - event.t0, breaks)
    except Exception as e:  # noqa: BLE001, S110 - never break the user's compile
        if raised_by_user(e):
            raise


class _Tally:
    """One step's compile events so far."""

    __slots__ = ("compiles", "recompiles", "ns", "breaks", "recompile_ids")

    def __init__(self) -> None:
        self.compiles = 0
        self.recompiles = 0
        self.ns = 0
        self.breaks: int | None = 0
        self.recompile_ids: list[str] = []


class CompileHook(Hook):
    """The compilations inside each step (see the module docstring).

    Args:
        step_of: the open step of a thread (by ``threading.get_ident()``; None: the
            training thread), and whether that thread has stepped (``Threads.step_of``).
        next_index: the index the next step will get.
        retire: takes the hook off the step boundaries.
    """

    def __init__(self, step_of: Callable[[int | None], tuple[Step | None, bool]], next_index: Callable[[], int],
                 retire: Callable[[Hook], None]) -> None:
        self._step_of = step_of
        self._next_index = next_index
        self._retire = retire
        self._waiting = False  # torch._dynamo not imported at the first step: look at each harvest
        self._joined = False
        #: The first step whose record gets the fields (-1: every step), None: none so far.
        self.from_index: int | None = None
        self.reason: str | None = None  # why compilations are not tracked, if they are not
        self.outside = 0  # events with no step open
        self._tallies: dict[Step, _Tally] = {}
        self._reasons_kept = 0

    # -- training thread --------------------------------------------------------------

    def on_step_begin(self, index: int) -> None:
        self._retire(self)
        if _CALLBACK_MODULE in sys.modules:
            self._join()
        else:
            self._waiting = True

    # -- collector ----------------------------------------------------------------------

    def on_harvest(self, write: Write) -> None:
        if self._waiting and _CALLBACK_MODULE in sys.modules:
            self._waiting = False
            self._join()

    def _join(self) -> None:
        why = WATCH.join(self)
        if why is not None:
            self.reason = why
            return
        self._joined = True
        utils = sys.modules.get(_UTILS_MODULE)
        try:
            compiled_before = utils.counters["stats"]["unique_graphs"] > 0  # type: ignore[union-attr]
        except Exception as e:  # noqa: BLE001 - unknown: the fields start at the first compile
            if raised_by_user(e):
                raise
            compiled_before = False
        if compiled_before and self.from_index is None:
            self.from_index = -1

    def open_step(self, tid: int) -> Step | None:
        """The step a compile event on thread ``tid`` counts against (see the module docstring)."""
        step, stepped = self._step_of(tid)
        if step is None and not stepped:  # a thread without steps (autograd's): the training thread's
            return self._step_of(None)[0]
        return step

    def add(self, step: Step | None, event: _Event, ns: int, breaks: int | None) -> None:
        """A compile event ended (on the thread that compiled)."""
        if self.from_index is None:
            self.from_index = step.index if step is not None else self._next_index()
        if step is None:
            self.outside += 1
            return
        tally = self._tallies.get(step)
        if tally is None:
            tally = self._tallies[step] = _Tally()
        tally.ns += ns
        if event.trigger == "DYNAMO":
            tally.compiles += 1
            n = _frame_compile_id(event.compile_id)
            if n:
                tally.recompiles += 1
                tally.recompile_ids.append(event.compile_id)  # type: ignore[arg-type]
        if breaks is None or tally.breaks is None:
            tally.breaks = None
        else:
            tally.breaks += breaks

    def quiet(self, b: Backend) -> Quiet | None:
        """Nothing to add until a step compiled."""
        return SILENT if self.from_index is None else None

    def on_record(self, step: Step, record: dict[str, Any]) -> None:
        """Add the compile fields to a step record (from the first step that compiled)."""
        first = self.from_index
        if first is None or step.index < first:
            return
        tally = self._tallies.pop(step, None)
        if tally is None:  # the common case, written out
            record.update(compiles=0, recompiles=0, compile_ms=0.0, graph_breaks=0, recompile_reasons=[],
                          compiled=False)
            return
        record["compiles"] = tally.compiles
        record["recompiles"] = tally.recompiles
        record["compile_ms"] = tally.ns / 1e6
        record["graph_breaks"] = tally.breaks
        if tally.breaks is None:
            record["unavailable"]["graph_breaks"] = NO_COUNTER
        record["recompile_reasons"] = self._reasons(tally, record["unavailable"])
        record["compiled"] = tally.compiles > 0 or tally.ns > 0

    def _reasons(self, tally: _Tally, unavailable: dict[str, str]) -> list[str]:
        """The first recompiles' reasons (their failed guards), from torch's compilation metrics."""
        ids = tally.recompile_ids[:REASONS_PER_STEP]
        if not ids:
            return []
        room = REASONS_PER_RUN - self._reasons_kept
        if room <= 0:
            unavailable["recompile_reasons"] = f"only the run's first {REASONS_PER_RUN} recompile reasons are kept"
            return []
        found = _metrics_reasons(ids)
        if found is None:
            unavailable["recompile_reasons"] = (
                "torch._dynamo.utils.get_compilation_metrics() could not be read in this torch"
            )
            return []
        reasons = [found[cid] for cid in ids if found.get(cid)][:room]
        self._reasons_kept += len(reasons)
        if len(reasons) < len(ids):
            unavailable["recompile_reasons"] = (
                "torch's compilation metrics hold no reason for some recompiles (they keep the "
                "last 64 compilations; an older torch has no recompile_reason)"
                if len(reasons) < min(len(ids), room)
                else f"only the run's first {REASONS_PER_RUN} recompile reasons are kept"
            )
        elif len(tally.recompile_ids) > len(ids):
            unavailable["recompile_reasons"] = (
                f"only a step's first {REASONS_PER_STEP} recompile reasons are kept "
                f"(this one recompiled {len(tally.recompile_ids)} times)"
            )
        return reasons

    # -- close and fork ------------------------------------------------------------------

    def on_close(self, closing: Closing) -> None:
        self.forget()

    def forget(self) -> None:
        """Stop listening (at close, and in a forked child)."""
        self._waiting = False
        if self._joined:
            self._joined = False
            WATCH.leave(self)
        self._tallies.clear()


def _metrics_reasons(ids: list[str]) -> dict[str, str] | None:
    """``compile_id`` -> ``recompile_reason`` for these compile ids, or None if unreadable."""
    utils = sys.modules.get(_UTILS_MODULE)
    get = getattr(utils, "get_compilation_metrics", None)
    if get is None:
        return None
    for _ in range(3):  # the training thread may append while the deque is copied
        try:
            metrics = get()
            break
        except RuntimeError:
            continue
        except Exception as e:  # noqa: BLE001 - a private API: any failure means "unreadable"
            if raised_by_user(e):
                raise
            return None
    else:
        return None
    wanted = set(ids)
    out: dict[str, str] = {}
    for m in metrics:
        cid = getattr(m, "compile_id", None)
        reason = getattr(m, "recompile_reason", None)
        if cid in wanted and isinstance(reason, str) and reason:
            out[cid] = reason[:_REASON_CHARS]
    return out
