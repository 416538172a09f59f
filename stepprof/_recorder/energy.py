"""Energy per step (``Profiler(energy_every_s=...)``): NVML's energy counter, sampled off the training thread.

A sampler thread reads the GPU's total energy counter (``nvmlDeviceGetTotalEnergyConsumption``,
about 3.4 ms a read) every ``energy_every_s`` and keeps (host time, millijoules) pairs, the
host time being the middle of the read on the profiler's clock.  The collector gives each
CUDA step of the training thread the energy of its span, the counter interpolated linearly
in time between samples.

A step's span runs from the previous step's end to its own end (the first step from its own
start), so the steps tile the timeline: energy spent between two steps (data loading, say)
goes to the step after.  The ends are on the device's timeline where the step has GPU time:
the step's GPU work starts once the host recorded its start event and the stream finished
the previous step (``max(t0, previous end)``) and lasts ``gpu_ms``; it ends no earlier than
the host's ``t1`` and no later than when the collector saw its end event complete.  A step
without GPU time (a light step under ``overhead_budget``) is shifted by the last known lag.
Over consecutive steps the interpolation errors cancel: the sum of their ``energy_j`` is the
counter's difference between the window's two ends.

A step's record waits for a sample taken after its span (:meth:`EnergyHook.fill`), so the
log lags by up to ``energy_every_s`` more, built and encoded (:mod:`.held` says why).  At close the sampler takes a last sample once the
device is done, and nothing waits.  The training thread makes no call for any of this: the
sampler starts when the collector first sees a CUDA step.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from typing import Any

import orjson

from .. import _native
from .._errors import raised_by_user
from .._signals import start_thread
from .._device import nvml
from .._device.backend import Backend
from .hooks import Closing, Hook, Quiet
from .step import Step

ON_HOST = "energy is read from a CUDA GPU's NVML counter; the CPU's is not measured"
OTHER_THREAD = "steps of other threads overlap the training thread's: energy goes to the training thread's steps"
NOT_YET = "no energy sample covers this step: it began before the sampler's first sample"
ENERGY_OFF = "energy sampling is off (energy_every_s=None)"

#: The readers' factory: the device's identity -> (read, None) or (None, why not).
OpenCounter = Callable[[Backend], tuple[nvml.EnergyRead | None, str | None]]


def open_counter(b: Backend) -> tuple[nvml.EnergyRead | None, str | None]:
    """The NVML energy counter of the backend's GPU (called on the sampler thread)."""
    uuid, pci = b.identity()
    return nvml.energy_counter(uuid, pci)


class Sampler:
    """The thread that reads the energy counter every ``every_s``, and its samples.

    Samples are (host ns, mJ) in two lists, oldest first; :meth:`trim` drops the ones no
    later step needs.  A failed read stops the thread, and :attr:`reason` says why.

    No lock: the sampler thread only appends, ``mj`` before ``times``, and the collector (the
    only reader) only drops the same number from both heads, each one list operation under
    the GIL; so every index into ``times`` is one into ``mj`` with the same sample.
    """

    def __init__(self, b: Backend, every_s: float, clock: Callable[[], int], opener: OpenCounter) -> None:
        self.times: list[int] = []
        self.mj: list[int] = []
        self.reason: str | None = None  # why no (more) samples come
        self._every_s = every_s
        self._clock = clock
        self._open = opener
        self._backend = b
        self._stop = threading.Event()
        self._final = False
        self._ended = False  # the thread's loop returned (read without a lock: one flag)
        self.thread = threading.Thread(target=self._loop, name="stepprof-energy", daemon=True)
        start_thread(self.thread)

    @property
    def running(self) -> bool:
        """Whether more samples may come (the thread is up and no read has failed).

        Two flags, not ``Thread.is_alive()``, which takes a lock: the collector asks for
        every record that waits for its sample."""
        return self.reason is None and not self._ended and self.thread.ident is not None

    def _loop(self) -> None:
        try:
            self._sample_until_stopped()
        finally:
            self._ended = True

    def _sample_until_stopped(self) -> None:
        try:
            read, why = self._open(self._backend)
        except Exception as e:  # noqa: BLE001 - no energy, never a broken run
            if raised_by_user(e):
                raise
            read, why = None, f"opening NVML's energy counter failed: {type(e).__name__}: {e}"
        if read is None:
            self.reason = f"NVML's energy counter is unavailable: {why}"
            return
        while self._sample(read):
            if self._stop.wait(self._every_s):
                if self._final:
                    self._sample(read)
                return

    def _sample(self, read: nvml.EnergyRead) -> bool:
        t0 = self._clock()
        try:
            value, why = read()
        except Exception as e:  # noqa: BLE001
            if raised_by_user(e):
                raise
            value, why = None, f"{type(e).__name__}: {e}"
        t = (t0 + self._clock()) // 2  # the read takes milliseconds: date it at its middle
        if value is None:
            self.reason = f"reading NVML's energy counter failed: {why}"
            return False
        if self.mj and value < self.mj[-1]:
            self.reason = "NVML's energy counter went backwards (the driver was reloaded?)"
            return False
        self.mj.append(value)  # before its time: see the class's docstring
        self.times.append(t)
        return True

    def latest(self) -> int | None:
        """The host time of the latest sample, or None."""
        times = self.times
        return times[-1] if times else None

    def energy_j(self, a: int, e: int) -> float | None:
        """The counter's increase from host time ``a`` to ``e``, interpolated; None if not covered."""
        ts, mj = self.times, self.mj
        if not ts or a < ts[0] or e > ts[-1]:
            return None
        return (_at(ts, mj, e) - _at(ts, mj, a)) / 1e3

    def trim(self, before: int) -> None:
        """Drop samples no span from ``before`` on needs (keeps the last one at or before it)."""
        i = bisect.bisect_right(self.times, before) - 1
        if i > 64:  # drop in batches: a list's head is costly to remove
            del self.times[:i]
            del self.mj[:i]

    def stop(self, final: bool) -> None:
        """Stop the thread (after a last sample if ``final``) and wait for it."""
        self._final = final
        self._stop.set()
        if self.thread is not threading.current_thread() and self.thread.is_alive():
            self.thread.join()  # one whose start() an interrupt cut short never started


