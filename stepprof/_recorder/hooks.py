"""Optional behaviour of the recorder, as objects with a fixed interface.

The recorder calls a hook only at the points whose method the hook's class overrides,
and only while the hook is active: a profiler without FLOPs or a distributed exchange
runs none of their code.  A hook that has nothing more to do at step boundaries (the
FLOPs once counted, memory records once none is due) retires from them.

- :class:`FlopsHook`: ``flops="auto"`` counts one step's FLOPs; either way (or given)
  the step records get ``flops``, ``tflops_per_s`` and ``mfu``, and a ``kind: "flops"``
  record is written.
- :class:`MemoryHook`: the ``kind: "memory"`` records, after warm-up, every
  ``memory_every`` steps and at close (CUDA only).
- :class:`ExchangeHook`: the cross-rank exchange of a distributed run; every step exit
  counts in it, including steps that recording dropped after an internal error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from .. import _memory
from .._cuda import Backend, device_name
from .._dist import Exchange
from .._memory import Snapshot
from .._roofline import FlopCount, ideal_ms, load_calibration
from .sinks import Write
from .step import Step, elapsed_ms


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


class Hook:
    """The points where the recorder calls optional behaviour; each does nothing here.

    Training thread: :meth:`on_step_begin`, :meth:`on_step_end`, :meth:`on_fail`.
    Collector: :meth:`on_harvest`, :meth:`on_record`, :meth:`after_record`.
    Close: :meth:`on_close`.
    """

    #: Retired from the step boundaries (see :meth:`Boundaries.retire`).
    retired = False

    def on_step_begin(self, index: int) -> None:
        """Before the entry boundary of step ``index`` (outside its times)."""

    def on_step_end(self, step: Step, exc: BaseException | None) -> None:
        """After the exit boundary of ``step`` (within its overhead), before it is queued."""

    def on_fail(self, step_open: bool, why: str) -> None:
        """Recording stopped after an internal error (``why``), inside a step or not."""

    def on_harvest(self, write: Write) -> None:
        """At the start of each harvest."""

    def on_record(self, step: Step, record: dict[str, Any]) -> None:
        """Amend a completed step's record before it is written (its marks are still held)."""

    def after_record(self, step: Step, write: Write) -> None:
        """Write the records that follow a step's record."""

    def on_close(self, closing: Closing) -> None:
        """At close, after every pending step's record was written."""


# -- FLOPs ------------------------------------------------------------------------------

#: Why a summary has no TFLOP/s or MFU when no FLOPs were asked for.
FLOPS_NOT_REQUESTED = "FLOPs were not requested: pass Profiler(flops='auto') or flops_per_step=N"


