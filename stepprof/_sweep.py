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

import copy
import gc
import math
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ._cuda import CudaSweepBackend, HostSweepBackend, select_sweep_backend
from ._errors import ConfigError, UsageError
from ._log import SCHEMA_VERSION, JsonlWriter
from ._records import SweepPoint, SweepResult
from ._registry import pop_active, push_active
from ._stats import quantile
from ._units import format_bytes
from ._validate import check_device

__all__ = ["find_knee", "find_thrash_zone", "is_oom", "sweep"]

_Clock = Callable[[], int]

#: ``max_fit`` is certified when the smallest batch that ran out of memory is at
#: most 3% above it: ``first_oom <= floor(max_fit * 103 / 100) + 1``.
_TOL_NUM, _TOL_DEN = 103, 100
#: Probes aim this far under the boundary the memory fit predicts from the bytes
#: the device can give: the allocator never hands all of them to tensors, and
#: aiming 3% low makes (fit here, out of memory 3% higher) the likely outcome.
AIM = 0.97
#: Quadruple instead of double while the last growth raised samples/s by at least
#: 90% of the batch ratio (near-linear: the step time hardly grew).
LINEAR = 0.9
#: A plateau: two growth steps in a row that raised the best samples/s by < 5%.
PLATEAU_GAIN = 0.05
#: Samples/s more than 5% below the best of the smaller batches counts as a drop;
#: it is also the noise margin on the bound that decides whether to backfill.
DROP = 0.05
#: The most probes after growth stops (refining, searching down, backfilling).
MAX_PROBES = 24

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
    except Exception:  # noqa: BLE001 - a broken __str__ is not an OOM
        return False
    if any(m in msg for m in _OOM_MARKERS):
        return True
    return smaller_batch_ran and any(m in msg for m in _AMBIGUOUS_MARKERS)


# -- the analysis: pure functions of the points ----------------------------------


def _ran(points: list[SweepPoint] | tuple[SweepPoint, ...]) -> list[SweepPoint]:
    return sorted(
        (p for p in points if not p.oom and p.samples_per_s is not None), key=lambda p: p.batch_size
    )


def find_knee(points: list[SweepPoint] | tuple[SweepPoint, ...], within: float = 0.10) -> int | None:
    """The smallest batch whose samples/s is within ``within`` of the best that ran."""
    ran = _ran(points)
    if not ran:
        return None
    best = max(p.samples_per_s for p in ran)  # type: ignore[type-var]
    return next(p.batch_size for p in ran if p.samples_per_s >= (1 - within) * best)  # type: ignore[operator]


def find_thrash_zone(points: list[SweepPoint] | tuple[SweepPoint, ...]) -> range | None:
    """Batches from the first sign of thrash up to the largest that ran, or None.

    A sign of thrash is a batch whose timed steps made the allocator retry
    (``alloc_retries > 0``: a cudaMalloc failed, the cache was freed, and the
    allocation retried), or a batch above the fastest clean batch whose samples/s
    fell more than 5% below it, beyond noise: even at its fastest-decile step time
    (``step_ms_p10``) it is more than 5% below the best median.
    """
    ran = _ran(points)
    if not ran:
        return None
    starts = [p.batch_size for p in ran if p.alloc_retries]
    clean = [p for p in ran if not p.alloc_retries]
    if clean:
        best = max(clean, key=lambda p: p.samples_per_s)  # type: ignore[arg-type,return-value]
        floor = (1 - DROP) * best.samples_per_s  # type: ignore[operator]
        starts += [
            p.batch_size for p in clean
            if p.batch_size > best.batch_size and _fastest_rate(p) < floor
        ]
    if not starts:
        return None
    return range(min(starts), ran[-1].batch_size + 1)


def _fastest_rate(p: SweepPoint) -> float:
    """Samples/s at the point's fastest-decile step time (its median rate without p10)."""
    if p.step_ms_p10:
        return p.batch_size / (p.step_ms_p10 / 1e3)
    return p.samples_per_s or 0.0


