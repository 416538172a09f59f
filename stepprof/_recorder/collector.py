"""The collector: turns completed steps into records, off the training thread.

Steps wait in ``pending`` (oldest first) until their end event, and each of their
phases' end events, has completed; events are only *queried*, never waited on, except
once at close.  A harvest builds the records of every completed step, hands each to the
hooks and the sinks (the log and the summary), and writes them to the log together, in
one system call.  The hooks' own records (flops, memory, ranks) reach both sinks through
:meth:`Collector.write`.

A record with a field known only later (energy: the sample after the step, up to
``energy_every_s`` away) waits built and encoded, in ``held`` (:mod:`.held` says why).

The collector thread harvests every ``collect_every_s``; with ``collect_every_s=None``
(tests, ``bench/inloop_costs.py``) the training thread harvests at each step's exit.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from .._errors import raised_by_user, warn
from .._log import CHUNK_RECORDS, encode_line
from .._signals import Deferring, start_thread
from .._device.backend import ALLOCATOR_COUNTERS, Backend
from .. import _native
from .._schema import ABSENT, SCHEMA_VERSION, STEP_CORE_FIELDS, step_record
from .._rules import span_ms
from .._units import per_s
from .budget import Budget
from .held import HeldRecords
from .hooks import Hook
from .sinks import LogSink, SummarySink, Write
from .step import PhaseTotals, Step

#: How often the collector thread looks for completed steps to write.  A harvest has a fixed
#: cost of its own (about 220 µs inside the launch-bound loop on the H200: the thread's wake-up,
#: its caches gone cold since the last harvest, the log's write), so fewer, larger harvests cost
#: less a record: 29 µs a step record at 100 ms (39 records a harvest) against 51 at 20 ms
#: (8 a harvest), bench/cost_split.py.
COLLECT_EVERY_S = 0.1
#: The most steps the collector thread writes before it lets go of its lock (it also
#: stops early when a training thread asks for the lock: :meth:`Collector.take_over`).
HARVEST_CHUNK = 256
#: Steps waiting past which the training thread writes those that have completed (it needs
#: no collector thread, which a tight loop keeps from the GIL), and then again each time this
#: many more wait: steps whose events are still running are tried once per this many steps,
#: never at every step (records waiting for their energy sample wait encoded, in ``held``).
#: Steps written young die young: a step is a dozen or more objects that the interpreter's
#: cyclic GC tracks, and one that outlives two young collections joins the oldest generation,
#: whose growth triggers full collections (45 ms each with torch loaded on the 2-core CPU:
#: 4.1 µs a step of a near-empty 3-phase loop at 2048 waiting, 0.3 at 256).
HARVEST_AT = 256
#: While ``overhead_budget`` waits for its first choice: the steps that may wait before the
#: training thread harvests them itself (query only), so that the choice comes a few steps
#: after the first full ones complete.
EARLY_AT = 2
#: The most steps one call of the C harvest takes (between calls the harvest looks at ``until``).
FAST_STEPS = 32
#: How the C harvest encodes a record, as ``LogSink.encode`` does (``encode_line``: one orjson refuses).
_ENCODE = (orjson.dumps, orjson.OPT_APPEND_NEWLINE, encode_line)

_NO_EVENT = "no CUDA event was recorded at a boundary: the stream was capturing a CUDA graph"
_INTERRUPTED = "an exception interrupted stepprof's boundary before its CUDA event was recorded"
#: Why a step has no peak when another thread's step overlapped it.
OVERLAP_REASON = (
    "another thread's step overlapped this one: the allocator's peak counter and counters "
    "are one per device, so this step's own cannot be told apart"
)


class Flag:
    """A flag threads share without a lock, which the training thread sets and clears.

    Not a ``threading.Event``: its ``set()`` takes a lock in Python code, and an exception from
    a signal handler (a watchdog's ``TimeoutError``) can land between that lock's acquire and
    the ``with`` that releases it, which leaves it held, and the next ``set()`` waits forever
    (tests/test_watchdog.py's random alarms once hung the suite there).
    """

    __slots__ = ("_on",)

    def __init__(self) -> None:
        self._on = False

    def set(self) -> None:
        self._on = True

    def clear(self) -> None:
        self._on = False

    def is_set(self) -> bool:
        return self._on


_NO_PREVIOUS = "no previous step on this thread returned from its exit (the first step, or one cut short)"
# Reasons of a step record's null figures (the C build writes them too: _BUILD_REASONS).
NO_BATCH_SIZE = "no batch_size was given"
NO_TIME = "step took no measurable time"
PAST_RANGE = "batch_size over the step time is past a float's range"
ZERO_WALL = "wall time was zero"
NOT_COUNTED = "not counted"
NOT_READ = "not read"


def _data_figures(s: Step, unavailable: dict[str, str]) -> tuple[float | None, Any, Any]:
    """(``data_wait_ms``, ``data_ms``, ``data_wait_in_step_ms``), the last two ABSENT when
    nothing measured them; the reason when ``data_wait_ms`` is null.  ``data_wait_ms`` is the
    wait before the step plus the waits inside it between micro-batches."""
    inside = s.wait_in_ns / 1e6 if s.wait_in_ns >= 0 else None
    wait = s.data_wait_ns / 1e6 if s.data_wait_ns >= 0 else None
    if wait is None:
        unavailable["data_wait_ms"] = _NO_PREVIOUS
    elif inside is not None:
        wait += inside
    return wait, s.data_ns / 1e6 if s.data_ns >= 0 else ABSENT, ABSENT if inside is None else inside


def _samples_per_s(s: Step, span_ms: float, unavailable: dict[str, str]) -> float | None:
    """The step's ``batch_size`` over ``span_ms``, or None with the reason (and ``batch_size``'s,
    when it was not inferred)."""
    if s.batch_size is None:
        unavailable["samples_per_s"] = s.batch_reason or NO_BATCH_SIZE
        if s.batch_reason is not None:
            unavailable["batch_size"] = s.batch_reason
        return None
    rate, why = _rate(s.batch_size, span_ms, PAST_RANGE)
    if why is not None:
        unavailable["samples_per_s"] = why
    return rate


def _rate(n: int, span_ms: float, past_range: str) -> tuple[float | None, str | None]:
    """``n`` a second over ``span_ms``, or (None, why): no measurable time, or ``past_range``."""
    if span_ms <= 0:
        return None, NO_TIME
    rate = per_s(n, span_ms)
    return rate, None if rate is not None else past_range


def _token_figures(s: Step, span_ms: float, record: dict[str, Any]) -> None:
    """``tokens`` and ``tokens_per_s`` on the record of a step whose tokens were given or
    counted (the C builds leave such a step to Python), null with the reason where not known."""
    tokens = s.tokens
    n, why = (tokens, None) if isinstance(tokens, int) else tokens.value()  # type: ignore[union-attr]
    rate = None
    if n is None:
        why = why or NOT_COUNTED
    else:
        rate, why = _rate(n, span_ms, "tokens over the step time is past a float's range")
    record["tokens"], record["tokens_per_s"] = n, rate
    if why is not None:
        unavailable = record["unavailable"]
        unavailable["tokens_per_s"] = why
        if n is None:
            unavailable["tokens"] = why


def build_step_record(
    s: Step, b: Backend, *, start_unix_s: float, phase_peaks_why: str, not_sampled: str | None = None,
    host: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """The ``kind: "step"`` record of a completed step (its marks' events have completed).

    Built by :func:`stepprof._schema.step_record`; the hooks add their fields after
    (``FlopsHook``: ``flops``, ``tflops_per_s``, ``mfu``, ``flops_counted``).

    Args:
        s: the step.
        b: the backend it was measured on.
        start_unix_s: when it started, in seconds since the epoch.
        phase_peaks_why: why its phases have no peak when they were not read on it.
        not_sampled: for a light step (``overhead_budget``), why it has no GPU figures.
        host: ``host_reasons(b)`` on the host, for the C build of its records.
    """
    if not_sampled is not None:
        return _light_record(s, b, start_unix_s, not_sampled)
    if b.has_device_timing:
        fast = _NATIVE.build
        if fast is not None and b.has_device_memory and b.gpu_reason is None and b.memory_reason is None:
            record = fast(s, b.device, start_unix_s, phase_peaks_why)
            if record is not NotImplemented:
                return record  # type: ignore[no-any-return]
    elif host is not None and _NATIVE.build_host is not None and not b.has_device_memory:
        record = _NATIVE.build_host(s, b.device, start_unix_s, host)
        if record is not NotImplemented:
            return record  # type: ignore[no-any-return]
    return _build_python(s, b, start_unix_s, phase_peaks_why)


def host_reasons(b: Backend) -> tuple[str, ...] | None:
    """The reasons a host backend's steps give for the figures they never have, as
    ``_fold.c``'s ``build_host_step`` takes them (gpu_ms and its phases', peak_allocated_bytes
    and its phases', reserved_bytes, allocator, host_rss_bytes when it is missing); None where
    the backend lacks a reason (its records are built in Python)."""
    if b.has_device_timing or b.has_device_memory or not b.gpu_reason or not b.memory_reason:
        return None
    return (b.gpu_reason, b.memory_reason, _reserved_reason(b), _host_allocator(b), NO_RSS)


def _build_python(s: Step, b: Backend, start_unix_s: float, phase_peaks_why: str) -> dict[str, Any]:
    """:func:`build_step_record` of a full step in Python (``_fold.c``'s ``build_step`` mirrors it
    for the steps of a CUDA backend, and leaves it the others)."""
    unavailable: dict[str, str] = {}
    wall_ms = (s.t1 - s.t0) / 1e6
    gpu_ms = s.gpu_ms()
    if gpu_ms is None:
        unavailable["gpu_ms"] = unavailable["gpu_busy"] = b.gpu_reason or (
            _INTERRUPTED if s.error is not None and (s.start_mark is None or s.end_mark is None) else _NO_EVENT
        )
    phases = _phase_figures(s, b, phase_peaks_why, unavailable) if s.phases else {}
    peak = _memory_figures(s, b, phases, unavailable)
    gpu_busy = gpu_ms / wall_ms if gpu_ms is not None and wall_ms > 0 else None
    if gpu_busy is None and gpu_ms is not None:
        unavailable["gpu_busy"] = ZERO_WALL
    samples_per_s = _samples_per_s(s, span_ms(wall_ms, gpu_ms), unavailable)
    if s.syncs is None:
        unavailable["syncs"] = s.syncs_reason or NOT_COUNTED
        if phases:
            unavailable["phases.syncs"] = unavailable["syncs"]
    on_host = not b.has_device_memory  # the host's RSS stands in for device memory
    data_wait_ms, data_ms, wait_in_ms = _data_figures(s, unavailable)
    peak_phase = _peak_phase(s, phases, unavailable) if phases else ABSENT
    # By position, in the declared order (_schema.STEP_CORE_FIELDS): a keyword call costs a µs more.
    record = step_record(
        s.index, s.name, s.warmup, b.device, start_unix_s, wall_ms, gpu_ms, gpu_busy, peak, s.reserved,
        s.batch_size, samples_per_s, data_wait_ms, phases, s.overhead_ns / 1e3, s.error, s.syncs,
        dict(zip(ALLOCATOR_COUNTERS, s.counters)) if s.counters else None, unavailable,
    )
    if on_host:
        record["host_rss_bytes"] = s.rss
    if s.thread is not None:
        record["thread"] = s.thread
    if s.sampled is not None:
        record["sampled"] = True
    if data_ms is not ABSENT:
        record["data_ms"] = data_ms
    if wait_in_ms is not ABSENT:
        record["data_wait_in_step_ms"] = wait_in_ms
    if peak_phase is not ABSENT:
        record["peak_phase"] = peak_phase
    if s.global_step is not None:
        record["global_step"] = s.global_step
    if s.tokens is not None:
        _token_figures(s, span_ms(wall_ms, gpu_ms), record)
    return record


class _Native:
    """``_fold.c``'s ``build_step`` and ``build_host_step`` while it is loaded and agrees with
    the declaration, else None."""

    build: Callable[[Step, str, float, str], Any] | None = None
    build_host: Callable[[Step, str, float, tuple[str, ...]], Any] | None = None
    harvest: Callable[[tuple[Any, ...], deque[Step], int, list[Any] | None], tuple[int, int]] | None = None


_NATIVE = _Native()


def use_native(on: bool = True) -> str | None:
    """Build full CUDA steps' records in C from now on, if ``_fold.c`` is built and fills the
    declared fields (``on=False``: in Python); returns why not, or None."""
    mod = _native.module() if on else None
    why = _native.reason() if on else None
    if mod is not None and mod.BUILD_FIELDS != ("schema_version", "kind", *STEP_CORE_FIELDS):
        mod, why = None, "the C build fills other fields than the step record declares: rebuild it (`stepprof build`)"
    if mod is not None:
        mod.configure_build(Step, PhaseTotals, mod.BUILD_FIELDS, _BUILD_OPTIONAL, _BUILD_PHASE_KEYS, _BUILD_REASONS,
                            ALLOCATOR_COUNTERS, SCHEMA_VERSION)
    _NATIVE.build = mod.build_step if mod is not None else None
    _NATIVE.build_host = getattr(mod, "build_host_step", None) if mod is not None else None
    _NATIVE.harvest = getattr(mod, "harvest_steps", None) if mod is not None else None
    return why


def _phase_figures(s: Step, b: Backend, phase_peaks_why: str, unavailable: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Each phase's figures (``phases`` of the step record), with the reasons for those null."""
    phases: dict[str, dict[str, Any]] = {}
    timed = b.has_device_timing  # (the host's marks are None: no phase has GPU time)
    counted = s.syncs is not None
    t0 = s.t0
    no_gpu = no_peak = False
    times = s.times or ()  # (read by gpu_ms() above)
    at = 1  # each phase's runs, in times' order (Step.flat_marks)
    for key, total in s.phases.items():
        pg: float | None = None
        n = len(total.marks)
        if timed and len(times) >= at + n:
            pg = 0.0
            for ms in times[at:at + n]:
                if ms is None:
                    pg = None
                    break
                pg += ms
        at += n
        peak = total.peak
        phases[key] = {
            "wall_ms": total.wall_ns / 1e6,
            "gpu_ms": pg,
            "peak_allocated_bytes": peak if peak >= 0 else None,
            "count": total.count,
            "syncs": total.syncs if counted else None,
            "start_ms": (total.t0 - t0) / 1e6,
        }
        if pg is None:
            no_gpu = True
        if peak < 0:
            no_peak = True
    if no_gpu:
        unavailable["phases.gpu_ms"] = b.gpu_reason or _NO_EVENT
    if no_peak:
        unavailable["phases.peak_allocated_bytes"] = b.memory_reason or (
            phase_peaks_why if not s.phase_peaks else NOT_READ
        )
    return phases


def _memory_figures(s: Step, b: Backend, phases: dict[str, dict[str, Any]], unavailable: dict[str, str]) -> int | None:
    """The step's peak (None: not known), with the reasons for its memory figures that are null."""
    if s.shared and b.has_device_memory:  # another thread's step overlapped it
        s.peak = -1
        s.counters = None
        for key, figures in phases.items():
            figures["peak_allocated_bytes"] = None
            unavailable["phases.peak_allocated_bytes"] = OVERLAP_REASON
        unavailable["peak_allocated_bytes"] = unavailable["allocator"] = OVERLAP_REASON
    peak = s.peak if s.peak >= 0 else None
    if peak is None and "peak_allocated_bytes" not in unavailable:
        unavailable["peak_allocated_bytes"] = b.memory_reason or NOT_READ
    if s.reserved is None:
        unavailable["reserved_bytes"] = _reserved_reason(b)
    on_host = not b.has_device_memory  # the host's RSS stands in for device memory
    if s.counters is None and "allocator" not in unavailable:
        if on_host:
            unavailable["allocator"] = _host_allocator(b)
        else:
            unavailable["allocator"] = (
                "this torch's allocator stats lack the counters" if s.peak >= 0 else NOT_READ
            )
    if on_host and s.rss is None:
        unavailable["host_rss_bytes"] = NO_RSS
    return peak


#: Why a host step has no ``host_rss_bytes``.
NO_RSS = "psutil could not read this process's RSS"


def _reserved_reason(b: Backend) -> str:
    return getattr(b, "reserved_reason", None) or b.memory_reason or NOT_READ


def _host_allocator(b: Backend) -> str:
    """Why a host step has no ``allocator`` counters."""
    return f"{b.gpu_reason or b.memory_reason}: the counters are CUDA's caching allocator's"


#: Why a step's ``peak_phase`` is null when its phases' peaks were read and none reached it.
OUTSIDE_PHASES = ("the step's peak was reached outside its phases: after the last one, before "
                  "the step's exit")

#: The step record's optional keys and a phase's keys, in the order ``_fold.c``'s builds write them.
_BUILD_OPTIONAL = ("thread", "sampled", "data_ms", "data_wait_in_step_ms", "peak_phase", "global_step", "host_rss_bytes")
_BUILD_PHASE_KEYS = ("wall_ms", "gpu_ms", "peak_allocated_bytes", "count", "syncs", "start_ms")

#: The reasons' texts that ``_fold.c``'s ``build_step`` writes, by its names for them.
_BUILD_REASONS = {
    "no_previous": _NO_PREVIOUS, "outside_phases": OUTSIDE_PHASES, "no_batch": NO_BATCH_SIZE,
    "no_time": NO_TIME, "past_range": PAST_RANGE, "zero_wall": ZERO_WALL, "not_counted": NOT_COUNTED,
    "not_read": NOT_READ,
}


def _peak_phase(s: Step, phases: dict[str, dict[str, Any]], unavailable: dict[str, str]) -> str | None:
    """The innermost phase whose peak is the step's (the first in ``phases``' order among
    equals), or None with the reason: the phases' peaks were not read, or none reached it."""
    peak = s.peak
    if peak < 0:
        unavailable["peak_phase"] = unavailable.get("peak_allocated_bytes", NOT_READ)
        return None
    if "phases.peak_allocated_bytes" in unavailable:
        unavailable["peak_phase"] = unavailable["phases.peak_allocated_bytes"]
        return None
    best, depth = None, -1
    for key, figures in phases.items():
        if figures["peak_allocated_bytes"] == peak and key.count("/") > depth:
            best, depth = key, key.count("/")
    if best is None:
        unavailable["peak_phase"] = OUTSIDE_PHASES
    return best


def _light_record(s: Step, b: Backend, start_unix_s: float, why: str) -> dict[str, Any]:
    """The record of a light step: its wall time, syncs and error; the device figures null."""
    wall_ms = (s.t1 - s.t0) / 1e6
    unavailable = dict.fromkeys(
        ("gpu_ms", "gpu_busy", "peak_allocated_bytes", "reserved_bytes", "phases", "allocator"), why
    )
    samples_per_s = _samples_per_s(s, wall_ms, unavailable)
    if s.syncs is None:
        unavailable["syncs"] = s.syncs_reason or NOT_COUNTED
    on_host = not b.has_device_memory
    if on_host:
        unavailable["host_rss_bytes"] = why
    data_wait_ms, data_ms, wait_in_ms = _data_figures(s, unavailable)
    record = step_record(
        step=s.index, name=s.name, warmup=s.warmup, device=b.device, start_unix_s=start_unix_s,
        wall_ms=wall_ms, data_wait_ms=data_wait_ms, data_ms=data_ms,
        data_wait_in_step_ms=wait_in_ms, global_step=s.global_step if s.global_step is not None else ABSENT,
        gpu_ms=None, gpu_busy=None,
        peak_allocated_bytes=None, reserved_bytes=None,
        batch_size=s.batch_size, samples_per_s=samples_per_s, phases={}, overhead_us=s.overhead_ns / 1e3,
        error=s.error, syncs=s.syncs, allocator=None, unavailable=unavailable,
        host_rss_bytes=None if on_host else ABSENT,
        thread=s.thread if s.thread is not None else ABSENT,
        sampled=False,
    )
    if s.tokens is not None:
        _token_figures(s, wall_ms, record)
    return record


def phase_peaks_reason(phase_peaks_every: int) -> str:
    """Why a step's phases have no peak when they were not read on it (built once, not per record)."""
    n = phase_peaks_every
    if n == 0:
        return "phase peaks are off (phase_peaks_every=0); the step's peak is exact"
    return (
        f"not read on this step: while the step's peak holds steady, phase peaks are read "
        f"on one step in {n} (phase_peaks_every={n}; phase_peaks_every=1 reads them on every "
        f"step). The step's peak_allocated_bytes is exact"
    )


class Collector:
    """Pending steps, the thread that harvests them, and the harvest (its :class:`Builder`
    builds each step's record).

    Args:
        log: where records are written.
        summary: where records are aggregated for the summary.
        clock0_ns, unix0_s: one reading of the step clock and the time since the epoch
            taken together, to date the steps.
        cost_clock: times the collector's own work, for ``overhead_us`` (the calling
            thread's CPU time).
        overhead_budget: the profiler's setting (None: every step in full).
        phase_peaks_every: the profiler's setting (for the reason a phase has no peak).
        collect_every_s: how often the thread harvests; None: the training thread
            harvests at each step's exit instead.
        flush_every_ns: the most the log may lag behind a step's exit (see :meth:`catch_up`).

    The hooks come later, with :meth:`use`.
    """

    def __init__(
        self,
        log: LogSink,
        summary: SummarySink,
        *,
        clock0_ns: int,
        unix0_s: float,
        phase_peaks_every: int,
        collect_every_s: float | None,
        cost_clock: Callable[[], int] = time.thread_time_ns,
        overhead_budget: float | None = None,
        flush_every_ns: int | None = None,
    ) -> None:
        self.pending: deque[Step] = deque()
        #: Built records waiting for a late field (energy), oldest first.
        self.held = HeldRecords(log, summary)
        self._flush_every_ns = flush_every_ns
        #: Before this step-clock reading the training thread does not check the log's lag.
        self.catch_up_at = 0 if flush_every_ns is not None else 2**63
        #: Past this many steps waiting, the training thread writes those that completed.
        self._warned: set[str] = set()
        #: Under ``overhead_budget``: which steps are measured in full (None: all of them).
        self.budget = Budget(overhead_budget) if overhead_budget is not None else None
        self.harvest_at = self._wait_limit()
        self.log = log
        self.summary = summary
        self.every_s = collect_every_s
        self.error: str | None = None  # why the thread stopped writing records
        self.lock = threading.Lock()  # one harvest at a time
        #: The last harvest's time per record written (building, the hooks, writing, the
        #: summary): each record of the next harvest adds it to its ``overhead_us``.
        self.ns_per_record = 0.0
        #: What a harvest does with a completed step: its record, the hooks, the C harvest's plan.
        self.builder = Builder(self.held, self.budget, clock0_ns=clock0_ns, unix0_s=unix0_s,
                               phase_peaks_every=phase_peaks_every, cost_clock=cost_clock)
        self.thread: threading.Thread | None = None  # started at the first step's exit
        self._stop = threading.Event()
        self._wanted = Flag()  # a training thread waits for the lock

    def use(self, hooks: Sequence[Hook]) -> None:
        """Call these hooks, in this order, from now on (each only for what it overrides)."""
        self.builder.use(hooks)

    # -- the thread ---------------------------------------------------------------

    def start(self) -> None:
        """Start the collector thread (once, at the first step's exit)."""
        self.thread = threading.Thread(target=self._loop, name="stepprof-collector", daemon=True)
        start_thread(self.thread)

    def _loop(self) -> None:
        """The collector thread: every ``every_s``, write completed steps."""
        assert self.every_s is not None
        while not self._stop.wait(self.every_s):
            more = True
            while more and not self._stop.is_set():  # in chunks: the lock is let go between them
                with self.lock:
                    try:
                        more = self.harvest(HARVEST_CHUNK, self._wanted)
                    except Exception as e:  # noqa: BLE001 - reported from the training thread
                        if raised_by_user(e):
                            raise
                        self.error = (
                            f"stepprof stopped writing records after an internal error: "
                            f"{type(e).__name__}: {e}"
                        )
                        return

    def stop(self) -> None:
        """Stop the thread and wait for it (unless it is the caller).

        A thread whose ``start()`` an interrupt cut short may never have started: it is
        not waited for (one that starts late sees the stop and ends at once).
        """
        self._stop.set()
        thread = self.thread
        if thread is not None and thread is not threading.current_thread() and thread.is_alive():
            thread.join()

    def forget(self) -> None:
        """After a fork: the pending steps and the thread are the parent's."""
        self.pending = deque()
        self.held.clear()
        self.thread = None
        self._stop = threading.Event()
        self.lock = threading.Lock()
        self.use(())

    # -- the training thread's part ------------------------------------------------

    def catch_up(self, now: int) -> bool:
        """At a step's exit: keep the log within ``flush_every_s`` of the training thread,
        and the steps waiting young (:data:`HARVEST_AT`).

        The collector thread writes every 100 ms, but it needs the GIL and a CPU, which a
        busy training thread or other processes may hold for long stretches.  When the
        oldest step still waiting left its exit more than ``flush_every_s`` ago, or more
        than :attr:`harvest_at` steps wait, the training thread writes the completed steps
        itself (query only, never a wait on the device), taking over from the collector
        thread (:meth:`take_over`).  The age is checked at most four times per
        ``flush_every_s``.  Returns whether it wrote.
        """
        every = self._flush_every_ns
        pending = self.pending
        if every is not None and now >= self.catch_up_at:
            self.catch_up_at = now + every // 4
        try:  # (the collector thread may take the last one between a test and a read: no lock here)
            oldest = pending[0].t1 if every is not None else now
        except IndexError:
            oldest = now
        overdue = now - oldest > every if every is not None else False
        if not overdue and len(pending) <= self.harvest_at:
            return False
        self.take_over()  # its time goes to the records it writes (and sets harvest_at)
        return True

    def _wait_limit(self) -> int:
        """How many more steps may wait before the training thread harvests: :data:`HARVEST_AT`,
        or :data:`EARLY_AT` while ``overhead_budget`` has not made its first choice (every step is
        full until then: the collector thread's 100 ms would be dozens of them)."""
        budget = self.budget
        return EARLY_AT if budget is not None and not budget.chosen else HARVEST_AT

    def warn_async(self) -> None:
        """Warn, from the training thread, about what went wrong on the collector thread."""
        for why in (self.error, self.log.failed):
            if why is not None and why not in self._warned:
                self._warned.add(why)
                warn(f"stepprof: {why}; logging stopped", stacklevel=4)

    # -- harvesting ---------------------------------------------------------------

    def write(self, record: dict[str, Any]) -> None:
        """Hand a record to the sinks: the log and the summary (the hooks' records go here)."""
        self.log.write(record)
        self.summary.add(record)

    def drain(self) -> None:
        """Write every completed step now, from the calling thread (never waits on the device)."""
        with Deferring(self.lock), self.lock:
            self.harvest()

    def take_over(self) -> None:
        """Write the completed steps from the calling thread now, whoever was writing.

        The collector thread, mid-harvest, stops at its next record and lets go of the
        lock, so the wait is one record's work, however starved that thread is of CPU.
        """
        self._wanted.set()
        with Deferring(self.lock), self.lock:
            self._wanted.clear()
            self.harvest()

    def harvest_if_free(self) -> None:
        """Harvest now unless a harvest is under way (then it is as good as done).

        The lock is taken by a ``with`` only (:meth:`take_over`): a signal handler that
        raises just after ``acquire(blocking=False)`` returned would leave it held for good,
        and the next harvest would wait forever.  A harvest that starts between the test
        and the ``with`` is waited for, one record's work (``take_over``'s flag).
        """
        if not self.lock.locked():
            self.take_over()

    def finish(self) -> None:
        """At close: wait for the pending steps' own events, then write them all."""
        if not self.pending and not self.held:
            return
        # Steps that finished before any internal error are still written.  Wait on their
        # own events, not the whole device: a collective that another rank never joins (an
        # exchange, or the user's own) would hold a device-wide synchronize forever, and
        # sync-debug mode "error" would refuse it.
        waits: dict[int, tuple[Backend, list[Any]]] = {}
        for s in list(self.pending):  # other threads may still be appending
            marks = waits.setdefault(id(s.backend), (s.backend, []))[1]
            marks.append(s.end_mark)
            for total in s.phases.values():
                marks.extend(end for _, end in total.marks)
        for b, marks in waits.values():
            b.wait(marks)
        if self.held.late is not None:
            self.held.late.on_finish()
        self.harvest()
        self.held.write(True)

    def harvest(self, max_steps: int | None = None, until: Flag | None = None) -> bool:
        """Write the pending steps, oldest first, whose events have all completed.

        At most ``max_steps`` of them; None: at most those pending when it began, so that a
        harvest ends while other threads keep stepping.  It also stops once ``until`` is
        set.  Returns whether it stopped early (more may be ready).  The records are written together at the end,
        in one system call.  The harvest's own time is stepprof's too: each record's
        ``overhead_us`` includes the collector's time per record, as the previous harvest
        measured it (:attr:`ns_per_record`).
        """
        builder = self.builder
        for hook in builder.harvest_hooks:
            hook.on_harvest(self.write)
        if self.held and self.held.write(False, until):
            return True
        pending = self.pending
        if not pending:
            self.harvest_at = self._wait_limit()
            return False
        limit = len(pending) if max_steps is None else max_steps
        clock = builder.cost_clock
        t0 = clock()
        share_us = self.ns_per_record / 1e3
        written = 0
        budget, log = self.budget, self.log
        log_write, add_step = log.write, self.summary.add_step
        plan, covered = builder.plan(pending, log, self.summary, share_us)
        log.begin_batch()
        try:
            while pending:
                if written == limit or (until is not None and until.is_set()):
                    return max_steps is not None or until is not None
                if covered > 0:  # the steps the plan covers, in C, a few at a time (to see `until`)
                    n = min(limit - written, covered, FAST_STEPS, CHUNK_RECORDS - written % CHUNK_RECORDS)
                    done, logged = _NATIVE.harvest(plan, pending, n, log.batch)  # type: ignore[misc, arg-type]
                    log.count += logged
                    written += done
                    covered -= done
                    if not written % CHUNK_RECORDS:
                        log.end_batch()
                        log.begin_batch()
                    if done == n or not pending:
                        continue
                s = pending[0]  # (one the C harvest left: not done yet, or not its kind)
                if not s.read():  # its end events, or a phase's on another stream, still running
                    return False
                pending.popleft()
                covered -= 1
                record, token = builder.build(s)
                record["overhead_us"] += share_us
                if budget is not None and not s.warmup and s.error is None:
                    budget.add(s.sampled != 0, record["overhead_us"], record["wall_ms"])
                if token is not None and not self.held:  # its late fields may be known already
                    filled = self.held.late.fill(token, False)  # type: ignore[union-attr]
                    if filled is not None:
                        record.update(filled[0])
                        record["unavailable"].update(filled[1])
                        token = None
                if token is None and not self.held:
                    log_write(record)
                    add_step(record)
                    if builder.after_hooks:
                        builder.after(s, self.write)
                else:
                    self.held.hold(s, record, token, builder.after if builder.after_hooks else None)
                written += 1
                if not written % CHUNK_RECORDS:  # a long harvest's lines go out as it goes
                    log.end_batch()
                    log.begin_batch()
                if plan is not None and plan[-1] is not None and s.index >= plan[-1]:
                    # (past the step a memory record was due at)
                    plan, covered = builder.plan(pending, log, self.summary, share_us)
            return False
        finally:
            self.harvest_at = len(pending) + self._wait_limit()  # (see catch_up)
            log.end_batch()
            if written:  # (less the work a hook states in its own record: explain_peak's replay)
                self.ns_per_record = max(0, clock() - t0 - builder.take_apart_ns()) / written
                if budget is not None:
                    budget.choose()


class Builder:
    """What a harvest does with a completed step: builds its record (dated, with its reasons),
    hands it to the hooks, releases its marks; and plans the C harvest of the common steps."""

    def __init__(self, held: HeldRecords, budget: Budget | None, *, clock0_ns: int, unix0_s: float,
                 phase_peaks_every: int, cost_clock: Callable[[], int]) -> None:
        self.held = held
        self.budget = budget
        #: Times the collector's own work (see :class:`Collector`'s ``cost_clock``).
        self.cost_clock = cost_clock
        self._apart_ns = 0  # the stating hooks' time since the last take_apart_ns()
        self._clock0 = clock0_ns
        self._unix0 = unix0_s
        self._phase_peaks_why = phase_peaks_reason(phase_peaks_every)
        self._not_sampled_why: tuple[int, str] | None = None
        self._host: tuple[Any, tuple[str, ...] | None] = (None, None)  # a backend and its host_reasons
        self.use(())

    def use(self, hooks: Sequence[Hook]) -> None:
        """Call these hooks, in this order, from now on (each only for what it overrides)."""
        # A hook that keeps each step's end mark (the exchange, for the gap to the next
        # step) releases it itself.
        self._keep_end_marks = any(h.keeps_end_marks for h in hooks)
        self.harvest_hooks = tuple(h for h in hooks if type(h).on_harvest is not Hook.on_harvest)
        self._record_hooks = tuple(h for h in hooks if type(h).on_record is not Hook.on_record)
        late = [h for h in hooks if type(h).late is not Hook.late]
        if len(late) > 1:
            raise ValueError(f"at most one hook may have late fields, not {late!r}")
        self.held.late = late[0] if late else None
        self.after_hooks = tuple(h for h in hooks if type(h).after_record is not Hook.after_record)

    def after(self, s: Step, write: Write) -> None:
        """The after hooks' records for step ``s``; the time of a hook that states its own
        (:attr:`Hook.states_its_cost`) is kept apart from the harvest's (:meth:`take_apart_ns`)."""
        for hook in self.after_hooks:
            if hook.states_its_cost:
                t0 = self.cost_clock()
                hook.after_record(s, write)
                self._apart_ns += self.cost_clock() - t0
            else:
                hook.after_record(s, write)

    def take_apart_ns(self) -> int:
        """The stating hooks' time since the last call (which a harvest leaves out of its cost)."""
        ns, self._apart_ns = self._apart_ns, 0
        return ns

    def plan(self, pending: deque[Step], log: LogSink, summary: SummarySink,
             share_us: float) -> tuple[tuple[Any, ...] | None, int]:
        """The C harvest's plan (``_fold.c``'s ``harvest_steps``) for the steps pending now, and
        how many of them it covers: (None, 0) where it covers none.

        It covers the steps pending when it is made, and none queued later: the hooks' state it
        reads (:meth:`Hook.quiet`) then already holds all that happened in those steps.  It
        needs the C build of their backend's records, no budget, a log stamped with
        ``run_id`` alone, and hooks whose record methods need no call per step (the late
        hook's ``late`` may: the C harvest calls it, and holds what it gives a token)."""
        n = len(pending)  # (before the hooks are asked)
        if not n or _NATIVE.harvest is None or self.budget is not None or not log.plain:
            return None, 0
        b = pending[0].backend
        host = None
        if b.has_device_timing:
            if _NATIVE.build is None or not b.has_device_memory or b.gpu_reason or b.memory_reason:
                return None, 0
        else:
            if b.has_device_memory or _NATIVE.build_host is None:
                return None, 0
            host = self._host_reasons(b)
            if host is None:
                return None, 0
        owners, before = [], None
        for hook in (*self._record_hooks, *self.after_hooks):
            q = hook.quiet(b)
            if q is None or q.fields or q.reasons:
                return None, 0
            if q.tracks_peak:
                owners.append(hook)
            if q.before is not None:
                before = q.before if before is None else min(before, q.before)
        late = self.held.late
        q = late.quiet(b) if late is not None else None
        timed = b.has_device_timing
        return (
            b, b.device, host, self._phase_peaks_why, self._unix0, self._clock0, share_us,
            q.fields if q is not None else None, q.reasons if q is not None else None, late if q is None else None,
            self.held.entries, _ENCODE, b.read_marks if timed else None,
            (b.release_marks if b.event_pool is None else b.event_pool) if timed else None,
            self._keep_end_marks, log.run_id, summary.add_step, tuple(owners),
            late.span_plan() if late is not None and q is None else None, summary.fold_plan(),
            before,  # (the last: harvest reads it)
        ), n

    def _not_sampled(self) -> str:
        """Why a light step has no GPU figures (the interval it was chosen under)."""
        budget = self.budget
        assert budget is not None
        why = self._not_sampled_why
        if why is None or why[0] != budget.interval:
            why = self._not_sampled_why = (budget.interval, budget.reason(budget.interval))
        return why[1]

    def _host_reasons(self, b: Backend) -> tuple[str, ...] | None:
        """:func:`host_reasons` of ``b``, worked out once per backend."""
        if self._host[0] is not b:
            self._host = (b, host_reasons(b))
        return self._host[1]

    def build(self, s: Step) -> tuple[dict[str, Any], tuple[Any, ...] | None]:
        """Build a completed step's record, hand it to the hooks, release its marks; with the
        late hook's token (None: it has no late field)."""
        b = s.backend
        record = build_step_record(
            s, b, start_unix_s=self._unix0 + (s.t0 - self._clock0) / 1e9,
            phase_peaks_why=self._phase_peaks_why,
            not_sampled=self._not_sampled() if s.sampled == 0 else None, host=self._host_reasons(b),
        )
        for hook in self._record_hooks:
            hook.on_record(s, record)
        late = self.held.late
        token = late.late(s, record) if late is not None else None
        if b.has_device_timing:  # (the host's marks are None: none to release)
            b.release_marks(s.flat, s.end_mark if self._keep_end_marks else None)
        return record, token


_native.use(use_native)