class FlopsHook(Hook):
    """The FLOPs of one step, counted (``"auto"``) or given, and the figures that follow.

    Counting runs one step, the first past warm-up, under ``FlopCounterMode`` (that step
    runs eagerly; its record says ``flops_counted``).  A step that raises is counted again
    at the next, up to three attempts.  Once the count is done, or given up, the hook
    retires from the step boundaries.

    Args:
        mode: ``"auto"`` or ``"given"``.
        given: the FLOPs of one step when given.
        warmup: the profiler's warm-up steps (the count waits for them).
        backend: the profiler's backend when it was made (None: not chosen yet).
        retire: takes the hook off the step boundaries.
    """

    def __init__(self, mode: str, given: float | None, *, warmup: int, backend: Backend | None,
                 retire: Callable[[Hook], None]) -> None:
        self.mode = mode
        self.flops: dict[str, Any] | None = None  # set once known: see _set_flops
        self.reason = "not counted yet: FLOPs are counted in the first step past warm-up"
        self.ideal_ms: float | None = None
        self.mfu_reason: str | None = None
        self._record: dict[str, Any] | None = None  # the flops record, awaiting its step's
        self._count: FlopCount | None = None
        self._attempts = 0
        self._index = -1
        self._under_counter: set[int] = set()  # steps that ran under FlopCounterMode
        self._warmup = warmup
        self._retire = retire
        if given is not None:
            self.retired = True
            self._set_flops({"source": "given", "flops_per_step": given, "flops_by_dtype": None,
                             "ops": None, "op_bytes": None, "step": None, "notes": []}, backend)

    @property
    def counting(self) -> bool:
        """Whether FlopCounterMode is on (the counted step is open)."""
        return self._count is not None

    def summary_reasons(self) -> tuple[str, str | None]:
        """Why the summary has no TFLOP/s, and no MFU (see ``SummarySink.summary``)."""
        return (self.reason if self.flops is None else "no measured step after the counted one",
                self.mfu_reason)

    # -- training thread ------------------------------------------------------------

    def on_step_begin(self, index: int) -> None:
        if index >= self._warmup and self._count is None:
            fc = FlopCount()
            try:
                fc.start()
            except Exception as e:  # noqa: BLE001 - no count, never a broken step
                self._give_up(f"FlopCounterMode could not start: {type(e).__name__}: {e}")
            else:
                self._count = fc
                self._index = index
                self._under_counter.add(index)

    def on_step_end(self, step: Step, exc: BaseException | None) -> None:
        # Stop counting before the step is queued, so that its record (built on the
        # collector thread) already has the count.  The counted step's times include the
        # counter's cost either way; its record says flops_counted.
        if self._count is not None and step.index == self._index:
            try:
                self._finish_count(step, exc)
            except Exception as e:  # noqa: BLE001 - no count, never a broken step
                self._give_up(f"{type(e).__name__}: {e}")

    def on_fail(self, step_open: bool, why: str) -> None:
        if self._count is not None:
            fc, self._count = self._count, None
            try:
                fc.stop()
            except Exception:  # noqa: BLE001, S110 - recording already failed; the reason says so
                pass
            self._give_up(f"recording stopped during the counted step: {why}")

    def _finish_count(self, step: Step, exc: BaseException | None) -> None:
        fc, self._count = self._count, None
        assert fc is not None
        try:
            fc.stop()
        except Exception as e:  # noqa: BLE001 - a user's mode left on top of ours, say
            self._give_up(f"FlopCounterMode could not be left cleanly: {type(e).__name__}: {e}")
            return
        if exc is not None:
            self._attempts += 1
            if self._attempts >= 3:
                self._give_up("the step raised in each of 3 attempts to count its FLOPs")
            return  # count again at the next step
        if fc.error is not None:
            self._give_up(f"the counter failed in step {step.index}: {fc.error}")
            return
        self._stop_watching_steps()
        notes = list(fc.notes)
        if fc.flops == 0:
            notes.append("the counted step did no operation that FlopCounterMode counts "
                         "(matmuls, convolutions, attention)")
        detail = {"source": "auto", "flops_per_step": fc.flops, "flops_by_dtype": dict(fc.flops_by_dtype),
                  "ops": fc.ops, "op_bytes": fc.op_bytes, "step": step.index, "notes": notes}
        self._set_flops(detail, step.backend)

    def _give_up(self, reason: str) -> None:
        self.reason = f"FLOPs were not counted: {reason}"
        self._stop_watching_steps()
        self._record = {"kind": "flops", "source": "auto", "step": None, "flops_per_step": None,
                        "unavailable": {"flops_per_step": self.reason}}

    def _stop_watching_steps(self) -> None:
        if not self.retired:
            self.retired = True
            self._retire(self)

    def _set_flops(self, detail: dict[str, Any], b: Backend | None) -> None:
        """The step's FLOPs are known: find the calibration and prepare the flops record."""
        on_cuda = b is not None and b.has_device_memory
        name = device_name(b.index) if on_cuda and isinstance(b.index, int) else None  # type: ignore[union-attr]
        calibration = None
        if on_cuda and name is None:
            why = "the GPU's model name could not be read, so its calibration cannot be found"
        elif name is None:
            why = ("no calibration for the CPU: stepprof calibrate measures CUDA GPUs"
                   if b is not None else "no step has run, so the device is unknown")
        else:
            calibration, why = load_calibration(name)
        ideal = None
        by_dtype = detail.get("flops_by_dtype")
        if calibration is not None:
            if by_dtype is None:
                why = ("MFU needs the FLOPs' dtypes: with flops_per_step they are unknown; "
                       "use flops='auto' to count them")
            else:
                ideal, why = ideal_ms(by_dtype, calibration)
        self.ideal_ms = ideal
        self.mfu_reason = why
        self.flops = detail
        self._record = {
            "kind": "flops", **detail, "device": b.device if b is not None else "none",
            "device_name": name, "ideal_ms": ideal, "calibration": calibration,
            "unavailable": {} if ideal is not None else {"ideal_ms": why},
        }

    # -- collector ------------------------------------------------------------------

    def on_record(self, step: Step, record: dict[str, Any]) -> None:
        """Add ``flops``, ``tflops_per_s`` and ``mfu`` (and ``flops_counted``) to a step record."""
        unavailable = record["unavailable"]
        span_ms = max(record["wall_ms"], record["gpu_ms"] or 0.0)
        f = self.flops
        # Also a step whose count failed or raised: it ran eagerly under the counter.
        counted = step.index in self._under_counter
        if f is None or (f.get("step") is not None and step.index < f["step"]):
            why = (self.reason if f is None
                   else f"FLOPs were counted at step {f['step']}, after this one")
            record["flops"] = record["tflops_per_s"] = record["mfu"] = None
            unavailable["flops"] = unavailable["tflops_per_s"] = unavailable["mfu"] = why
            if counted:
                record["flops_counted"] = True  # its times include FlopCounterMode's own cost
            return
        flops = f["flops_per_step"]
        record["flops"] = flops
        record["tflops_per_s"] = tflops = flops / (span_ms * 1e-3) / 1e12 if span_ms > 0 else None
        if tflops is None:
            unavailable["tflops_per_s"] = "step took no measurable time"
        ideal = self.ideal_ms
        record["mfu"] = mfu = ideal / span_ms if ideal is not None and span_ms > 0 else None
        if mfu is None:
            unavailable["mfu"] = self.mfu_reason or "step took no measurable time"
        if counted:
            record["flops_counted"] = True  # its times include FlopCounterMode's own cost

    def after_record(self, step: Step, write: Write) -> None:
        """The flops record, right after the counted step's record (or the first one's)."""
        f = self.flops
        if self._record is not None and (f is None or step.index >= (f.get("step") or 0)):
            record, self._record = self._record, None
            write(record)