def _memory_fit(fits: Mapping[int, SweepPoint]) -> tuple[float, float] | None:
    """(base bytes, bytes per sample) from the largest batch that ran and a smaller one.

    The smaller one is the largest at most 2/3 of it (else the next smaller), so
    that allocator rounding between close sizes does not set the slope.
    """
    pts = sorted((n, p.peak_allocated_bytes) for n, p in fits.items() if p.peak_allocated_bytes is not None)
    if len(pts) < 2:
        return None
    na, ma = pts[-1]
    below = [q for q in pts[:-1] if q[0] * 3 <= na * 2] or pts[:-1]
    nb, mb = below[-1]
    slope = (ma - mb) / (na - nb)
    if slope <= 0:
        return None
    return ma - slope * na, slope


def _cert_up(lo: int) -> int:
    """The largest batch whose out-of-memory error certifies ``lo`` within 3%."""
    return lo * _TOL_NUM // _TOL_DEN + 1


def _cert_down(hi: int) -> int:
    """The smallest batch whose fit certifies it within 3% of ``hi`` (which ran out of memory)."""
    return -(-(hi - 1) * _TOL_DEN // _TOL_NUM)


# -- checks ------------------------------------------------------------------------


def _check_int(value: Any, name: str, minimum: int, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name!r} must be an int >= {minimum} (got {value!r}); {hint}")
    if value < minimum:
        raise ConfigError(f"{name!r} must be >= {minimum} (got {value}); {hint}")
    return value


def _check_seconds(value: Any, name: str, *, allow_zero: bool) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{name!r} must be a finite number of seconds {bound} (got {value!r})")
    return float(value)


def _check_callable(fn: Any, name: str, example: str) -> None:
    if callable(fn):
        return
    hint = ""
    if isinstance(fn, torch.Tensor) or fn is None:
        hint = " (did you call it? pass the function itself, without brackets)"
    raise UsageError(f"{name!r} must be callable (got {fn!r}){hint}; {example}")


def _check_restore(restore: Any) -> tuple[Any, ...]:
    if restore is None:
        return ()
    objs = tuple(restore) if isinstance(restore, (list, tuple)) else (restore,)
    for obj in objs:
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise ConfigError(
                f"'restore' takes objects with state_dict() and load_state_dict(), such as a "
                f"module or an optimizer (got {obj!r}); pass e.g. restore=(model, optimizer)"
            )
    return objs


def _leading_sizes(batch: Any, depth: int = 0) -> list[int]:
    """The leading dimensions of the tensors in a batch (a tensor, or containers of them)."""
    if isinstance(batch, torch.Tensor):
        return [int(batch.shape[0])] if batch.dim() >= 1 else []
    if depth >= 3:
        return []
    if isinstance(batch, Mapping):
        items: Any = batch.values()
    elif isinstance(batch, (list, tuple)):
        items = batch
    else:
        return []
    return [s for x in items for s in _leading_sizes(x, depth + 1)]


def _sample_list_lengths(batch: Any, depth: int = 0) -> list[int]:
    """The lengths of the lists and tuples in a batch that hold tensors: a list of n
    per-sample tensors (or of n dicts of them, as detection models take) is n samples."""
    if depth >= 3:
        return []
    if isinstance(batch, Mapping):
        return [s for x in batch.values() for s in _sample_list_lengths(x, depth + 1)]
    if isinstance(batch, (list, tuple)):
        inner = [s for x in batch for s in _sample_list_lengths(x, depth + 1)]
        return ([len(batch)] if _leading_sizes(batch, depth) else []) + inner
    return []


def _check_batch(batch: Any, n: int) -> None:
    """Raise if ``make_batch(n)`` returned a batch whose size is detectably not ``n``.

    Tensors (alone, or in a tuple, list or dict) must have ``n`` as some tensor's
    leading dimension, or sit in a list or tuple of ``n`` items (a list of samples);
    a list or tuple without tensors must have ``n`` items; a
    dict without tensors must have a list or tuple of ``n`` items among its values.
    Other objects cannot be sized and are accepted.
    """
    if batch is None:
        raise ConfigError(
            f"make_batch({n}) returned None; make_batch(n) must return the batch of n samples "
            f"that train_step takes"
        )
    sizes = _leading_sizes(batch)
    if sizes:
        if n not in sizes and n not in _sample_list_lengths(batch):
            got = ", ".join(str(s) for s in sorted(set(sizes)))
            raise ConfigError(
                f"make_batch({n}) returned a batch of {got} samples (the leading dimension of its "
                f"tensors), not {n}; make_batch(n) must return exactly n samples"
            )
        return
    if isinstance(batch, (list, tuple)):
        if len(batch) != n:
            raise ConfigError(
                f"make_batch({n}) returned a {type(batch).__name__} of {len(batch)} items, not {n}; "
                f"make_batch(n) must return exactly n samples"
            )
        return
    if isinstance(batch, Mapping):
        lens = [len(v) for v in batch.values() if isinstance(v, (list, tuple))]
        if lens and n not in lens:
            raise ConfigError(
                f"make_batch({n}) returned a dict whose lists hold {sorted(set(lens))} items, not {n}; "
                f"make_batch(n) must return exactly n samples"
            )


def _annotate(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # pragma: no cover - Python 3.10
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]  # type: ignore[attr-defined]


def _first_line(exc: BaseException) -> str:
    try:
        text = str(exc).strip().splitlines()
    except Exception:  # noqa: BLE001
        text = []
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}".rstrip(": ")


