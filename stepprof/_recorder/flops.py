"""FLOPs per step, and the TFLOP/s and MFU of every step after the count (``Profiler(flops=...)``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._aggregate import NO_STEP_AFTER_THE_COUNT
from .._device.backend import Backend
from .._datasheet import datasheet_ms, find_part
from .._device.facts import device_name
from .._errors import raised_by_user
from .._roofline import FlopCount, ideal_ms, load_calibration
from .._rules import span_ms
from .._units import per_s
from .hooks import Hook
from .sinks import Write
from .step import Step


class FlopsHook(Hook):
    """The FLOPs of one step, counted (``"auto"``) or given, and the figures that follow.

    Counting runs one step, the first past warm-up, under ``FlopCounterMode`` (that step
    runs eagerly; its record says ``flops_counted``).  A step that raises is counted again
    at the next, up to three attempts.  Once the count is done, or given up, the hook
    retires from the step boundaries.

    Args:
        given: the FLOPs of one step when given (``flops_per_step``); None counts them.
        warmup: the profiler's warm-up steps (the count waits for them).
        backend: the profiler's backend when it was made (None: not chosen yet).
        retire: takes the hook off the step boundaries.
    """

    def __init__(self, given: float | None, *, warmup: int, backend: Backend | None,
                 retire: Callable[[Hook], None]) -> None:
        self.flops: dict[str, Any] | None = None  # the flops record's details, once known
        self.reason = "not counted yet: FLOPs are counted in the first step past warm-up"
        self.ideal_ms: float | None = None
        self.mfu_reason: str | None = None
        self.datasheet_ms: float | None = None
        self.datasheet_reason: str | None = None
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

    def summary_reason(self) -> str:
        """Why the summary has no TFLOP/s when no step record says why (see ``SummarySink.summary``)."""
        return self.reason if self.flops is None else NO_STEP_AFTER_THE_COUNT

    # -- training thread ------------------------------------------------------------

    def on_step_begin(self, index: int) -> None:
        if index >= self._warmup and self._count is None:
            fc = FlopCount()
            try:
                fc.start()
            except Exception as e:  # noqa: BLE001 - no count, never a broken step
                if raised_by_user(e):
                    raise
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
                if raised_by_user(e):
                    raise
                self._give_up(f"{type(e).__name__}: {e}")

    def on_fail(self, step_open: bool, why: str) -> None:
        if self._count is not None:
            fc, self._count = self._count, None
            try:
                fc.stop()
            except Exception as e:  # noqa: BLE001, S110 - recording already failed; the reason says so
                if raised_by_user(e):
                    raise
            self._give_up(f"recording stopped during the counted step: {why}")

    def _finish_count(self, step: Step, exc: BaseException | None) -> None:
        fc, self._count = self._count, None
        assert fc is not None
        try:
            fc.stop()
        except Exception as e:  # noqa: BLE001 - a user's mode left on top of ours, say
            if raised_by_user(e):
                raise
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
            self._retire(self)

    def _set_flops(self, detail: dict[str, Any], b: Backend | None) -> None:
        """The step's FLOPs are known: find the calibration and prepare the flops record."""
        index = b.index if b is not None else None
        on_cuda = b is not None and b.has_device_memory
        name = device_name(index) if on_cuda and isinstance(index, int) else None
        calibration = None
        why: str | None
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
        sheet, sheet_ms, sheet_why = self._datasheet(name, by_dtype, on_cuda, b)
        self.datasheet_ms, self.datasheet_reason = sheet_ms, sheet_why
        unavailable = {} if ideal is not None else {"ideal_ms": why}
        if sheet_ms is None:
            unavailable["datasheet_ms"] = sheet_why
        self._record = {
            "kind": "flops", **detail, "device": b.device if b is not None else "none",
            "device_name": name, "ideal_ms": ideal, "calibration": calibration,
            "datasheet_ms": sheet_ms, "datasheet": sheet, "unavailable": unavailable,
        }

    @staticmethod
    def _datasheet(name: str | None, by_dtype: dict[str, Any] | None, on_cuda: bool,
                   b: Backend | None) -> tuple[dict[str, Any] | None, float | None, str]:
        """(the part's datasheet entry, the time the FLOPs need at its dense peaks, why not)."""
        if name is None:
            return None, None, ("the GPU's model name could not be read, so its datasheet peak is unknown"
                                if on_cuda else "mfu_datasheet is for GPUs: the CPU has no datasheet peak here"
                                if b is not None else "no step has run, so the device is unknown")
        part, why = find_part(name)
        if part is None:
            return None, None, why or ""
        entry = {"part": part.name, "tflops": dict(part.tflops), "source": part.source}
        if by_dtype is None:
            return entry, None, ("mfu_datasheet needs the FLOPs' dtypes: with flops_per_step they are "
                                 "unknown; use flops='auto' to count them")
        ms, why = datasheet_ms(by_dtype, part)
        return entry, ms, why or ""

    # -- collector ------------------------------------------------------------------

    def on_record(self, step: Step, record: dict[str, Any]) -> None:
        """Add ``flops``, ``tflops_per_s``, ``mfu`` and ``mfu_datasheet`` (and ``flops_counted``) to a
        step record."""
        unavailable = record["unavailable"]
        span = span_ms(record["wall_ms"], record["gpu_ms"])
        f = self.flops
        # Also a step whose count failed or raised: it ran eagerly under the counter.
        counted = step.index in self._under_counter
        if f is None or (f.get("step") is not None and step.index < f["step"]):
            why = (self.reason if f is None
                   else f"FLOPs were counted at step {f['step']}, after this one")
            record["flops"] = record["tflops_per_s"] = record["mfu"] = record["mfu_datasheet"] = None
            unavailable["flops"] = unavailable["tflops_per_s"] = unavailable["mfu"] = why
            unavailable["mfu_datasheet"] = why
            if counted:
                record["flops_counted"] = True  # its times include FlopCounterMode's own cost
            return
        flops = f["flops_per_step"]
        record["flops"] = flops
        rate = per_s(flops, span) if span > 0 else None
        record["tflops_per_s"] = None if rate is None else rate / 1e12
        if span <= 0:
            unavailable["tflops_per_s"] = "step took no measurable time"
        elif rate is None:
            unavailable["tflops_per_s"] = "flops_per_step over the step time is past a float's range"
        ideal = self.ideal_ms
        record["mfu"] = mfu = ideal / span if ideal is not None and span > 0 else None
        if mfu is None:
            unavailable["mfu"] = self.mfu_reason or "step took no measurable time"
        sheet = self.datasheet_ms
        record["mfu_datasheet"] = mfu_sheet = sheet / span if sheet is not None and span > 0 else None
        if mfu_sheet is None:
            unavailable["mfu_datasheet"] = self.datasheet_reason or "step took no measurable time"
        if counted:
            record["flops_counted"] = True  # its times include FlopCounterMode's own cost

    def after_record(self, step: Step, write: Write) -> None:
        """The flops record, right after the counted step's record (or the first one's)."""
        f = self.flops
        if self._record is not None and (f is None or step.index >= (f.get("step") or 0)):
            record, self._record = self._record, None
            write(record)