# -- memory records ------------------------------------------------------------------------

#: ``MemoryHook.due`` when no further memory record is due (no step has index -1).
_NEVER = -1


class MemoryHook(Hook):
    """The ``kind: "memory"`` records: read on the training thread, reconciled by the collector.

    At the exit of a step that is due one (the first after warm-up, then every
    ``memory_every`` steps) the training thread reads the allocator, ``cudaMemGetInfo``
    and NVML (see bench/memory_costs.py for the cost); the collector reconciles the
    readings and writes the record right after that step's.  Every other step costs one
    integer comparison; once no periodic record is due, none.

    Args:
        warmup: the profiler's warm-up steps (the first record follows them).
        every: ``memory_every``: steps between periodic records; 0 for none.
        retire: takes the hook off the step boundaries.
    """

    def __init__(self, *, warmup: int, every: int, retire: Callable[[Hook], None]) -> None:
        self.due = warmup
        self.peak_seen = -1  # the highest step peak written so far (kept by the collector)
        self._warmup = warmup
        self._every = every
        self._retire = retire
        self._snaps: dict[int, tuple[str, Snapshot | str]] = {}

    def on_step_end(self, step: Step, exc: BaseException | None) -> None:
        if step.index == self.due:
            self._snapshot(step, step.backend)

    def _snapshot(self, step: Step, b: Backend) -> None:
        """At the exit of a step due a memory record: read now; the collector reconciles."""
        self.due = step.index + self._every if self._every else _NEVER
        if self.due == _NEVER:
            self.retired = True
            self._retire(self)
        if not b.has_device_memory:
            return  # on the host there is no GPU memory to reconcile
        trigger = _memory.AFTER_WARMUP if step.index == self._warmup else _memory.PERIODIC
        try:
            _memory.observe(b)  # no-op once the baseline exists
            snap: Snapshot | str = _memory.take_snapshot(b)
        except Exception as e:  # noqa: BLE001 - a missing record, never a stopped recorder
            snap = f"reading memory failed: {type(e).__name__}: {e}"
        self._snaps[step.index] = (trigger, snap)

    def after_record(self, step: Step, write: Write) -> None:
        """The memory record of ``step``, right after its step record."""
        self.peak_seen = max(self.peak_seen, step.peak)
        if not self._snaps:
            return
        item = self._snaps.pop(step.index, None)
        if item is None:
            return
        trigger, snap = item
        device = step.backend.device
        try:
            if isinstance(snap, str):
                rep = _memory.unavailable_report(device, snap, trigger=trigger, step=step.index)
            else:
                rep = _memory.build(snap, trigger=trigger, step=step.index, peak_floor=self.peak_seen)
        except Exception as e:  # noqa: BLE001 - a missing record, never a stopped collector
            rep = _memory.unavailable_report(
                device, f"reconciling failed: {type(e).__name__}: {e}", trigger=trigger, step=step.index
            )
        write(rep.to_record())

    def on_close(self, closing: Closing) -> None:
        """The close record (readings of steps never written are dropped)."""
        self._snaps.clear()
        b = closing.backend
        if b is None or not b.has_device_memory or closing.stopped:
            return
        rep = _memory.report(b, trigger=_memory.CLOSE, step=closing.last_step, peak_floor=self.peak_seen)
        closing.write(rep.to_record())

    def forget(self) -> None:
        """After a fork: the readings are the parent's."""
        self._snaps = {}