# -- restoring the user's state ------------------------------------------------------


def _to_host(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", copy=True)
    if isinstance(x, dict):
        out: dict[Any, Any] = OrderedDict() if isinstance(x, OrderedDict) else {}
        for k, v in x.items():
            out[k] = _to_host(v)
        meta = getattr(x, "_metadata", None)
        if meta is not None:
            out._metadata = copy.deepcopy(meta)  # type: ignore[attr-defined]  # module versions
        return out
    if isinstance(x, list):
        return [_to_host(v) for v in x]
    if isinstance(x, tuple) and type(x) is tuple:
        return tuple(_to_host(v) for v in x)
    return copy.deepcopy(x)


class _Snapshot:
    """State dicts (and a module's gradients) copied to host memory, put back by :meth:`restore`."""

    def __init__(self, objs: tuple[Any, ...]) -> None:
        self._items: list[tuple[Any, Any, list[tuple[torch.Tensor, torch.Tensor | None]] | None]] = []
        for obj in objs:
            grads = None
            if isinstance(obj, torch.nn.Module):
                grads = [
                    (p, None if p.grad is None else p.grad.detach().to("cpu", copy=True))
                    for p in obj.parameters()
                ]
            self._items.append((obj, _to_host(obj.state_dict()), grads))

    def restore(self) -> None:
        for obj, state, grads in self._items:
            obj.load_state_dict(state)
            if grads is None:
                continue
            with torch.no_grad():
                for p, g in grads:
                    if g is None:
                        p.grad = None
                    elif p.grad is not None and p.grad.shape == g.shape:
                        p.grad.copy_(g)
                    else:
                        p.grad = g.to(p.device)


class _Muted:
    """Stands in for the active profiler during a sweep: ``profile_step`` and ``measure``
    inside ``train_step`` record nothing (and do not reset the peak counter)."""

    closed = False

    def _enter(self, name: Any, batch_size: Any, *, step: bool) -> None:
        return None

    def _exit(self, token: Any, exc: Any) -> None:
        pass

    def __repr__(self) -> str:
        return "<stepprof.sweep: profiling muted>"


# -- the sweep ------------------------------------------------------------------------------


def sweep(
    train_step: Callable[[Any], Any],
    make_batch: Callable[[int], Any],
    *,
    start: int = 1,
    max_batch: int | None = None,
    time_budget_s: float | None = None,
    log: Any = None,
    restore: Any = None,
    device: Any = None,
    progress: bool | Callable[[str], Any] = True,
    warmup: int = 1,
    steps: int = 3,
    min_time_s: float = 0.05,
    max_steps: int = 50,
    knee_within: float = 0.10,
    _backend: Any = None,
    _clock: _Clock | None = None,
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
        progress: True prints a line per trial to stderr, False prints nothing, and a
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
    _check_callable(train_step, "train_step", "pass the function that runs one training step")
    _check_callable(make_batch, "make_batch", "pass a function n -> batch of n samples, e.g. lambda n: x[:n]")
    _check_int(start, "start", 1, "the first batch size to try, e.g. start=1")
    if max_batch is not None:
        _check_int(max_batch, "max_batch", 1, "pass None for no limit")
        if max_batch < start:
            raise ConfigError(
                f"'max_batch' must be >= 'start' ({start}) (got {max_batch}); raise max_batch, "
                f"lower start, or pass max_batch=None"
            )
    budget_s = None if time_budget_s is None else _check_seconds(time_budget_s, "time_budget_s", allow_zero=False)
    _check_int(warmup, "warmup", 0, "pass e.g. warmup=1")
    _check_int(steps, "steps", 1, "pass e.g. steps=3")
    _check_int(max_steps, "max_steps", steps, f"max_steps bounds the timed steps and must be >= steps ({steps})")
    min_time = _check_seconds(min_time_s, "min_time_s", allow_zero=True)
    if isinstance(knee_within, bool) or not isinstance(knee_within, (int, float)) or not 0 < knee_within < 1:
        raise ConfigError(f"'knee_within' must be a fraction between 0 and 1 (got {knee_within!r}); e.g. 0.10")
    if not (isinstance(progress, bool) or callable(progress)):
        raise ConfigError(f"'progress' must be True, False or a callable taking a line (got {progress!r})")
    objs = _check_restore(restore)
    device = check_device(device)

    say: Callable[[str], Any] | None
    if progress is True:
        def say(line: str) -> None:
            print(line, file=sys.stderr, flush=True)
    else:
        say = progress or None  # type: ignore[assignment]
    backend = _backend if _backend is not None else select_sweep_backend(device)
    run = _Sweep(
        train_step, make_batch, backend=backend, auto_backend=_backend is None and device is None,
        start=start, max_batch=max_batch, budget_s=budget_s, writer=None, say=say, warmup=warmup,
        steps=steps, min_time_s=min_time, max_steps=max_steps, knee_within=float(knee_within),
        clock=_clock or time.perf_counter_ns,
    )
    snapshot = _Snapshot(objs)
    cpu_rng = torch.get_rng_state()
    cuda_rng = (
        (backend.index, torch.cuda.get_rng_state(backend.index))
        if isinstance(backend, CudaSweepBackend) else None
    )
    writer = run.writer = JsonlWriter(log) if log is not None else None  # opened last: nothing can leak it
    muted = _Muted()
    push_active(muted)  # type: ignore[arg-type]
    try:
        return run.run()
    finally:
        pop_active(muted)  # type: ignore[arg-type]
        try:
            snapshot.restore()
        finally:
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng[1], cuda_rng[0])
            if writer is not None:
                writer.close()


class _Sweep:
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
        writer: JsonlWriter | None,
        say: Callable[[str], Any] | None,
        warmup: int,
        steps: int,
        min_time_s: float,
        max_steps: int,
        knee_within: float,
        clock: _Clock,
    ) -> None:
        self.train_step = train_step
        self.make_batch = make_batch
        self.b = backend
        self.auto_backend = auto_backend
        self.start = start
        self.max_batch = max_batch
        self.budget_ns = None if budget_s is None else int(budget_s * 1e9)
        self.writer = writer
        self.say = say
        self.warmup = warmup
        self.steps = steps
        self.min_time_ns = int(min_time_s * 1e9)
        self.max_steps = max_steps
        self.knee_within = knee_within
        self.clock = clock
        self.t0 = 0
        self.points: list[SweepPoint] = []
        self.fits: dict[int, SweepPoint] = {}
        self.ooms: dict[int, SweepPoint] = {}
        self.skipped: list[tuple[int, int]] = []  # (a measured batch, a size skipped above it)
        self.notes: list[str] = []
        self.unavailable: dict[str, str] = {}
        self.capacity: int | None = None
        self.stopped = ""
        self.probes = 0

    # -- device reads that degrade to None rather than fail the sweep ------------------

    def _read(self, fn: Callable[[], Any], what: str) -> Any:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - a missing figure, never a failed sweep
            self.unavailable.setdefault(what, f"reading it failed: {type(e).__name__}: {e}")
            return None

    def _over_budget(self) -> bool:
        return self.budget_ns is not None and self.clock() - self.t0 >= self.budget_ns

    # -- the search ------------------------------------------------------------------------

    def run(self) -> SweepResult:
        self.t0 = self.clock()
        self.capacity = self._read(self.b.capacity_bytes, "capacity_bytes")
        if self.say is not None:
            cap = "" if self.capacity is None else f", {format_bytes(self.capacity)} usable by torch's allocator"
            self.say(
                f"stepprof.sweep: on {self.b.device}{cap}; per batch size: make_batch once, {self.warmup} "
                f"warm-up step(s), then timed steps (at least {self.steps} and {self.min_time_ns / 1e9:g} s)"
            )
        self._grow()
        if not self.stopped:
            self._refine()
        self._backfill()
        result = self._result()
        if self.writer is not None:
            self.writer.write({"schema_version": SCHEMA_VERSION, **result.to_record()})
        if self.say is not None:
            self.say(f"stepprof.sweep: recommended batch {result.recommended}: {result.reason}")
        return result

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
        a, b = grown[-2], grown[-1]
        return self._sps(b) >= LINEAR * (b / a) * self._sps(a)

    def _plateau(self, grown: list[int]) -> bool:
        if len(grown) < 3:
            return False
        best_then = max(self._sps(m) for m in self.fits if m <= grown[-3])
        best_now = max(self._sps(m) for m in self.fits if m <= grown[-1])
        return best_now < (1 + PLATEAU_GAIN) * best_then

    def _boundary(self, capacity: int | None = None) -> float | None:
        """The largest batch the memory fit says fits in ``capacity`` bytes (default: the
        allocator's capacity), or None."""
        fit = _memory_fit(self.fits)
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
                p, phase = hi // 2, "down"
            else:
                if hi is not None and hi <= _cert_up(lo):
                    self.stopped = "boundary"
                    return
                if self.max_batch is not None and lo >= self.max_batch:
                    self.stopped = "max_batch"
                    return
                p, expect = self._choose(lo, hi, last_miss)
                phase = "refine"
            if self._over_budget():
                self.stopped = "time_budget"
                return
            if self.probes >= MAX_PROBES:
                self.stopped = "probe_limit"
                return
            self.probes += 1
            point = self._trial(p, phase)
            last_miss = expect is not None and point.oom != (expect == "oom")

    def _choose(self, lo: int, hi: int | None, last_miss: bool) -> tuple[int, str | None]:
        """The next probe and the outcome the memory fit expects ("fit", "oom" or None)."""
        up = _cert_up(lo)
        boundary = self._boundary()
        if boundary is not None and boundary <= lo:
            boundary = None  # a batch above the predicted boundary ran: the fit is off here
        g = None if boundary is None else AIM * boundary
        expect: str | None
        if hi is None:
            if g is None or last_miss:
                p, expect = 2 * lo, None
            elif g <= up:
                p, expect = up, "oom"
            else:
                p, expect = int(g), "fit"
        else:
            down = _cert_down(hi)
            # After an out-of-memory error, the bytes it held at once bound the limit from
            # below: if that bound says a batch past the certifying point fits, aim there.
            # The optimistic fit is not trusted again right after it was wrong; the bound is.
            if last_miss:
                g = None
            held = self._held_at_once()
            floor_guess = None if held is None else self._boundary(held)
            if floor_guess is not None and floor_guess > up:
                g = floor_guess
            if g is None:
                p, expect = round(math.sqrt(lo * hi)), None
            elif g >= down:
                p, expect = down, "fit"
            elif g <= up:
                p, expect = up, "oom"
            else:
                p, expect = int(g), "fit"
            p = min(max(p, lo + 1), hi - 1)
        if self.max_batch is not None and p > self.max_batch:
            p, expect = self.max_batch, None
        return p, expect

    def _backfill(self) -> None:
        """Measure sizes skipped by quadrupling that could still be the recommended batch."""
        for a, m in self.skipped:
            if m in self.fits or m in self.ooms or a not in self.fits:
                continue
            zone = find_thrash_zone(self.points)
            clean = [p for p in self.points if zone is None or p.batch_size not in zone]
            rec = find_knee(clean, self.knee_within)
            ran = _ran(clean)
            if rec is None or m >= rec or not ran:
                continue
            best = max(p.samples_per_s for p in ran)  # type: ignore[type-var]
            # The step time does not shrink as the batch grows, so samples/s at m is at
            # most m/a times that at a (plus noise).
            bound = (m / a) * self._sps(a) * (1 + DROP)
            if bound < (1 - self.knee_within) * best:
                continue
            if self._over_budget():
                self.notes.append(f"the time budget ran out before batch {m:,}, skipped while growing, was measured")
                return
            if self.probes >= MAX_PROBES:
                return
            self.probes += 1
            self._trial(m, "backfill")

    # -- one trial ---------------------------------------------------------------------------

    def _trial(self, n: int, phase: str) -> SweepPoint:
        point = self._measure(n, phase)
        if (
            self.auto_backend and isinstance(self.b, HostSweepBackend)
            and torch.cuda.is_available() and torch.cuda.is_initialized()
        ):
            # The step initialised CUDA: the host clock cannot time asynchronous GPU work.
            self.b = select_sweep_backend(None)
            self.capacity = self._read(self.b.capacity_bytes, "capacity_bytes")
            self.notes.append(
                f"CUDA was initialised by the first trial, so the sweep switched to {self.b.device} "
                f"and measured batch {n:,} again"
            )
            point = self._measure(n, phase)
        self.auto_backend = False
        self.points.append(point)
        (self.ooms if point.oom else self.fits)[n] = point
        if self.writer is not None:
            self.writer.write({"schema_version": SCHEMA_VERSION, **point.to_record()})
        if self.say is not None:
            tail = ""
            if point.oom:
                tail = (
                    "; memory back to the pre-trial baseline" if point.leaked_bytes == 0
                    else f"; {format_bytes(point.leaked_bytes)} still allocated after clean-up"
                    if point.leaked_bytes else ""
                )
            self.say(f"stepprof.sweep: [{point.trial:>2} {phase:<8}] {point}{tail} ({point.wall_s:.2f} s)")
        return point

    def _measure(self, n: int, phase: str) -> SweepPoint:
        b, clock = self.b, self.clock
        t_in = clock()
        unavailable: dict[str, str] = {}
        b.synchronize()
        # Each trial starts from a clean allocator, as a training run at this batch size would:
        # blocks cached by earlier, smaller trials fragment the pool and can make a batch run
        # out of memory that fits from a clean start (bench/sweep.py on the H200: batch 279 of
        # the transformer ran out after ten trials; 283 fits clean).  No gc.collect() here: the
        # previous trial's batch is already released (an OOM's clean-up collects), and a full
        # collection costs tens of ms with torch loaded.
        self._read(b.empty_cache, "empty_cache")
        base = self._read(b.allocated_bytes, "allocated_bytes")
        # A peak counter that was not reset holds an earlier trial's (or the user's) peak.
        peak_reason: str | None = None
        try:
            b.reset_peak()
        except Exception as e:  # noqa: BLE001 - a missing figure, never a failed sweep
            peak_reason = f"resetting the peak counter failed: {type(e).__name__}: {e}"
            self.unavailable.setdefault("peak_allocated_bytes", peak_reason)
        marks: list[Any] = []
        stamps: list[int] = []
        counters: list[tuple[int, int] | None] = []
        timed = 0
        batch: Any = None
        stage = "make_batch"
        failure: str | None = None
        try:
            batch = self.make_batch(n)
            stage = "check"
            _check_batch(batch, n)
            stage = "train_step"
            for _ in range(self.warmup):
                self.train_step(batch)
            counters.append(self._read(b.allocator_counters, "alloc_retries"))
            marks.append(b.mark())
            if marks[0] is None and isinstance(b, CudaSweepBackend):
                # No event: the fallback times the synchronised span from here, so the
                # warm-up's queued GPU work must be done before the span starts.
                b.synchronize()
            stamps.append(clock())
            while True:
                self.train_step(batch)
                marks.append(b.mark())
                stamps.append(clock())
                timed += 1
                if timed >= self.max_steps:
                    break
                if timed >= self.steps and stamps[-1] - stamps[0] >= self.min_time_ns:
                    break
                if self._over_budget():
                    unavailable["timed_steps"] = f"the time budget ran out after {timed} timed step(s)"
                    break
            counters.append(self._read(b.allocator_counters, "alloc_retries"))
            batch = None
            stage = "synchronize"
            b.synchronize()
        except Exception as e:
            if stage == "check" or not is_oom(e, smaller_batch_ran=any(m < n for m in self.fits)):
                if stage != "check":
                    where = f"make_batch({n}) raised" if stage == "make_batch" else f"{stage} raised at batch size {n}"
                    _annotate(e, f"stepprof.sweep: {where}; the sweep stopped (it catches only out-of-memory errors)")
                raise
            failure = _first_line(e)
        # Outside the except block: the exception, its traceback and the failed step's
        # frames (holding its activations) are gone once nothing refers to them.
        t_end = clock()
        mem = self._read(b.read_memory, "peak_allocated_bytes")
        peak = None if mem is None or peak_reason is not None else int(mem[0])
        if peak is None:
            unavailable["peak_allocated_bytes"] = peak_reason or self.b.memory_reason or "not read"
        trial = len(self.points) + 1
        if failure is not None:
            batch = None
            for m in marks:
                b.release(m)
            marks.clear()
            gc.collect()
            self._read(b.empty_cache, "empty_cache")
            after = self._read(b.allocated_bytes, "allocated_bytes")
            leaked = None if after is None or base is None else max(0, int(after) - int(base))
            if leaked is None:
                unavailable["leaked_bytes"] = self.b.memory_reason or "allocated bytes could not be read"
            elif leaked:
                self.notes.append(
                    f"after running out of memory at batch {n:,}, {format_bytes(leaked)} stayed allocated "
                    f"beyond the pre-trial baseline (something still refers to tensors from the failed "
                    f"step, or the step created state, such as optimizer moments, that stays)"
                )
            return SweepPoint(
                trial=trial, phase=phase, batch_size=n, oom=True, samples_per_s=None, step_ms=None,
                step_ms_p10=None, step_ms_p90=None, timed_steps=timed, warmup_steps=self.warmup,
                peak_allocated_bytes=peak, alloc_retries=None, device_allocs=None,
                leaked_bytes=leaked, error=failure, wall_s=(clock() - t_in) / 1e9,
                unavailable=unavailable,
            )
        spans: list[float] | None = None
        if marks and all(m is not None for m in marks):
            try:
                spans = [b.elapsed_ms(marks[i], marks[i + 1]) for i in range(timed)]
            except RuntimeError as e:
                unavailable["step_ms"] = f"reading CUDA events failed ({e}); the synchronised span was used"
        elif isinstance(b, CudaSweepBackend):
            unavailable["step_ms"] = "a CUDA event could not be recorded; the synchronised span was used"
        else:
            spans = [(stamps[i + 1] - stamps[i]) / 1e6 for i in range(timed)]
        for m in marks:
            b.release(m)
        if spans is None:  # CUDA without events: the average over the synchronised span
            step_ms: float | None = (t_end - stamps[0]) / 1e6 / timed
            p10 = p90 = None
        else:
            s = sorted(spans)
            step_ms, p10, p90 = quantile(s, 0.5), quantile(s, 0.1), quantile(s, 0.9)
        sps = n / (step_ms / 1e3) if step_ms is not None and step_ms > 0 else None
        if sps is None:
            unavailable["samples_per_s"] = "the timed steps took no measurable time"
        c0, c1 = counters if len(counters) == 2 else (None, None)
        retries = device_allocs = None
        if c0 is not None and c1 is not None:
            retries, device_allocs = c1[0] - c0[0], c1[1] - c0[1]
        else:
            reason = self.b.memory_reason or self.unavailable.get("alloc_retries", "not read")
            unavailable["alloc_retries"] = unavailable["device_allocs"] = reason
        return SweepPoint(
            trial=trial, phase=phase, batch_size=n, oom=False, samples_per_s=sps, step_ms=step_ms,
            step_ms_p10=p10, step_ms_p90=p90, timed_steps=timed, warmup_steps=self.warmup,
            peak_allocated_bytes=peak, alloc_retries=retries, device_allocs=device_allocs,
            leaked_bytes=None, error=None, wall_s=(clock() - t_in) / 1e9, unavailable=unavailable,
        )

    # -- the result ---------------------------------------------------------------------------

    def _result(self) -> SweepResult:
        points = tuple(sorted(self.points, key=lambda p: p.batch_size))
        zone = find_thrash_zone(points)
        knee = find_knee(points, self.knee_within)
        clean = [p for p in points if zone is None or p.batch_size not in zone]
        recommended = find_knee(clean, self.knee_within)
        max_fit = max(self.fits) if self.fits else None
        first_oom = min(self.ooms) if self.ooms else None
        fit = _memory_fit(self.fits)
        predicted = None
        unavailable = dict(self.unavailable)
        if fit is not None and self.capacity is not None:
            predicted = max(0, math.floor((self.capacity - fit[0]) / fit[1]))
        elif fit is None:
            unavailable["predicted_max"] = (
                self.b.memory_reason if self.b.memory_reason
                else "fewer than two batches ran with a peak that grew with the batch"
            )
        else:
            unavailable["predicted_max"] = "the allocator's capacity could not be read"
        notes = list(self.notes)
        if self.stopped == "plateau":
            notes.append(
                "growth stopped at a plateau and there are no memory figures to predict the boundary, "
                "so the largest batch that fits was not searched; pass max_batch to sweep further"
            )
        elif self.stopped in ("time_budget", "probe_limit") and max_fit is not None:
            notes.append(
                f"the search stopped ({self.stopped}) before max_fit was bracketed within 3%"
                + (f": the bracket is {max_fit:,} (ran) to {first_oom:,} (out of memory)" if first_oom else "")
            )
        return SweepResult(
            points=points, knee=knee, max_fit=max_fit, first_oom=first_oom, predicted_max=predicted,
            thrash_zone=zone, recommended=recommended,
            reason=self._reason(points, zone, recommended, max_fit),
            stopped=self.stopped, device=self.b.device, trials=len(points),
            wall_s=(self.clock() - self.t0) / 1e9, capacity_bytes=self.capacity,
            fit_base_bytes=None if fit is None else fit[0],
            fit_bytes_per_sample=None if fit is None else fit[1],
            knee_within=self.knee_within, notes=tuple(notes), unavailable=unavailable,
        )

    def _reason(self, points: tuple[SweepPoint, ...], zone: range | None, rec: int | None,
                max_fit: int | None) -> str:
        ran = _ran(points)
        if not ran:
            if self.stopped == "time_budget":
                return "The time budget ran out before any batch size finished a trial."
            return f"No batch ran: even batch {min(self.ooms):,} ran out of memory." if self.ooms else "No batch ran."
        zone_text = ""
        if zone is not None:
            retried = [p.batch_size for p in ran if p.alloc_retries and p.batch_size in zone]
            why = "the allocator retried (cudaFree and cudaMalloc) every step" if retried else "samples/s fell"
            zone_text = f" Batches from {zone.start:,} up are in the thrash zone: {why}."
        if rec is None:
            return (
                f"Every batch that ran is in the thrash zone, so none is recommended; try smaller "
                f"batches or PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.{zone_text}"
            )
        clean = [p for p in ran if zone is None or p.batch_size not in zone]
        best = max(clean, key=lambda p: p.samples_per_s)  # type: ignore[arg-type,return-value]
        r = next(p for p in ran if p.batch_size == rec)
        pct = f"{self.knee_within:.0%}"
        if rec == best.batch_size:
            text = f"Batch {rec:,} gave the most samples/s ({r.samples_per_s:,.0f})"
            if rec == max_fit and len(ran) > 1:
                text += ", and samples/s was still rising at the largest batch that ran"
                if self.stopped == "max_batch":
                    text += f" (max_batch={self.max_batch:,}), so a larger batch may be faster"
                elif self.stopped == "boundary":
                    text += ", the largest that fits in memory"
            text += "."
        else:
            text = (
                f"Batch {rec:,} gives {r.samples_per_s:,.0f} samples/s, within {pct} of the best "
                f"({best.samples_per_s:,.0f} at batch {best.batch_size:,})"
            )
            if r.peak_allocated_bytes is not None and best.peak_allocated_bytes:
                text += (
                    f", at {format_bytes(r.peak_allocated_bytes)} peak memory against "
                    f"{format_bytes(best.peak_allocated_bytes)}"
                )
            text += "."
        if max_fit is not None and self.stopped == "boundary":
            text += f" The largest batch that fits is {max_fit:,}."
        return text + zone_text
