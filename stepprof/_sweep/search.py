"""``stepprof.sweep``: samples/s and peak memory over batch sizes; the knee, the
largest batch that fits, the thrash zone; survives out-of-memory errors.

How it searches (docs/sweep.md has the reasoning and the evidence):

1. **Grow.** From ``start``, double the batch, or quadruple it while samples/s
   still rises almost in proportion (the step is launch-bound there, and a size
   skipped that way is measured later only if it could be the knee).  Growth
   stops at an out-of-memory error, at ``max_batch``, at the time budget, at a
   plateau (two growth steps in a row that raised the best samples/s by < 5%),
   or when the next size would pass the boundary that the memory fit predicts.
2. **Refine.** A straight line through the peaks of the two largest batches that
   ran (``peak = base + bytes_per_sample * n``), set against the bytes the
   allocator can hold, predicts the largest batch that fits.  Probes aim just
   under it, then just above the largest fit, so that usually two probes bracket
   the boundary within 3%: a batch that ran, and one at most 3% larger that ran
   out of memory.  After an out-of-memory error, the bytes that trial held at
   once bound the limit from below and set the next probe.  A probe whose
   outcome contradicts the fit makes the next probe a bisection, so a poor fit
   costs probes but never correctness.
3. **Backfill** sizes skipped by quadrupling that could be the knee.

One trial at one batch size is :mod:`stepprof._sweep.trial`; the decisions over
the points (knee, thrash zone, fit, recommendation) are :mod:`stepprof._sweep.rules`.
"""

from __future__ import annotations

import contextvars
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch

from .._registry import pop_active, push_active
from .._device.cuda import CudaSweepBackend
from .._device.select import select_sweep_backend, upgrade_from_host
from .._log import JsonlWriter
from .._validate import (
    check_callable,
    check_device,
    check_fraction,
    check_int,
    check_max_batch,
    check_progress,
    check_restore,
    check_seconds,
)
from .output import SweepOutput, progress_printer
from .restore import MutedProfiler, SavedRngState, SavedState
from .result import SweepPoint, SweepResult
from .rules import (
    DROP,
    choose_probe,
    find_knee,
    find_thrash_zone,
    largest_certifying_oom,
    memory_fit,
    outside_zone,
    ran_points,
)
from .trial import Clock, TrialRunner, leak_note
from .verdict import build_result

if TYPE_CHECKING:
    from .._device.backend import SweepBackend

#: The type of the batches make_batch makes and train_step takes.
_B = TypeVar("_B")

__all__ = ["BatchSearch", "sweep"]

#: Quadruple instead of double while the last growth raised samples/s by at least
#: 90% of the batch ratio (near-linear: the step time hardly grew).
LINEAR = 0.9
#: A plateau: two growth steps in a row that raised the best samples/s by < 5%.
PLATEAU_GAIN = 0.05
#: The most probes after growth stops (refining, searching down, backfilling).
MAX_PROBES = 24


#: The device and clock a sweep runs on when tests or benchmarks replace them (see
#: :func:`sweep_on`); None: the real ones.  Not part of :func:`sweep`'s signature.
_seams: contextvars.ContextVar[tuple[Any, Clock] | None] = contextvars.ContextVar(
    "stepprof_sweep_seams", default=None
)


def sweep_on(backend: Any, clock: Clock, train_step: Callable[[Any], Any],
             make_batch: Callable[[int], Any], **settings: Any) -> SweepResult:
    """:func:`sweep` on a given backend and clock (a fake device in tests)."""
    token = _seams.set((backend, clock))
    try:
        return sweep(train_step, make_batch, **settings)
    finally:
        _seams.reset(token)


