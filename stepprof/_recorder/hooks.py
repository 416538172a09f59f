"""Optional behaviour of the recorder, as objects with a fixed interface.

The recorder calls a hook only at the points whose method the hook's class overrides,
and only while the hook is active: a profiler without FLOPs or a distributed exchange
runs none of their code.  A hook that has nothing more to do at step boundaries (the
FLOPs once counted, memory records once none is due) retires from them.

- ``FlopsHook`` (:mod:`.flops`): ``flops="auto"`` counts one step's FLOPs; either way
  (or given) the step records get ``flops``, ``tflops_per_s`` and ``mfu``, and a
  ``kind: "flops"`` record is written.
- ``MemoryHook`` (:mod:`.memory_records`): the ``kind: "memory"`` records, after
  warm-up, every ``memory_every`` steps and at close (CUDA only).
- ``PeakHook`` (:mod:`.peak`): ``explain_peak``: the allocator's history and module,
  autograd and phase hooks for one step, then a ``kind: "peak"`` record; retires after it.
- ``ExchangeHook`` (:mod:`.exchange`): the cross-rank exchange of a distributed run;
  every step exit counts in it, including steps that recording dropped after an
  internal error.
- ``EnergyHook`` (:mod:`.energy`): ``energy_j`` on the step records, from NVML's
  energy counter sampled on a thread of its own; a step's record waits for a sample
  after its span (:meth:`Hook.holds`).
- ``CompileHook`` (:mod:`.compiles`): the torch.compile work inside each step, from
  torch's compile callbacks; on the boundaries for the first step only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from .._device.backend import Backend
from .sinks import Write
from .step import Step


@attrs.frozen
class Closing:
    """What a hook may use at close.

    Attributes:
        write: writes a record to the log.
        backend: the profiler's backend, or None if no step ran.
        last_step: the index of the last step entered, or None.
        stopped: recording stopped early (an internal error, or a forked child).
    """

    write: Write
    backend: Backend | None
    last_step: int | None
    stopped: bool


@attrs.frozen
class Quiet:
    """What a hook's record methods do for a backend's steps when they need no call per step
    (:meth:`Hook.quiet`): the collector's C harvest then does it for them.

    Attributes:
        fields: the fields every record gets (``late``'s, where they are known at once).
        reasons: the reasons every record's ``unavailable`` gets.
        tracks_peak: the hook's ``peak_seen`` follows the steps' peaks (``after_record``'s work).
        before: the first step index this does not hold for (None: every step).
    """

    fields: dict[str, Any] = attrs.field(factory=dict)
    reasons: dict[str, str] = attrs.field(factory=dict)
    tracks_peak: bool = False
    before: int | None = None


#: A hook whose record methods do nothing.
SILENT = Quiet()


class Hook:
    """The points where the recorder calls optional behaviour; each does nothing here.

    Training thread: :meth:`on_step_begin`, :meth:`on_step_end`, :meth:`on_fail`.
    Collector: :meth:`on_harvest`, :meth:`on_record`, :meth:`late`, :meth:`fill`, :meth:`after_record`.
    Close: :meth:`on_finish`, :meth:`on_close`.
    """

    #: Off the step boundaries: no longer called at step entry and exit
    #: (see :meth:`ActiveHooks.retire`).  Records and close still reach it.
    retired = False
    #: Keeps each step's end mark past its record, and releases it itself.
    keeps_end_marks = False
    #: Its :meth:`after_record`'s work is stated in its own record (explain_peak's replay: the
    #: peak record's ``cost_ms``): the collector leaves it out of the steps' ``overhead_us``.
    states_its_cost = False

    def on_step_begin(self, index: int) -> None:
        """Before the entry boundary of step ``index`` (outside its times)."""

    def on_step_end(self, step: Step, exc: BaseException | None) -> None:
        """After the exit boundary of ``step`` (within its overhead), before it is queued."""

    def on_fail(self, step_open: bool, why: str) -> None:
        """Recording stopped after an internal error (``why``), inside a step or not."""

    def on_harvest(self, write: Write) -> None:
        """At the start of each harvest."""

    def on_finish(self) -> None:
        """At close, once the pending steps' events have completed, before their last
        harvest: from here on :meth:`fill` must not say None."""

    def on_record(self, step: Step, record: dict[str, Any]) -> None:
        """Amend a completed step's record before it is written (its marks are still held)."""

    def late(self, step: Step, record: dict[str, Any]) -> tuple[Any, ...] | None:
        """Amend the record like :meth:`on_record`, but for fields known only later (energy:
        the sample after the step): return a token for :meth:`fill` then, a non-empty tuple
        of ints, floats or strings (the record waits encoded, untracked by the GC), else
        None.  At most one hook of a profiler has late fields."""
        return None

    def fill(
        self, token: tuple[Any, ...], final: bool, why: str | None = None
    ) -> tuple[dict[str, Any], dict[str, str]] | None:
        """The late fields of the record :meth:`late` gave ``token`` for, and the reasons of
        those null; None while they are not known yet (never once ``final``: then null, with
        ``why`` as the reason if one is given).  The record, and every later one, wait."""
        return None

    def fill_many(self, entries: Any, final: bool, limit: int, add_late: Any, out: list[bytes],
                  fold: tuple[Any, Any] | None = None) -> tuple[int, int]:
        """:meth:`fill` for the waiting records at the head of ``entries`` (``HeldRecords``'), at
        most ``limit`` of them, as far as it can in one go: each one's completed lines appended to
        ``out``, ``add_late`` given its late fields (or, a timed step's, folded into ``fold``, the
        summary's :meth:`~.sinks.SummarySink.fold_plan`); returns (records, lines) done.  (0, 0):
        the first one goes through :meth:`fill` (the default: they all do)."""
        return 0, 0

    def span_plan(self) -> tuple[Any, ...] | None:
        """What the C harvest needs to give :meth:`late`'s token without a call (the energy
        hook's span, ``_fold.c``'s ``energy_span``); None (the default): it calls :meth:`late`.
        Asked once a harvest."""
        return None

    def after_record(self, step: Step, write: Write) -> None:
        """Write the records that follow a step's record."""

    def quiet(self, b: Backend) -> Quiet | None:
        """What :meth:`on_record`, :meth:`late` and :meth:`after_record` would do for the steps
        of ``b`` harvested next, if that needs no call per step; None if it does (the default
        for a hook that overrides one of them).  Asked once a harvest."""
        cls = type(self)
        if cls.on_record is Hook.on_record and cls.late is Hook.late and cls.after_record is Hook.after_record:
            return SILENT
        return None

    def on_close(self, closing: Closing) -> None:
        """At close, after every pending step's record was written."""


class ActiveHooks:
    """The hooks that a profiler's step boundaries call, by point: each only where its class
    overrides the point's method, and only until it retires.

    Attributes:
        all: every hook, retired or not (:meth:`Hook.on_fail` reaches them all).
        begin: the active hooks with an :meth:`Hook.on_step_begin`.
        end: the active hooks with an :meth:`Hook.on_step_end`.
    """

    __slots__ = ("all", "begin", "end")

    def __init__(self) -> None:
        self.all: tuple[Hook, ...] = ()
        self.begin: tuple[Hook, ...] = ()
        self.end: tuple[Hook, ...] = ()

    def use(self, hooks: Sequence[Hook]) -> None:
        """Call these hooks at step entry and exit."""
        self.all = tuple(hooks)
        self._activate()

    def retire(self, hook: Hook) -> None:
        """Stop calling ``hook`` at step boundaries (it still gets records and close)."""
        hook.retired = True
        self._activate()  # new tuples: a loop over the old ones (this very call's) goes on

    def clear(self) -> None:
        """Call no hook any more (a forked child)."""
        self.all = self.begin = self.end = ()

    def _activate(self) -> None:
        active = [h for h in self.all if not h.retired]
        self.begin = tuple(h for h in active if type(h).on_step_begin is not Hook.on_step_begin)
        self.end = tuple(h for h in active if type(h).on_step_end is not Hook.on_step_end)
