"""One trial of the sweep at one batch size, and the rule for out-of-memory errors.

Each trial: ``make_batch(n)`` once, ``warmup`` steps, then timed steps until
both ``steps`` steps and ``min_time_s`` have passed (at most ``max_steps``).  On
CUDA an event is recorded after every step on the current stream and all are
read after one synchronisation at the end of the trial; the median of the
per-step spans is ``step_ms``.  On the CPU, ``perf_counter`` spans.

Out of memory: the trial's ``except`` block only records the error's text.  The
clean-up runs after the block has been left (a live traceback keeps the failed
step's frames, and with them its activations, alive): drop the batch,
``gc.collect()``, ``empty_cache()``, then compare ``memory_allocated`` with the
pre-trial baseline and record any difference as ``leaked_bytes``.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import attrs
import torch

from .._errors import from_signal_handler, raised_by_user
from .._records import Percentiles
from .._units import format_bytes, per_s
from .._batch import check_batch
from .result import SweepPoint

__all__ = ["TrialRunner", "is_oom", "leak_note"]

Clock = Callable[[], int]

# Out-of-memory errors that arrive as a RuntimeError (or a subclass such as
# torch.AcceleratorError) rather than as torch.OutOfMemoryError.
_OOM_MARKERS = (
    "CUDA out of memory",  # the caching allocator (torch.OutOfMemoryError's own text)
    "CUDA error: out of memory",  # cudaErrorMemoryAllocation from a CUDA call outside the allocator
    "CUBLAS_STATUS_ALLOC_FAILED",  # cuBLAS could not allocate its handle or workspace
    "CUSOLVER_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",  # cuDNN 8
    "CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED",  # cuDNN 9
    "CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED",
    "CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",
    "DefaultCPUAllocator: can't allocate memory",  # torch's CPU allocator
)
# cuDNN statuses that are out-of-memory in disguise when a smaller batch ran
# (pytorch/pytorch#4107, #81620: cuDNN cannot load its kernels or plan its
# workspace) but a real error otherwise.  They count as OOM only once a smaller
# batch has run in the same sweep.
_AMBIGUOUS_MARKERS = ("CUDNN_STATUS_NOT_SUPPORTED", "CUDNN_STATUS_INTERNAL_ERROR")
_OOM_TYPES: tuple[type[BaseException], ...] = tuple(
    {t for t in (getattr(torch, "OutOfMemoryError", None),
                 getattr(torch.cuda, "OutOfMemoryError", None)) if t is not None}
) + (MemoryError,)


def is_oom(exc: BaseException, *, smaller_batch_ran: bool = False) -> bool:
    """Whether ``exc`` means "this batch does not fit in memory".

    True for ``torch.OutOfMemoryError``, Python's ``MemoryError``, and a
    ``RuntimeError`` whose message is one of the CUDA, cuBLAS, cuSOLVER, cuDNN or
    CPU-allocator out-of-memory messages.  ``CUDNN_STATUS_NOT_SUPPORTED`` and
    ``CUDNN_STATUS_INTERNAL_ERROR`` count only when ``smaller_batch_ran``.
    """
    if isinstance(exc, _OOM_TYPES):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    try:
        msg = str(exc)
    except BaseException as e:  # noqa: BLE001 - a broken __str__ (whatever it raises) is not an OOM
        if from_signal_handler(e):
            raise
        return False
    if any(m in msg for m in _OOM_MARKERS):
        return True
    return smaller_batch_ran and any(m in msg for m in _AMBIGUOUS_MARKERS)


def leak_note(point: SweepPoint) -> str | None:
    """The sweep's note on an out-of-memory trial whose clean-up left bytes allocated, or None."""
    if not point.oom or not point.leaked_bytes:
        return None
    return (
        f"after running out of memory at batch {point.batch_size:,}, {format_bytes(point.leaked_bytes)} "
        f"stayed allocated beyond the pre-trial baseline (something still refers to tensors from the "
        f"failed step, or the step created state, such as optimizer moments, that stays)"
    )


def _annotate(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # pragma: no cover - Python 3.10
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]  # type: ignore[attr-defined]


def _first_line(exc: BaseException) -> str:
    try:
        text = str(exc).strip().splitlines()
    except BaseException as e:  # noqa: BLE001 - the user's __str__, whatever it raises
        if from_signal_handler(e):
            raise
        text = []
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}".rstrip(": ")