def sweep(
    train_step: Callable[[_B], object],
    make_batch: Callable[[int], _B],
    *,
    start: int = 1,
    max_batch: int | None = None,
    time_budget_s: float | None = None,
    log: str | os.PathLike[str] | None = None,
    restore: Any = None,
    device: str | int | torch.device | None = None,
    progress: bool | Callable[[str], Any] = True,
    warmup: int = 1,
    steps: int = 3,
    min_time_s: float = 0.05,
    max_steps: int = 50,
    knee_within: float = 0.10,
) -> SweepResult:
    """Measure samples/s and peak memory over batch sizes, and recommend one.

    The sweep trains: every trial runs real steps, so weights and optimizer state
    change unless you pass ``restore``.  ``make_batch`` must give realistic data
    (real samples, or random data of the real distribution), never zeros: kernels
    and sparsity can run faster on zeros.  The batch is made once per trial, and
    making it is not timed.

    Args:
        train_step: ``train_step(batch)`` runs one full training step (forward,
            backward, optimizer step); its return value is dropped.
        make_batch: ``make_batch(n)`` returns a batch of ``n`` samples, on the
            device that ``train_step`` expects.
        start: the first batch size tried.
        max_batch: the largest batch size tried; None for no limit.
        time_budget_s: stop starting trials after this many seconds; None for none.
        log: a JSON-lines path: one ``sweep_point`` record per trial, then a
            ``sweep_result`` record (appended).
        restore: a module, optimizer, scheduler or scaler, or a tuple of them. Their
            state dicts (and a module's gradients) are copied to host memory first
            and loaded back afterwards, also when the sweep raises.
        device: ``"cuda:N"`` or ``"cpu"``; None uses CUDA if this process has
            initialised it (the model is on the GPU), else the CPU.
        progress: True gives a line per trial to the ``stepprof.sweep`` logger at INFO
            when logging has a handler for it, else to stderr; False gives none, and a
            callable receives each line.
        warmup: untimed steps per trial, before the timed ones.
        steps: the fewest timed steps per trial.
        min_time_s: the least time of timed steps per trial.
        max_steps: the most timed steps per trial.
        knee_within: the knee is the smallest batch within this fraction of the best
            samples/s.

    Returns:
        A :class:`stepprof.SweepResult`; ``str()`` of it is a table.

    Raises:
        stepprof.ConfigError: a bad argument, or a batch of the wrong size.
        stepprof.UsageError: ``train_step`` or ``make_batch`` is not callable.
        Exception: any error of ``train_step`` or ``make_batch`` that is not an
            out-of-memory error, unchanged but for a note that names the batch size.
    """
    check_callable(train_step, "train_step", "pass the function that runs one training step")
    check_callable(make_batch, "make_batch", "pass a function n -> batch of n samples, e.g. lambda n: x[:n]")
    settings = _checked_settings(
        start=start, max_batch=max_batch, time_budget_s=time_budget_s, warmup=warmup, steps=steps,
        max_steps=max_steps, min_time_s=min_time_s, knee_within=knee_within,
    )
    check_progress(progress)
    objs = check_restore(restore)
    device = check_device(device)
    seams = _seams.get()
    backend = seams[0] if seams is not None else select_sweep_backend(device)
    search = BatchSearch(
        train_step, make_batch, backend=backend, auto_backend=seams is None and device is None,
        say=progress_printer(progress), clock=seams[1] if seams is not None else time.perf_counter_ns,
        **settings,
    )
    return _run_restoring(search, objs, log)


def _checked_settings(
    *, start: int, max_batch: int | None, time_budget_s: float | None, warmup: int, steps: int,
    max_steps: int, min_time_s: float, knee_within: float,
) -> dict[str, Any]:
    """:func:`sweep`'s search settings, checked in the order of its signature, as :class:`BatchSearch` takes them."""
    check_int(start, "start", 1, "the first batch size to try, e.g. start=1")
    check_max_batch(max_batch, start)
    budget_s = None if time_budget_s is None else check_seconds(time_budget_s, "time_budget_s", allow_zero=False)
    check_int(warmup, "warmup", 0, "pass e.g. warmup=1")
    check_int(steps, "steps", 1, "pass e.g. steps=3")
    check_int(max_steps, "max_steps", steps, f"max_steps bounds the timed steps and must be >= steps ({steps})")
    min_time = check_seconds(min_time_s, "min_time_s", allow_zero=True)
    within = check_fraction(knee_within, "knee_within", "0.10")
    return {
        "start": start, "max_batch": max_batch, "budget_s": budget_s, "warmup": warmup, "steps": steps,
        "min_time_s": min_time, "max_steps": max_steps, "knee_within": within,
    }


def _run_restoring(search: BatchSearch, objs: tuple[Any, ...], log: Any) -> SweepResult:
    """Run ``search`` with ``profile_step`` muted, the log open, and the user's state (``objs``
    and the random state) put back afterwards, also when it raises."""
    backend = search.backend
    saved = SavedState(objs)
    # isinstance, not ``backend.index``: the test fakes carry an index without a CUDA RNG.
    rng = SavedRngState(backend.index if isinstance(backend, CudaSweepBackend) else None)
    writer = search.out.writer = JsonlWriter(log) if log is not None else None  # opened last: nothing can leak it
    muted = MutedProfiler()
    push_active(muted)  # type: ignore[arg-type]
    try:
        return search.run()
    finally:
        pop_active(muted)  # type: ignore[arg-type]
        try:
            saved.restore()
        finally:
            rng.restore()
            if writer is not None:
                writer.close()