# -- the cross-rank exchange ------------------------------------------------------------

#: The token of a step entered after recording stopped (see :meth:`ExchangeHook.enter_unrecorded`).
UNRECORDED = object()


class ExchangeHook(Hook):
    """Feeds the exchange's window and counts every step exit in it, recorded or not.

    Every rank must exit the same number of steps for the exchanges to match, so a step
    that recording dropped (after an internal error) still counts, exactly once.

    Args:
        exchange: the exchange.
        harvest_if_free: harvests now unless a harvest is under way.
    """

    def __init__(self, exchange: Exchange, harvest_if_free: Callable[[], None]) -> None:
        self.exchange = exchange
        self._harvest_if_free = harvest_if_free
        self._gap_from: tuple[Any, int] | None = None  # the last step's end, for the next gap
        self._unrecorded_open = False  # a step entered after recording stopped

    # -- training thread ------------------------------------------------------------

    def on_step_end(self, step: Step, exc: BaseException | None) -> None:
        ex = self.exchange
        if ex.due():
            # Bring the window up to date first: the collector runs every 20 ms, so a short
            # window could otherwise still be empty.  This harvests only steps whose events
            # have completed (query(), never a wait).
            self._harvest_if_free()
        ex.step_exit(step.index, step.backend.index)  # after the sync watch: enqueues, never waits

    def on_fail(self, step_open: bool, why: str) -> None:
        if step_open:
            # The step stays open for the exchange until its own exit: the phases entered
            # in it from now on are not steps of their own.
            self._unrecorded_open = True

    def enter_unrecorded(self) -> Any:
        """After an internal error: still count steps, so that the exchanges stay matched."""
        if self._unrecorded_open:
            return None  # a phase of the unrecorded step
        self._unrecorded_open = True
        return UNRECORDED

    def entry_failed(self) -> Any:
        """The step that failed to open still counts: its exit takes part in the exchange."""
        self._unrecorded_open = False
        return self.enter_unrecorded()

    def stopped_in_step(self) -> None:
        """Recording stopped inside a step whose exit has now counted."""
        self._unrecorded_open = False

    def exit_unrecorded(self, token: Any, device_index: int | None) -> None:
        """Exit of a step that recording dropped: take part in its exchange all the same."""
        ex = self.exchange
        if token is UNRECORDED:
            self._unrecorded_open = False
        elif not isinstance(token, Step):
            return  # a phase
        else:
            self._unrecorded_open = False  # the step that was open when recording stopped
            if ex.exits != token.index:
                return  # its exchange already ran
        try:
            ex.step_exit(None if token is UNRECORDED else token.index, device_index)
        except Exception:  # noqa: BLE001, S110 - Exchange warns about its own failures
            pass

    # -- collector ------------------------------------------------------------------

    def on_harvest(self, write: Write) -> None:
        self.exchange.poll(write)

    def on_record(self, step: Step, record: dict[str, Any]) -> None:
        """Add a completed step to the exchange window; keep its end mark for the next gap.

        The collector leaves every step's end mark to this hook (``keep_end_marks``).
        """
        b = step.backend
        prev, self._gap_from = self._gap_from, (step.end_mark, step.t1)
        gap = None
        if prev is not None:
            if prev[0] is not None and step.start_mark is not None:
                gap = elapsed_ms(b, prev[0], step.start_mark)
            elif not b.has_device_timing:
                gap = (step.t0 - prev[1]) / 1e6
            b.release(prev[0])
        if step.warmup or step.error is not None:
            return
        gpu_ms = record["gpu_ms"]
        key = "gpu_ms" if gpu_ms is not None else "wall_ms"
        top = {k: v[key] for k, v in record["phases"].items() if "/" not in k}
        self.exchange.window.add(
            gpu_ms, record["wall_ms"], step.peak if step.peak >= 0 else None,
            step.syncs["count"] if step.syncs is not None else None, gap, top)

    def on_close(self, closing: Closing) -> None:
        """Finish the enqueued exchanges (start none); release the last end mark."""
        self.exchange.close(closing.write)
        if self._gap_from is not None and closing.backend is not None:
            closing.backend.release(self._gap_from[0])