def _at(ts: list[int], mj: list[int], t: int) -> float:
    """The counter at host time ``t`` (within the samples), linear between the two around it."""
    i = bisect.bisect_left(ts, t)
    if ts[i] == t:
        return float(mj[i])
    t0, t1 = ts[i - 1], ts[i]
    return mj[i - 1] + (mj[i] - mj[i - 1]) * (t - t0) / (t1 - t0)


class _Native:
    """``_fold.c``'s ``fill_energy`` while the C module is loaded, else None."""

    fill: Callable[..., tuple[int, int, int | None]] | None = None


_NATIVE = _Native()


def use_native() -> None:
    mod = _native.module()
    _NATIVE.fill = getattr(mod, "fill_energy", None) if mod is not None else None


def _no_timing(b: Backend) -> str:
    """Why the steps of a backend without device timing have no energy."""
    return ON_HOST if not b.has_device_memory else (b.gpu_reason or ON_HOST)


class EnergyHook(Hook):
    """``energy_j`` and ``energy_span_ms`` on the step records (see the module's docstring).

    Args:
        every_s: ``energy_every_s``.
        clock: the profiler's step clock (the samples are dated on it).
        opener: opens the energy counter (tests replace it; default NVML's).
    """

    def __init__(self, every_s: float, clock: Callable[[], int], opener: OpenCounter = open_counter) -> None:
        self.every_s = every_s
        self._clock = clock
        self._opener = opener
        self.sampler: Sampler | None = None
        self._stopped: str | None = None  # why no sampler may start (a forked child)
        #: [the previous training-thread step's span end (None: none yet), its end less its host
        #: t1]: a list, which the C harvest's span (``_fold.c``'s ``energy_span``) moves on too.
        self._span: list[Any] = [None, 0]
        #: A step waits at most this long past its end for a sample (a stuck NVML call).
        self._patience_ns = int((10 * every_s + 5) * 1e9)

    # -- collector ------------------------------------------------------------------

    def late(self, step: Step, record: dict[str, Any]) -> tuple[int, int] | None:
        """The step's span (start, end) to :meth:`fill` once a sample after it came; the fields
        null with the reason now where no sample can cover it."""
        b = step.backend
        why = span_ms = None
        if not b.has_device_timing:
            why = _no_timing(b)
        elif step.thread is not None:
            why = OTHER_THREAD
        else:
            sampler = self.sampler
            if sampler is None and self._stopped is None:  # the first CUDA step starts it
                sampler = self.sampler = Sampler(b, self.every_s, self._clock, self._opener)
            if sampler is None:
                why = f"no energy sample: {self._stopped} before the sampler started"
            else:
                start, end = self._span_of(step)
                first = sampler.times[0] if sampler.times else None
                if first is not None and start >= first:
                    return start, end
                # Before the sampler's first sample (or none yet): no later one covers it.
                why = sampler.reason or NOT_YET
                span_ms = (end - start) / 1e6
        record["energy_j"] = None
        record["energy_span_ms"] = span_ms
        unavailable = record["unavailable"]
        unavailable["energy_j"] = why
        if span_ms is None:
            unavailable["energy_span_ms"] = why
        return None

    def quiet(self, b: Backend) -> Quiet | None:
        """A backend without device timing: the fields null, with the same reason, on every record."""
        if b.has_device_timing:
            return None
        why = _no_timing(b)
        return Quiet({"energy_j": None, "energy_span_ms": None}, {"energy_j": why, "energy_span_ms": why})

    def span_plan(self) -> tuple[list[Any], list[int], Callable[[], int]] | None:
        """The span state, the sampler's times (the same list while it runs) and the clock, for
        the C harvest's span (to the same bits); None before the sampler started (:meth:`late`
        starts it)."""
        sampler = self.sampler
        return None if sampler is None else (self._span, sampler.times, self._clock)

    def _span_of(self, s: Step) -> tuple[int, int]:
        """(start, end) of a training-thread CUDA step's span; the next one starts at its end."""
        now = self._clock()
        span = self._span
        prev, lag = span
        gpu_ms = s.gpu_ms()
        if gpu_ms is not None:
            start = s.t0 if prev is None else max(s.t0, prev)
            end = max(start + round(gpu_ms * 1e6), s.t1)
        else:
            start = s.t0 + lag
            end = s.t1 + lag
        end = max(min(end, now), s.t1)  # its end event had completed by now
        if prev is not None:
            end = max(end, prev)
            start = prev
        span[0], span[1] = end, end - s.t1
        return start, end

    def fill_many(self, entries: Any, final: bool, limit: int, add_late: Any, out: list[bytes],
                  fold: tuple[Any, Any] | None = None) -> tuple[int, int]:
        """:meth:`fill` for the records whose span the samples cover, in C (``_fold.c``'s
        ``fill_energy``, to the same bits); the rest, one by one, by :meth:`fill`.  ``fold``:
        the summary's :meth:`~.sinks.SummarySink.fold_plan`, into which C folds a timed
        record's energy itself while the run has one name (else ``add_late``)."""
        fill, sampler = _NATIVE.fill, self.sampler
        if fill is None or sampler is None:
            return 0, 0
        done, lines, last = fill(entries, sampler.times, sampler.mj, limit, final, orjson.dumps, add_late, out, fold)
        if last is not None:
            sampler.trim(last)
        return done, lines

    def fill(
        self, token: tuple[int, int], final: bool, why: str | None = None
    ) -> tuple[dict[str, Any], dict[str, str]] | None:
        """``energy_j`` over the span, once a sample at or after its end came (None until then;
        null with the reason if the sampler stopped first, or none came within the patience,
        or ``why`` when ``final`` came first)."""
        start, end = token
        sampler = self.sampler
        assert sampler is not None  # (a token is only given once it started; a fork drops both)
        times = sampler.times
        if not final and (not times or times[-1] < end):  # (the usual case: checked first)
            if self._clock() - end < self._patience_ns and sampler.running:
                return None
        energy = sampler.energy_j(start, end)
        sampler.trim(start)
        fields = {"energy_j": energy, "energy_span_ms": (end - start) / 1e6}
        if energy is not None:
            return fields, {}
        return fields, {"energy_j": sampler.reason or why or (
            "no energy sample after the step's end: the sampler stopped, or none came within the wait")}

    # -- close and fork ---------------------------------------------------------------

    def on_finish(self) -> None:
        """At close, the pending steps' events complete: a last sample covers them all."""
        self._stopped = self._stopped or "the profiler closed"
        sampler = self.sampler
        if sampler is not None:
            sampler.stop(final=True)

    def on_close(self, closing: Closing) -> None:
        """Stop the sampler (if :meth:`on_finish` did not)."""
        self._stopped = self._stopped or "the profiler closed"
        sampler = self.sampler
        if sampler is not None:
            sampler.stop(final=False)

    def forget(self, why: str) -> None:
        """In a forked child: the sampler thread is the parent's (the child has none)."""
        self.sampler = None
        self._stopped = why


_native.use(use_native)