class TrialRunner:
    """Runs trials on one backend and clock, with the sweep's per-trial settings.

    ``unavailable`` collects, for the whole sweep, the device figures that could
    not be read (first reason kept); :meth:`read` is how the sweep reads them.
    """

    def __init__(
        self,
        train_step: Callable[[Any], Any],
        make_batch: Callable[[int], Any],
        *,
        backend: Any,
        clock: Clock,
        warmup: int,
        steps: int,
        min_time_s: float,
        max_steps: int,
        over_budget: Callable[[], bool],
    ) -> None:
        self.train_step = train_step
        self.make_batch = make_batch
        self.backend = backend
        self.clock = clock
        self.warmup = warmup
        self.steps = steps
        self.min_time_ns = int(min_time_s * 1e9)
        self.max_steps = max_steps
        self.over_budget = over_budget
        self.unavailable: dict[str, str] = {}

    def read(self, fn: Callable[[], Any], what: str) -> Any:
        """``fn()``, or None when it raises: a missing figure, never a failed sweep."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - a missing figure, never a failed sweep
            if raised_by_user(e):
                raise
            self.unavailable.setdefault(what, f"reading it failed: {type(e).__name__}: {e}")
            return None

    def measure(self, n: int, phase: str, *, trial: int, smaller_batch_ran: bool) -> SweepPoint:
        """Run trial number ``trial`` at batch size ``n``; an out-of-memory error is a point.

        Raises:
            Exception: any other error of ``make_batch`` or ``train_step``, with a note
                that names the batch size; a :class:`stepprof.ConfigError` for a batch
                of the wrong size.
        """
        t_in = self.clock()
        unavailable: dict[str, str] = {}
        base, peak_reason = self._start_clean()
        steps = _TimedSteps()
        failure = self._run_steps(n, steps, unavailable, smaller_batch_ran=smaller_batch_ran)
        # Returned from _run_steps: the exception, its traceback and the failed step's frames
        # (holding the batch and its activations) are gone once nothing refers to them.
        t_end = self.clock()
        mem = self.read(self.backend.read_memory, "peak_allocated_bytes")
        peak = None if mem is None or peak_reason is not None else int(mem[0])
        if peak is None:
            unavailable["peak_allocated_bytes"] = peak_reason or self.backend.memory_reason or "not read"
        if failure is not None:
            leaked = self._clean_up_after_oom(steps, base, unavailable)
            return SweepPoint(
                trial=trial, phase=phase, batch_size=n, oom=True, samples_per_s=None, step_ms=None,
                step_ms_p10=None, step_ms_p90=None, timed_steps=steps.timed, warmup_steps=self.warmup,
                peak_allocated_bytes=peak, alloc_retries=None, device_allocs=None,
                leaked_bytes=leaked, error=failure, wall_s=(self.clock() - t_in) / 1e9,
                unavailable=unavailable,
            )
        step_ms, p10, p90 = self._step_times(steps, t_end, unavailable)
        sps = per_s(n, step_ms) if step_ms is not None and step_ms > 0 else None
        if sps is None:
            unavailable["samples_per_s"] = (
                "the timed steps took no measurable time" if not step_ms or step_ms <= 0
                else "the batch size over the step time is past a float's range"
            )
        retries, device_allocs = self._allocator_events(steps, unavailable)
        return SweepPoint(
            trial=trial, phase=phase, batch_size=n, oom=False, samples_per_s=sps, step_ms=step_ms,
            step_ms_p10=p10, step_ms_p90=p90, timed_steps=steps.timed, warmup_steps=self.warmup,
            peak_allocated_bytes=peak, alloc_retries=retries, device_allocs=device_allocs,
            leaked_bytes=None, error=None, wall_s=(self.clock() - t_in) / 1e9, unavailable=unavailable,
        )

    def _start_clean(self) -> tuple[int | None, str | None]:
        """Empty the allocator's cache and reset the peak counter before a trial.

        Returns:
            The bytes allocated now (the baseline an out-of-memory clean-up is held to),
            and why the peak counter could not be reset (None when it was).
        """
        backend = self.backend
        backend.synchronize()
        # Each trial starts from a clean allocator, as a training run at this batch size would:
        # blocks cached by earlier, smaller trials fragment the pool and can make a batch run
        # out of memory that fits from a clean start (see bench/sweep.py).  No gc.collect()
        # here: the previous trial's batch is already released (an OOM's clean-up collects),
        # and a full collection is costly with torch loaded.
        self.read(backend.empty_cache, "empty_cache")
        base = self.read(backend.allocated_bytes, "allocated_bytes")
        # A peak counter that was not reset holds an earlier trial's (or the user's) peak.
        peak_reason: str | None = None
        try:
            backend.reset_peak()
        except Exception as e:  # noqa: BLE001 - a missing figure, never a failed sweep
            if raised_by_user(e):
                raise
            peak_reason = f"resetting the peak counter failed: {type(e).__name__}: {e}"
            self.unavailable.setdefault("peak_allocated_bytes", peak_reason)
        return base, peak_reason

    def _run_steps(
        self, n: int, steps: _TimedSteps, unavailable: dict[str, str], *, smaller_batch_ran: bool
    ) -> str | None:
        """Make the batch, run the warm-up and the timed steps; fills ``steps``.

        Returns:
            None, or the first line of the out-of-memory error that ended the trial.
        """
        backend, clock = self.backend, self.clock
        batch: Any = None
        stage = "make_batch"
        try:
            batch = self.make_batch(n)
            stage = "check"
            check_batch(batch, n)
            stage = "train_step"
            for _ in range(self.warmup):
                self.train_step(batch)
            steps.counters.append(self.read(backend.allocator_counters, "alloc_retries"))
            steps.marks.append(backend.mark())
            if steps.marks[0] is None and backend.has_device_timing:
                # No event: the fallback times the synchronised span from here, so the
                # warm-up's queued GPU work must be done before the span starts.
                backend.synchronize()
            steps.stamps.append(clock())
            while True:
                self.train_step(batch)
                steps.marks.append(backend.mark())
                steps.stamps.append(clock())
                steps.timed += 1
                if steps.timed >= self.max_steps:
                    break
                if steps.timed >= self.steps and steps.stamps[-1] - steps.stamps[0] >= self.min_time_ns:
                    break
                if self.over_budget():
                    unavailable["timed_steps"] = f"the time budget ran out after {steps.timed} timed step(s)"
                    break
            steps.counters.append(self.read(backend.allocator_counters, "alloc_retries"))
            batch = None
            stage = "synchronize"
            backend.synchronize()
        except Exception as e:
            if raised_by_user(e):
                raise
            if stage == "check" or not is_oom(e, smaller_batch_ran=smaller_batch_ran):
                if stage != "check":
                    where = f"make_batch({n}) raised" if stage == "make_batch" else f"{stage} raised at batch size {n}"
                    _annotate(e, f"stepprof.sweep: {where}; the sweep stopped (it catches only out-of-memory errors)")
                raise
            return _first_line(e)
        return None

    def _clean_up_after_oom(self, steps: _TimedSteps, base: int | None, unavailable: dict[str, str]) -> int | None:
        """Free what the failed trial held; the bytes still allocated beyond ``base``, or None."""
        backend = self.backend
        for mark in steps.marks:
            backend.release(mark)
        steps.marks.clear()
        gc.collect()
        self.read(backend.empty_cache, "empty_cache")
        after = self.read(backend.allocated_bytes, "allocated_bytes")
        leaked = None if after is None or base is None else max(0, int(after) - int(base))
        if leaked is None:
            unavailable["leaked_bytes"] = backend.memory_reason or "allocated bytes could not be read"
        return leaked

    def _step_times(
        self, steps: _TimedSteps, t_end: int, unavailable: dict[str, str]
    ) -> tuple[float | None, float | None, float | None]:
        """(median, p10, p90) ms of the timed steps: from the events, or the host clock's
        spans; only the mean over the synchronised span when device events are missing."""
        backend, marks, timed = self.backend, steps.marks, steps.timed
        spans: list[float] | None = None
        if marks and all(m is not None for m in marks):
            try:
                spans = [backend.elapsed_ms(marks[i], marks[i + 1]) for i in range(timed)]
            except RuntimeError as e:
                unavailable["step_ms"] = f"reading CUDA events failed ({e}); the synchronised span was used"
        elif backend.has_device_timing:
            unavailable["step_ms"] = "a CUDA event could not be recorded; the synchronised span was used"
        else:
            spans = [(steps.stamps[i + 1] - steps.stamps[i]) / 1e6 for i in range(timed)]
        for mark in marks:
            backend.release(mark)
        if spans is None:  # CUDA without events: the average over the synchronised span
            return (t_end - steps.stamps[0]) / 1e6 / timed, None, None
        spread = Percentiles.of(spans)  # the same percentiles as the profiler's Summary.wall_ms and gpu_ms
        return (None, None, None) if spread is None else (spread.median, spread.p10, spread.p90)

    def _allocator_events(
        self, steps: _TimedSteps, unavailable: dict[str, str]
    ) -> tuple[int | None, int | None]:
        """(alloc_retries, device_allocs) during the timed steps, or Nones with the reason."""
        before, after = steps.counters if len(steps.counters) == 2 else (None, None)
        if before is not None and after is not None:
            return after[0] - before[0], after[1] - before[1]
        reason = self.backend.memory_reason or self.unavailable.get("alloc_retries", "not read")
        unavailable["alloc_retries"] = unavailable["device_allocs"] = reason
        return None, None


@attrs.define
class _TimedSteps:
    """What a trial's steps left for the figures: a mark and a host stamp around each
    timed step, the allocator's counters before and after, and how many were timed."""

    marks: list[Any] = attrs.field(factory=list)
    stamps: list[int] = attrs.field(factory=list)
    counters: list[tuple[int, int] | None] = attrs.field(factory=list)
    timed: int = 0