class BatchSearch:
    """One sweep's state: the points so far and the search over them."""

    def __init__(
        self,
        train_step: Callable[[Any], Any],
        make_batch: Callable[[int], Any],
        *,
        backend: Any,
        auto_backend: bool,
        start: int,
        max_batch: int | None,
        budget_s: float | None,
        say: Callable[[str], Any] | None,
        warmup: int,
        steps: int,
        min_time_s: float,
        max_steps: int,
        knee_within: float,
        clock: Clock,
    ) -> None:
        self.trials = TrialRunner(
            train_step, make_batch, backend=backend, clock=clock, warmup=warmup, steps=steps,
            min_time_s=min_time_s, max_steps=max_steps, over_budget=self._over_budget,
        )
        self.auto_backend = auto_backend
        self.start = start
        self.max_batch = max_batch
        self.budget_ns = None if budget_s is None else int(budget_s * 1e9)
        self.out = SweepOutput(say)
        self.knee_within = knee_within
        self.clock = clock
        self.t0 = 0
        self.points: list[SweepPoint] = []
        self.fits: dict[int, SweepPoint] = {}
        self.ooms: dict[int, SweepPoint] = {}
        self.skipped: list[tuple[int, int]] = []  # (a measured batch, a size skipped above it)
        self.notes: list[str] = []
        self.capacity: int | None = None
        self.stopped = ""
        self.probes = 0

    @property
    def backend(self) -> Any:
        """The backend the trials run on (it can change once: see :func:`upgrade_from_host`)."""
        return self.trials.backend

    def _over_budget(self) -> bool:
        return self.budget_ns is not None and self.clock() - self.t0 >= self.budget_ns

    # -- the search ------------------------------------------------------------------------

    def run(self) -> SweepResult:
        """Grow, refine, backfill; then log and return the result."""
        self.t0 = self.clock()
        self.capacity = self.trials.read(self.backend.capacity_bytes, "capacity_bytes")
        trials = self.trials
        self.out.opening(
            self.backend.device, self.capacity, warmup=trials.warmup, steps=trials.steps,
            min_time_ns=trials.min_time_ns,
        )
        self._grow()
        if not self.stopped:
            self._refine()
        self._backfill()
        return self.out.result(self._result())

    def _grow(self) -> None:
        n = self.start
        grown: list[int] = []
        while True:
            if self._over_budget():
                self.stopped = "time_budget"
                return
            if self._trial(n, "grow").oom:
                return  # refine between the largest fit and this
            grown.append(n)
            if self.max_batch is not None and n >= self.max_batch:
                self.stopped = "max_batch"
                return
            boundary = self._boundary()
            if self._plateau(grown):
                if boundary is not None:
                    return  # growing further only measures the flat part: jump to the boundary
                if self.max_batch is None:
                    self.stopped = "plateau"  # no boundary to aim at, and no bound from the user
                    return
                # Without memory figures, max_batch is the user's bound: grow on to it.
            factor = 4 if self._near_linear(grown) else 2
            nxt = n * factor if self.max_batch is None else min(n * factor, self.max_batch)
            if boundary is not None and nxt > boundary:
                return  # the next size would likely run out of memory: refine instead
            if nxt > 2 * n:
                self.skipped.append((n, 2 * n))
            n = nxt

    def _sps(self, n: int) -> float:
        return self.fits[n].samples_per_s or 0.0

    def _near_linear(self, grown: list[int]) -> bool:
        if len(grown) < 2:
            return False
        smaller, larger = grown[-2], grown[-1]
        return self._sps(larger) >= LINEAR * (larger / smaller) * self._sps(smaller)

    def _plateau(self, grown: list[int]) -> bool:
        if len(grown) < 3:
            return False
        best_then = max(self._sps(m) for m in self.fits if m <= grown[-3])
        best_now = max(self._sps(m) for m in self.fits if m <= grown[-1])
        return best_now < (1 + PLATEAU_GAIN) * best_then

    def _boundary(self, capacity: int | None = None) -> float | None:
        """The largest batch the memory fit says fits in ``capacity`` bytes (default: the
        allocator's capacity), or None."""
        fit = memory_fit(self.fits)
        capacity = self.capacity if capacity is None else capacity
        if fit is None or capacity is None:
            return None
        base, slope = fit
        return (capacity - base) / slope

    def _held_at_once(self) -> int | None:
        """The most bytes seen allocated at once: a lower bound on what fits.

        An out-of-memory trial's peak is what was allocated when the failing request
        came; a step allocates as it goes, so that is often close to the limit.
        """
        peaks = [p.peak_allocated_bytes for p in self.points if p.peak_allocated_bytes is not None]
        return max(peaks) if peaks else None

    def _refine(self) -> None:
        last_miss = False
        while True:
            lo = max(self.fits) if self.fits else None
            hi = min(self.ooms) if self.ooms else None
            expect: str | None = None
            if lo is None:
                if hi is None or hi <= 1:
                    self.stopped = "no_fit"
                    return
                probe, phase = hi // 2, "down"
            else:
                if hi is not None and hi <= largest_certifying_oom(lo):
                    self.stopped = "boundary"
                    return
                if self.max_batch is not None and lo >= self.max_batch:
                    self.stopped = "max_batch"
                    return
                probe, expect = self._choose(lo, hi, last_miss)
                phase = "refine"
            if self._over_budget():
                self.stopped = "time_budget"
                return
            if self.probes >= MAX_PROBES:
                self.stopped = "probe_limit"
                return
            self.probes += 1
            point = self._trial(probe, phase)
            last_miss = expect is not None and point.oom != (expect == "oom")

    def _choose(self, lo: int, hi: int | None, last_miss: bool) -> tuple[int, str | None]:
        """The next probe and the outcome the memory fit expects ("fit", "oom" or None)."""
        held = self._held_at_once()
        return choose_probe(
            lo, hi, last_miss=last_miss, boundary=self._boundary(),
            floor_guess=None if held is None else self._boundary(held), max_batch=self.max_batch,
        )

    def _backfill(self) -> None:
        """Measure sizes skipped by quadrupling that could still be the recommended batch."""
        for measured, skipped in self.skipped:
            if skipped in self.fits or skipped in self.ooms or measured not in self.fits:
                continue
            zone = find_thrash_zone(self.points)
            clean = outside_zone(self.points, zone)
            rec = find_knee(clean, self.knee_within)
            ran = ran_points(clean)
            if rec is None or skipped >= rec or not ran:
                continue
            best = max(p.samples_per_s for p in ran if p.samples_per_s is not None)  # (each has it)
            # The step time does not shrink as the batch grows, so samples/s at the skipped
            # size is at most skipped/measured times that at the measured one (plus noise).
            bound = (skipped / measured) * self._sps(measured) * (1 + DROP)
            if bound < (1 - self.knee_within) * best:
                continue
            if self._over_budget():
                self.notes.append(
                    f"the time budget ran out before batch {skipped:,}, skipped while growing, was measured"
                )
                return
            if self.probes >= MAX_PROBES:
                return
            self.probes += 1
            self._trial(skipped, "backfill")

    # -- one trial ---------------------------------------------------------------------------

    def _trial(self, n: int, phase: str) -> SweepPoint:
        point = self._measure(n, phase)
        if self.auto_backend:
            self.auto_backend = False
            cuda = cast("SweepBackend | None", upgrade_from_host(self.backend, sweep=True))  # (sweep=True)
            if cuda is not None:
                # The step initialised CUDA: the host clock cannot time asynchronous GPU work.
                self.trials.backend = cuda
                self.capacity = self.trials.read(cuda.capacity_bytes, "capacity_bytes")
                self.notes.append(
                    f"CUDA was initialised by the first trial, so the sweep switched to {cuda.device} "
                    f"and measured batch {n:,} again"
                )
                point = self._measure(n, phase)
        self.points.append(point)
        (self.ooms if point.oom else self.fits)[n] = point
        note = leak_note(point)
        if note is not None:
            self.notes.append(note)
        self.out.point(point, phase)
        return point

    def _measure(self, n: int, phase: str) -> SweepPoint:
        return self.trials.measure(
            n, phase, trial=len(self.points) + 1, smaller_batch_ran=any(m < n for m in self.fits)
        )

    # -- the result ---------------------------------------------------------------------------

    def _result(self) -> SweepResult:
        backend = self.backend
        return build_result(
            self.points, self.fits, self.ooms, stopped=self.stopped, device=backend.device,
            capacity=self.capacity, memory_reason=backend.memory_reason, unavailable=self.trials.unavailable,
            notes=self.notes, knee_within=self.knee_within, max_batch=self.max_batch,
            wall_s=(self.clock() - self.t0) / 1e9,
        )
